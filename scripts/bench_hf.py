#!/usr/bin/env python3
"""HF transformers' prefill and batch-1 decode speed on a model directory (CPU).

Usage: bench_hf.py MODEL_DIR DTYPE(bf16|f32) [--threads 2] [--prompt-len 512] [--decode 32]
Prints one JSON object. The same measurements as `strata model bench`: median prefill
tokens/s over 3 runs, median decode step time over `--decode` cached steps.
"""
import argparse
import json
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("dtype", choices=["bf16", "f32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    print(f"loading {a.model} as {dtype}", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).eval()
    vocab = model.config.vocab_size
    prompt = torch.tensor([[(i * 7919 + 13) % vocab for i in range(a.prompt_len)]])
    with torch.inference_mode():
        model(prompt)  # warm-up of the measured length, as strata model bench and llama-bench
        prefill = []
        for r in range(a.repeats):
            t = time.perf_counter()
            model(prompt)
            prefill.append(a.prompt_len / (time.perf_counter() - t))
            print(f"prefill {r + 1}/{a.repeats}: {prefill[-1]:.1f} tok/s", file=sys.stderr)
        out = model(prompt[:, :16], use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        steps = []
        for i in range(a.decode):
            t = time.perf_counter()
            out = model(nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            steps.append(time.perf_counter() - t)
            if (i + 1) % 8 == 0:
                print(f"decode {i + 1}/{a.decode}: {1 / statistics.median(steps):.2f} tok/s", file=sys.stderr)
    print(json.dumps(dict(threads=a.threads, dtype=a.dtype, torch=torch.__version__,
                          prefill_tokens_per_s=statistics.median(prefill),
                          decode_tokens_per_s=1 / statistics.median(steps))))


if __name__ == "__main__":
    main()
