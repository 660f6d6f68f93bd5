#!/usr/bin/env bash
# Overhead of the serving path: 1-token generations on a tiny model through `strata serve`
# over gRPC vs the same generation in-process, measured one after the other.
#   scripts/bench_serving_overhead.sh [requests]      (needs target/release/strata)
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=${STRATA:-target/release/strata}
N=${1:-1000}
MODEL=tests/fixtures/models/llama_gqa
log=$(mktemp)
ready=$(mktemp)
"$STRATA" serve --model "$MODEL" --name tiny --listen 127.0.0.1:0 >"$ready" 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$log" "$ready"' EXIT
addr=$(scripts/ready_address.sh "$ready" $pid 10)
local_json=$(RUST_LOG=warn "$STRATA" model latency --model "$MODEL" --requests "$N")
grpc_json=$(RUST_LOG=warn "$STRATA" model latency --endpoint "http://$addr" --model tiny --requests "$N")
python3 - "$local_json" "$grpc_json" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print("| path | requests | p50 ms | p90 ms | p99 ms |")
print("|---|---|---|---|---|")
for r in (a, b):
    print(f"| {r['mode']} | {r['requests']} | {r['p50_ms']:.3f} | {r['p90_ms']:.3f} | {r['p99_ms']:.3f} |")
print(f"| added by serving | | {b['p50_ms'] - a['p50_ms']:.3f} | {b['p90_ms'] - a['p90_ms']:.3f} | {b['p99_ms'] - a['p99_ms']:.3f} |")
PY
