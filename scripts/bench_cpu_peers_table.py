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


def llama(run, n_prompt, n_gen):
    for r in run or []:
        if r["n_prompt"] == n_prompt and r["n_gen"] == n_gen:
            return r["avg_ts"]
    return None


class Rounds:
    """Each measure per round (None where a peer was not run)."""

    def __init__(self, d):
        n = len(glob.glob(os.path.join(d, "strata-bf16-*.json")))
        at = lambda name, r: load(os.path.join(d, f"{name}-{r}.json"))
        self.n = n
        self.m = {}
        for r in range(1, n + 1):
            bf16, int8 = at("strata-bf16", r), at("strata-int8", r)
            lb, lq, hf = at("llama-bench-bf16", r), at("llama-bench-q8_0", r), at("hf", r)
            batched, hfb, serve = at("llama-batched", r), at("hf-batched", r), at("serve-default", r)
            row = {
                "prefill": bf16["prefill_tokens_per_s"],
                "decode": bf16["decode_tokens_per_s"],
                "share": bf16["decode_share_of_roofline"],
                "bandwidth": bf16["bandwidth_gb_per_s"],
                "dec32": dict(bf16["batched_decode"]).get(32),
                "int8": int8["decode_tokens_per_s"],
                "int8_share": int8["decode_share_of_roofline"],
                "serve": serve and serve["output_tokens_per_s"],
                "ttft": serve and serve["ttft_ms"]["p50"],
                "itl": serve and serve["itl_ms"]["p50"],
                "l_prefill": llama(lb, 512, 0),
                "l_decode": llama(lb, 0, 64),
                "l_q8": llama(lq, 0, 64),
                # llama-batched-bench: output tokens over the whole run (prompt processing
                # included), what a serving benchmark's output tok/s counts; and its
                # decode-only speed.
                "l_serve": batched and batched["pl"] * batched["tg"] / batched["t"],
                "l_dec32": batched and batched["speed_tg"],
                "h_prefill": hf and hf["prefill_tokens_per_s"],
                "h_decode": hf and hf["decode_tokens_per_s"],
                "h_serve": hfb and hfb[0]["output_tokens_per_s"],
                "kernels": bf16.get("cpu_kernels"),
                "gemm": bf16.get("prefill_gemm_kernels"),
                "commit": (lb or [{}])[0].get("build_commit"),
            }
            for k, v in row.items():
                self.m.setdefault(k, []).append(v)

    def med(self, key):
        return med(self.m.get(key, []))

    def ratio(self, a, b):
        """The median over rounds of a / b, and the range."""
        rs = [x / y for x, y in zip(self.m[a], self.m[b]) if x is not None and y]
        if not rs:
            return "n/a"
        return f"{statistics.median(rs):.2f}× ({min(rs):.2f}–{max(rs):.2f})"


def main():
    d = sys.argv[1]
    R = Rounds(d)
    m = R.med
    kernels = ", ".join(sorted({k for k in R.m["kernels"] if k}))
    gemm = ", ".join(sorted({k for k in R.m["gemm"] if k})) or "n/a"
    commit = next((c for c in R.m["commit"] if c), "n/a")
    print(f"{R.n} rounds; CPU kernels {kernels} (prefill GEMM {gemm}); bandwidth {fmt(m('bandwidth'))} GB/s (median); llama.cpp build {commit}")
    print()
    print("| measure (median of rounds) | Strata | llama.cpp | HF transformers | Strata / llama.cpp | Strata / HF |")
    print("|---|---|---|---|---|---|")
    print(f"| prefill, 512-token prompt, bf16 (tok/s) | {fmt(m('prefill'))} | {fmt(m('l_prefill'))} | {fmt(m('h_prefill'))} | {R.ratio('prefill', 'l_prefill')} | {R.ratio('prefill', 'h_prefill')} |")
    print(f"| batch-1 decode, bf16 (tok/s) | {fmt(m('decode'), 2)} ({100 * m('share'):.0f}% of roofline) | {fmt(m('l_decode'), 2)} | {fmt(m('h_decode'), 2)} | {R.ratio('decode', 'l_decode')} | {R.ratio('decode', 'h_decode')} |")
    print(f"| decode step at 32 sequences, bf16 (output tok/s) | {fmt(m('dec32'))} | {fmt(m('l_dec32'))} | n/a | {R.ratio('dec32', 'l_dec32')} | n/a |")
    print(f"| serving, 32 concurrent, 64 in + 32 out, bf16 (output tok/s) | {fmt(m('serve'))} | {fmt(m('l_serve'))} | {fmt(m('h_serve'))} | {R.ratio('serve', 'l_serve')} | {R.ratio('serve', 'h_serve')} |")
    print(f"| batch-1 decode, int8 / q8_0 (tok/s) | {fmt(m('int8'), 2)} ({100 * m('int8_share'):.0f}% of roofline) | {fmt(m('l_q8'), 2)} | n/a | {R.ratio('int8', 'l_q8')} | n/a |")
    print()
    print(f"int8 / bf16 batch-1 decode: {R.ratio('int8', 'decode')}; serving TTFT p50 {fmt(m('ttft'), 0)} ms, "
          f"ITL p50 {fmt(m('itl'), 0)} ms. Ratios: median over rounds of each round's ratio (range).")
    print()
    print("| round | bandwidth GB/s | prefill S / llama / HF | decode S (share) / llama | int8 S / q8_0 | serving S / llama / HF |")
    print("|---|---|---|---|---|---|")
    for i in range(R.n):
        g = lambda k, digits=1: fmt(R.m[k][i], digits)
        print(f"| {i + 1} | {g('bandwidth')} | {g('prefill')} / {g('l_prefill')} / {g('h_prefill')} | "
              f"{g('decode', 2)} ({100 * R.m['share'][i]:.0f}%) / {g('l_decode', 2)} | {g('int8', 2)} / {g('l_q8', 2)} | "
              f"{g('serve')} / {g('l_serve')} / {g('h_serve')} |")
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
