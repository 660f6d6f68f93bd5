#!/usr/bin/env python3
"""The measurements of scripts/bench_scoring.sh, one JSON object of medians each:
  bench_scoring.py strata BASE_URL     scoring and embedding over HTTP (model "m")
  bench_scoring.py hf MODEL_DIR        HF transformers on the same model (torch, CPU)
  bench_scoring.py combine A.json B.json   both, with the ratios

- prompt scoring: a PROMPT-token prompt, max_tokens 1 — plain; with `echo` + `logprobs: 1`
  (lm-eval's loglikelihood request); with `prompt_logprobs: 5` — against HF computing the
  same log-softmax over every position (one forward, gather).
- embeddings: INPUTS inputs of EMBED tokens in one /v1/embeddings request (last-token
  pooling, normalized) against HF's batched forward + pooling.
"""
import json
import os
import statistics
import sys
import time

PROMPT, INPUTS, EMBED, RUNS = 512, 32, 128, int(os.environ.get("RUNS", "7"))


def ids(n, salt):
    return [1] + [(i * 7919 + salt * 104729) % 120000 + 1000 for i in range(n - 1)]


def timed(fn):
    times = []
    for i in range(RUNS + 1):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first warms


def strata(client, BASE):
    def completion(extra):
        def run(i):
            body = {"model": "m", "prompt": ids(PROMPT, i), "max_tokens": 1, "temperature": 0, "cache": False, **extra}
            r = client.post(BASE + "/v1/completions", json=body)
            r.raise_for_status()
            return r.json()
        return run

    out = {
        "prefill_s": timed(completion({})),
        "echo_logprobs_s": timed(completion({"echo": True, "logprobs": 1})),
        "prompt_logprobs_s": timed(completion({"prompt_logprobs": 5})),
    }

    def embed(i):
        body = {"model": "m", "input": [ids(EMBED, i * INPUTS + k) for k in range(INPUTS)], "encoding_format": "float"}
        r = client.post(BASE + "/v1/embeddings", json=body)
        r.raise_for_status()

    out["embed_s"] = timed(embed)
    return out


def hf(MODEL_DIR):
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count())
    lm = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16).eval()

    def score(i):
        x = torch.tensor([ids(PROMPT, i)])
        with torch.no_grad():
            lp = torch.log_softmax(lm(x).logits[0, :-1].float(), -1)
            lp.gather(1, x[0, 1:, None])

    out = {"hf_score_s": timed(score)}
    base = AutoModel.from_pretrained(MODEL_DIR, dtype=torch.bfloat16).eval()

    def embed(i):
        x = torch.tensor([ids(EMBED, i * INPUTS + k) for k in range(INPUTS)])
        with torch.no_grad():
            h = base(x).last_hidden_state[:, -1].float()
            torch.nn.functional.normalize(h, dim=-1)

    out["hf_embed_s"] = timed(embed)
    return out


def main():
    mode = sys.argv[1]
    if mode == "strata":
        import httpx2 as httpx

        with httpx.Client(timeout=600) as client:
            s = strata(client, sys.argv[2])
        s["echo_over_prefill"] = s["echo_logprobs_s"] / s["prefill_s"]
        s["prompt_logprobs_over_prefill"] = s["prompt_logprobs_s"] / s["prefill_s"]
        s["embed_inputs_per_s"] = INPUTS / s["embed_s"]
        result = s
    elif mode == "hf":
        result = hf(sys.argv[2])
    else:
        result = {}
        for path in sys.argv[2:]:
            result.update(json.load(open(path)))
        result["score_vs_hf"] = result["hf_score_s"] / result["echo_logprobs_s"]
        result["embed_vs_hf"] = result["hf_embed_s"] / result["embed_s"]
    print(json.dumps({k: round(v, 4) for k, v in result.items()}, indent=1))


if __name__ == "__main__":
    main()
