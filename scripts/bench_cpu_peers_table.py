#!/usr/bin/env python3
"""Markdown tables for docs/PERFORMANCE.md from scripts/bench_cpu_peers.sh's JSON.

Usage: bench_cpu_peers_table.py DIR   (DIR holds the run's raw JSON)
"""
import glob
import json
import os
import statistics
import sys


def load(path):
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    with open(path) as f:
        text = f.read().strip()
    return json.loads(text.splitlines()[-1]) if text.startswith("{") and "\n" in text else json.loads(text)


def runs(d, pattern):
    return [load(p) for p in sorted(glob.glob(os.path.join(d, pattern)))]


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v, digits=1):
    return "n/a" if v is None else f"{v:.{digits}f}"


def ratio(a, b):
    return "n/a" if a is None or not b else f"{a / b:.2f}×"


def llama(d, tag, n_prompt, n_gen):
    rows = load(os.path.join(d, f"llama-bench-{tag}.json")) or []
    for r in rows:
        if r["n_prompt"] == n_prompt and r["n_gen"] == n_gen:
            return r["avg_ts"], r.get("build_commit")
    return None, None


def pairs(d):
    """Batch-1 decode in alternating pairs of runs: medians, and the median of each pair's ratio."""
    strata = runs(d, "pair-strata-*.json")
    llama_runs = runs(d, "pair-llama-*.json")
    if not strata or not llama_runs:
        return
    tps = [r["decode_tokens_per_s"] for r in strata]
    share = [r["decode_tokens_per_s"] / r["roofline_decode_tokens_per_s"] for r in strata]
    bws = [r["bandwidth_gb_per_s"] for r in strata]
    lts = [r[0]["avg_ts"] for r in llama_runs]
    ratios = [a / b for a, b in zip(tps, lts)]
    print()
    print(f"batch-1 decode in {len(ratios)} alternating pairs (Strata run, then llama-bench tg64):")
    print()
    print("| | Strata (tok/s) | share of its run's roofline | bandwidth (GB/s) | llama.cpp (tok/s) | Strata / llama.cpp |")
    print("|---|---|---|---|---|---|")
    for i, (a, s, bw, b) in enumerate(zip(tps, share, bws, lts)):
        print(f"| pair {i + 1} | {a:.2f} | {100 * s:.0f}% | {bw:.1f} | {b:.2f} | {a / b:.2f}× |")
    print(f"| **median** | **{med(tps):.2f}** | **{100 * med(share):.0f}%** | {med(bws):.1f} | **{med(lts):.2f}** | **{med(ratios):.2f}×** |")


def main():
    d = sys.argv[1]
    bf16 = runs(d, "strata-bf16-*.json")
    int8 = runs(d, "strata-int8-*.json")
    serve = runs(d, "serve-default-*.json")
    hf = load(os.path.join(d, "hf.json"))
    hf_batched = load(os.path.join(d, "hf-batched.json"))
    batched = load(os.path.join(d, "llama-batched.json"))

    prefill = med(r["prefill_tokens_per_s"] for r in bf16)
    decode = med(r["decode_tokens_per_s"] for r in bf16)
    roof = med(r["roofline_decode_tokens_per_s"] for r in bf16)
    bw = med(r["bandwidth_gb_per_s"] for r in bf16)
    dec32 = med(dict(r["batched_decode"]).get(32) for r in bf16)
    i8 = med(r["decode_tokens_per_s"] for r in int8)
    i8_roof = med(r["roofline_decode_tokens_per_s"] for r in int8)
    out_tps = med(r["output_tokens_per_s"] for r in serve)
    ttft = med(r["ttft_ms"]["p50"] for r in serve)
    itl = med(r["itl_ms"]["p50"] for r in serve)

    lp, commit = llama(d, "bf16", 512, 0)
    lt, _ = llama(d, "bf16", 0, 64)
    qt, _ = llama(d, "q8_0", 0, 64)
    hp = hf and hf["prefill_tokens_per_s"]
    hd = hf and hf["decode_tokens_per_s"]
    hb = hf_batched and hf_batched[0]["output_tokens_per_s"]
    # llama-batched-bench: output tokens over the whole run (prompt processing included),
    # which is what a serving benchmark's output tok/s counts; and its decode-only speed.
    lb_out = batched and batched["pl"] * batched["tg"] / batched["t"]
    lb_tg = batched and batched["speed_tg"]

    print(f"bandwidth {fmt(bw)} GB/s; llama.cpp build {commit or 'n/a'}")
    print()
    print("| measure | Strata | llama.cpp | HF transformers | Strata / llama.cpp | Strata / HF |")
    print("|---|---|---|---|---|---|")
    print(f"| prefill, 512-token prompt, bf16 (tok/s) | {fmt(prefill)} | {fmt(lp)} | {fmt(hp)} | {ratio(prefill, lp)} | {ratio(prefill, hp)} |")
    print(f"| batch-1 decode, bf16 (tok/s) | {fmt(decode, 2)} ({100 * decode / roof:.0f}% of roofline {fmt(roof, 2)}) | {fmt(lt, 2)} | {fmt(hd, 2)} | {ratio(decode, lt)} | {ratio(decode, hd)} |")
    print(f"| decode step at 32 sequences, bf16 (output tok/s) | {fmt(dec32)} | {fmt(lb_tg)} | n/a | {ratio(dec32, lb_tg)} | n/a |")
    print(f"| serving, 32 concurrent, 64 in + 32 out, bf16 (output tok/s) | {fmt(out_tps)} | {fmt(lb_out)} | {fmt(hb)} | {ratio(out_tps, lb_out)} | {ratio(out_tps, hb)} |")
    print(f"| batch-1 decode, int8 / q8_0 (tok/s) | {fmt(i8, 2)} ({100 * i8 / i8_roof:.0f}% of roofline) | {fmt(qt, 2)} | n/a | {ratio(i8, qt)} | n/a |")
    print()
    print(f"int8 / bf16 batch-1 decode: {ratio(i8, decode)}; serving TTFT p50 {fmt(ttft, 0)} ms, ITL p50 {fmt(itl, 0)} ms")
    pairs(d)
    print()
    print("| max-batched-tokens | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
    print("|---|---|---|---|---|---|")
    for budget, pattern in [(256, "serve-budget256-*"), (512, "serve-default-*"), (1024, "serve-budget1024-*"), (2048, "serve-budget2048-*")]:
        rs = runs(d, pattern + ".json")
        if not rs:
            continue
        print(f"| {budget} | {fmt(med(r['output_tokens_per_s'] for r in rs))} | "
              f"{fmt(med(r['ttft_ms']['p50'] for r in rs), 0)} | {fmt(med(r['ttft_ms']['p99'] for r in rs), 0)} | "
              f"{fmt(med(r['itl_ms']['p50'] for r in rs), 0)} | {fmt(med(r['itl_ms']['p99'] for r in rs), 0)} |")


if __name__ == "__main__":
    main()
