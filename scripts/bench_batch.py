#!/usr/bin/env python3
"""Batch throughput vs the same requests sent online, on one running server.

Each round sends the same N completion requests twice, in alternating order: online, as
`strata batch run --concurrency C` (HTTP requests from a Rust client, C in flight), and
as a batch job through the Batch API (upload, create, poll until completed). Prints one
JSON object: per-mode output tokens per second (median over rounds) and their ratio.

Usage: bench_batch.py STRATA_BIN HTTP_ADDRESS [--requests N] [--concurrency C]
       [--prompt-len P] [--output-len T] [--rounds R]
"""
import argparse
import io
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time

import openai


def requests_file(n, prompt_len, output_len, vocab, seed):
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        body = {"model": "m", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}))
    return "\n".join(lines) + "\n"


def online(strata, http, text, concurrency):
    with tempfile.TemporaryDirectory() as d:
        inp, out = f"{d}/in.jsonl", f"{d}/out.jsonl"
        open(inp, "w").write(text)
        t = time.perf_counter()
        subprocess.run([strata, "batch", "run", "--endpoint", f"http://{http}", "--input", inp, "--output", out,
                        "--concurrency", str(concurrency)], check=True, stderr=subprocess.DEVNULL)
        elapsed = time.perf_counter() - t
        results = [json.loads(l) for l in open(out)]
    tokens = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in results if r["response"]["status_code"] == 200)
    return tokens / elapsed


def batch(client, text):
    f = client.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch")
    t = time.perf_counter()
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    while b.status not in ("completed", "failed", "cancelled"):
        time.sleep(0.05)
        b = client.batches.retrieve(b.id)
    elapsed = time.perf_counter() - t
    assert b.status == "completed" and b.request_counts.failed == 0, b
    out = client.files.content(b.output_file_id).text.splitlines()
    tokens = sum(json.loads(l)["response"]["body"]["usage"]["completion_tokens"] for l in out)
    return tokens / elapsed


def main():
    p = argparse.ArgumentParser()
    p.add_argument("strata")
    p.add_argument("http")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    client = openai.OpenAI(base_url=f"http://{a.http}/v1", api_key="unused", max_retries=0, timeout=600)
    vocab = min(client.models.retrieve("m").model_extra.get("vocab_size", 1000), 1000)
    text = requests_file(a.requests, a.prompt_len, a.output_len, vocab, seed=1)
    on, off = [], []
    for r in range(a.rounds):
        print(f"round {r + 1}/{a.rounds}", file=sys.stderr)
        if r % 2 == 0:
            on.append(online(a.strata, a.http, text, a.concurrency))
            off.append(batch(client, text))
        else:
            off.append(batch(client, text))
            on.append(online(a.strata, a.http, text, a.concurrency))
    med_on, med_off = statistics.median(on), statistics.median(off)
    print(json.dumps({
        "requests": a.requests, "concurrency": a.concurrency, "prompt_len": a.prompt_len, "output_len": a.output_len,
        "online_tok_s": [round(x, 1) for x in on], "batch_tok_s": [round(x, 1) for x in off],
        "online_median": round(med_on, 1), "batch_median": round(med_off, 1), "batch_over_online": round(med_off / med_on, 3),
    }))


if __name__ == "__main__":
    main()
