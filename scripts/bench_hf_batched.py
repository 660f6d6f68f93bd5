#!/usr/bin/env python3
"""HF transformers' own batched generate on a model directory (CPU), for comparison with
`strata bench`: for each batch size, one generate() of that many random prompts of
--input-len tokens and exactly --output-len new tokens; output tokens/s = batch × output
/ wall time (prefill included, as in a serving benchmark's throughput).

Usage: bench_hf_batched.py MODEL_DIR [--batches 1,8,32] [--input-len 64] [--output-len 32]
"""
import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).eval()
    g = torch.Generator().manual_seed(0)
    results = []
    for b in [int(x) for x in a.batches.split(",")]:
        ids = torch.randint(3, model.config.vocab_size, (b, a.input_len), generator=g)
        with torch.inference_mode():
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.output_len,
                                 min_new_tokens=a.output_len, do_sample=False, pad_token_id=0)
            secs = time.perf_counter() - t
        new = (out.shape[1] - a.input_len) * b
        results.append(dict(batch=b, seconds=secs, output_tokens_per_s=new / secs))
        print(f"batch {b}: {new / secs:.1f} output tok/s", file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
