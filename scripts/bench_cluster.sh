#!/usr/bin/env bash
# Cluster-mode benchmark (real etcd, 2 coordinators, 4 worker processes on loopback):
# ScaleReplicas → ready for the tiny fixture and the Llama-3.2-1B shape (bf16), kill -9
# of a streaming worker → its streams' next token, and routing overhead with 2
# coordinators. Needs etcd (make prerequisites).
#
#   scripts/bench_cluster.sh [repeats]
#
# Prints a markdown table for docs/PERFORMANCE.md; raw JSON goes to target/bench/.
set -euo pipefail
cd "$(dirname "$0")/.."
REPEATS=${1:-5}
cargo build --release --bin strata -p strata-coordinator
cargo build --release --bin cluster-bench -p strata-tests
STRATA=target/release/strata
mkdir -p target/bench target/bench-models
big=target/bench-models/llama-1b-bf16
[ -f "$big/model.safetensors" ] || "$STRATA" model random --preset llama-1b --dtype bf16 --out "$big"
slow=target/bench-models/stream-21m
[ -f "$slow/model.safetensors" ] || "$STRATA" model random --arch llama --hidden 512 --layers 6 --heads 8 \
  --kv-heads 4 --intermediate 1536 --vocab 2048 --out "$slow"
STRATA_BIN=$STRATA target/release/cluster-bench --model tests/fixtures/models/llama_gqa --model "$big" \
  --stream-model "$slow" --repeats "$REPEATS" --requests 1000 > target/bench/cluster.json
python3 - target/bench/cluster.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("| measurement | median | detail |")
print("|---|---|---|")
for s in r["scale"]:
    runs = ", ".join(f"{x:.3f}" for x in s["scale_to_ready_s"])
    print(f"| ScaleReplicas 1→2 until ready, {s['model']} | {s['scale_to_ready_s_median']:.3f} s | runs: {runs} s |")
f = r["failover"]
runs = ", ".join(f"{x:.3f}" for x in f["kill_to_every_streams_next_token_s"])
print(f"| kill -9 of a streaming worker → every stream's next token | {f['kill_to_every_streams_next_token_s_median']:.3f} s | worst stream per kill: {runs} s |")
ro = r["routing"]
v, d = ro["via_coordinators_ms"], ro["direct_to_worker_ms"]
print(f"| 1-token request via 2 coordinators | {v['p50']:.3f} ms | p90 {v['p90']:.3f}, p99 {v['p99']:.3f} ms |")
print(f"| same, straight to the replica's rank 0 (worker.v1) | {d['p50']:.3f} ms | p90 {d['p90']:.3f}, p99 {d['p99']:.3f} ms |")
print(f"| routing overhead per request (p50 difference) | {ro['overhead_p50_ms']:.3f} ms | {ro['requests']} requests each |")
PY
