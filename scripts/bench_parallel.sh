#!/usr/bin/env bash
# Tensor/pipeline parallelism on CPU: the TCP communicator's all-reduce vs a raw loopback
# TCP stream, then batch-1 decode step time at TP=1, TP=2 and PP=2 on the
# Llama-3.2-1B-shape model (ranks as threads of one process, sharing the machine's cores),
# with the share of each step the leader spends in the communicator.
#   scripts/bench_parallel.sh      (needs target/release/strata)
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=${STRATA:-target/release/strata}
MODEL=${MODEL:-target/bench-models/llama-1b-bf16}
out=target/bench
mkdir -p "$out"
[ -f "$MODEL/model.safetensors" ] || "$STRATA" model random --preset llama-1b --dtype bf16 --out "$MODEL"
RUST_LOG=warn "$STRATA" comm-bench --ranks 2 > "$out/comm.json"
for split in "1 1" "2 1" "1 2"; do
  set -- $split
  echo "== decode, tp=$1 pp=$2" >&2
  RUST_LOG=warn "$STRATA" model bench --model "$MODEL" --tp "$1" --pp "$2" --prompt-len 64 \
    --decode-tokens 16 --repeats 1 > "$out/par-tp$1-pp$2.json"
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
c = json.load(open(f"{out}/comm.json"))
print(f"raw loopback TCP stream: {c['raw_tcp_gb_per_s']:.2f} GB/s\n")
print("| all-reduce (2 ranks) | p50 µs | algbw GB/s | busbw GB/s | busbw / raw TCP |")
print("|---|---|---|---|---|")
for r in c["all_reduce"]:
    size = f"{r['bytes'] >> 20} MiB" if r["bytes"] >= 1 << 20 else f"{r['bytes'] >> 10} KiB"
    print(f"| {size} | {r['p50_us']:.0f} | {r['algbw_gb_per_s']:.2f} | {r['busbw_gb_per_s']:.2f} | {r['busbw_gb_per_s'] / c['raw_tcp_gb_per_s'] * 100:.0f}% |")
print("\n| split | decode step ms (p50) | decode tok/s | leader time in communicator |")
print("|---|---|---|---|")
for tp, pp in ((1, 1), (2, 1), (1, 2)):
    r = json.load(open(f"{out}/par-tp{tp}-pp{pp}.json"))
    print(f"| TP={tp} PP={pp} | {r['decode_step_ms']:.0f} | {r['decode_tokens_per_s']:.2f} | {r['decode_comm_share'] * 100:.0f}% |")
PY
