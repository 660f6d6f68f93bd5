#!/usr/bin/env bash
# Request overhead of two `strata` builds, side by side: 1-token greedy generations on the
# tiny `llama_gqa` fixture through `strata serve`, over gRPC `Generate` and
# `GenerateStream` and HTTP `/v1/completions` streamed (`strata model latency`, the later
# build's, as a separate client process), in alternating rounds so that both builds see
# the same machine. Prints each round's p50s, then the medians over rounds and their
# ratio.
#
#   BEFORE=path/to/strata AFTER=path/to/strata scripts/bench_request_overhead.sh [requests] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
: "${BEFORE:?BEFORE=path/to/the earlier strata}" "${AFTER:?AFTER=path/to/the later strata}"
N=${1:-500}
ROUNDS=${2:-3}
MODEL=tests/fixtures/models/llama_gqa
results=$(mktemp)
trap 'rm -f "$results"' EXIT

round() { # label binary
  local log ready pid addr http unary streamed
  log=$(mktemp); ready=$(mktemp)
  "$2" serve --model "$MODEL" --name tiny --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 >"$ready" 2>"$log" &
  pid=$!
  addr=$(scripts/ready_address.sh "$ready" $pid 20)
  http=$(python3 -c 'import json,sys
for l in open(sys.argv[1]):
    try: e = json.loads(l)
    except ValueError: continue
    if e.get("event") == "http": print(e["address"]); break' "$ready")
  # The same client (the later build's) measures both servers.
  unary=$(RUST_LOG=warn "$AFTER" model latency --endpoint "http://$addr" --model tiny --requests "$N")
  streamed=$(RUST_LOG=warn "$AFTER" model latency --endpoint "http://$addr" --http "http://$http" \
    --model tiny --requests "$N" --tokens 1)
  python3 - "$1" "$unary" "$streamed" >>"$results" <<'PY'
import json, sys
label, unary = sys.argv[1], json.loads(sys.argv[2])
streamed = {r["mode"]: r for r in map(json.loads, sys.argv[3].splitlines())}
print(json.dumps({
    "label": label,
    "grpc_unary": unary["p50_ms"],
    "grpc_stream": streamed["grpc-stream-total"]["p50_ms"],
    "http_sse": streamed["http-sse-total"]["p50_ms"],
}))
PY
  kill $pid 2>/dev/null || true
  wait $pid 2>/dev/null || true
  rm -f "$log" "$ready"
}

for r in $(seq "$ROUNDS"); do
  round before "$BEFORE"
  round after "$AFTER"
done
python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
keys = (("grpc_unary", "gRPC Generate"), ("grpc_stream", "gRPC GenerateStream"), ("http_sse", "HTTP /v1/completions, SSE"))
print("| round | build | " + " | ".join(n + " p50 ms" for _, n in keys) + " |")
print("|---|---|" + "---|" * len(keys))
for i, r in enumerate(rows):
    print(f"| {i // 2 + 1} | {r['label']} | " + " | ".join(f"{r[k]:.3f}" for k, _ in keys) + " |")
med = {lab: {k: statistics.median(r[k] for r in rows if r["label"] == lab) for k, _ in keys} for lab in ("before", "after")}
print()
print("| path (1 token) | before: median p50 ms | after | after / before |")
print("|---|---|---|---|")
for k, name in keys:
    print(f"| {name} | {med['before'][k]:.3f} | {med['after'][k]:.3f} | {med['after'][k] / med['before'][k]:.2f} |")
PY
