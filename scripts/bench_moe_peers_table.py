"""The table of scripts/bench_moe_peers.sh: medians over rounds, and the median (range) of
each round's Strata / llama.cpp ratio."""
import json
import os
import statistics
import sys

out, rounds = sys.argv[1], int(sys.argv[2])


def load(name):
    path = os.path.join(out, name)
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    with open(path) as f:
        text = f.read()
    return json.loads(text.splitlines()[0]) if name.startswith("llama-batched") else json.loads(text)


rows = {}  # measure -> ([strata per round], [llama per round])
for r in range(1, rounds + 1):
    s, q = load(f"strata-mixtral-{r}.json"), load(f"strata-qwen3moe-{r}.json")
    bench, batched = load(f"llama-bench-{r}.json"), load(f"llama-batched-{r}.json")
    pp = tg = None
    for run in bench or []:
        if run["n_prompt"] > 0:
            pp = run["avg_ts"]
        else:
            tg = run["avg_ts"]
    cells = {
        "prefill, 128-token prompt (tok/s)": (s["prefill_tokens_per_s"], pp),
        "batch-1 decode (tok/s)": (s["decode_tokens_per_s"], tg),
        "batch-1 decode, share of the active-weights roofline": (s["decode_share_of_roofline"], None),
        "decode at 32 sequences (output tok/s)": (dict(s["batched_decode"]).get(32), batched and batched["speed_tg"]),
        "Qwen3-MoE shape: batch-1 decode (tok/s)": (q["decode_tokens_per_s"], None),
        "Qwen3-MoE shape: share of the active-weights roofline": (q["decode_share_of_roofline"], None),
        "bandwidth (GB/s, the roofline's)": (s["bandwidth_gb_per_s"], None),
    }
    for k, v in cells.items():
        rows.setdefault(k, []).append(v)


def fmt(x):
    return "–" if x is None else (f"{x:.0%}" if x < 1.5 else f"{x:.1f}")


print(f"{rounds} rounds; medians\n")
print("| measure | Strata | llama.cpp | Strata / llama.cpp |")
print("|---|---|---|---|")
for k, vals in rows.items():
    ours = statistics.median(v[0] for v in vals)
    peers = [v[1] for v in vals if v[1] is not None]
    peer = statistics.median(peers) if peers else None
    ratios = [v[0] / v[1] for v in vals if v[1]]
    ratio = (
        f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})" if ratios else "–"
    )
    print(f"| {k} | {fmt(ours)} | {fmt(peer)} | {ratio} |")
