#!/usr/bin/env bash
# What instrumentation costs on the hot path: `strata serve` built from a revision before
# metrics and tracing existed (the baseline) against this tree's build, with span export
# off and with it on (OTLP/gRPC to a do-nothing receiver, scripts/otlp_sink.py), run
# alternately, R rounds each:
#   - 1-token greedy requests over gRPC (`strata model latency --endpoint`): p50 per request;
#   - decode throughput: `strata bench` with 8 requests in flight, 32-token prompts,
#     64 tokens each, on a 21M-parameter model: output tokens per second.
#
#   scripts/bench_instrumentation.sh [rounds] [baseline-revision]
#
# Prints a markdown table for docs/PERFORMANCE.md; raw JSON goes to target/bench/.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
BASE_REV=${2:-6dfeb28}
PY=${PYTHON:-target/pyenv/bin/python}
cargo build --release --bin strata -p strata-cli
if [ ! -x target/baseline/bin/strata ]; then
  git worktree remove --force target/baseline/src 2>/dev/null || rm -rf target/baseline/src
  git worktree prune
  git worktree add --detach target/baseline/src "$BASE_REV" >&2
  (cd target/baseline/src && CARGO_TARGET_DIR=../target cargo build --release --bin strata -p strata-cli)
  mkdir -p target/baseline/bin && cp target/baseline/target/release/strata target/baseline/bin/strata
  git worktree remove --force target/baseline/src
fi
CURRENT=target/release/strata
BASELINE=target/baseline/bin/strata
mkdir -p target/bench target/bench-models
MODEL=target/bench-models/stream-21m
[ -f "$MODEL/model.safetensors" ] || "$CURRENT" model random --arch llama --hidden 512 --layers 6 --heads 8 \
  --kv-heads 4 --intermediate 1536 --vocab 2048 --out "$MODEL"
TINY=tests/fixtures/models/llama_gqa

sink_out=$(mktemp)
"$PY" scripts/otlp_sink.py >"$sink_out" &
sink=$!
trap 'kill $sink 2>/dev/null || true; rm -f "$sink_out"' EXIT
for _ in $(seq 50); do [ -s "$sink_out" ] && break; sleep 0.1; done
SINK="http://$(head -1 "$sink_out")"

# serve BINARY MODEL NAME [env...] -> prints the address; the pid is in $served
serve() {
  local bin=$1 dir=$2 name=$3
  shift 3
  ready=$(mktemp)
  env RUST_LOG=warn "$@" "$bin" serve --model "$dir" --name "$name" --listen 127.0.0.1:0 >"$ready" 2>/dev/null &
  served=$!
  addr=$(scripts/ready_address.sh "$ready" $served 30)
  rm -f "$ready"
}

run() { # mode binary [env...]
  local mode=$1 bin=$2
  shift 2
  serve "$bin" "$TINY" tiny "$@"
  RUST_LOG=warn "$CURRENT" model latency --endpoint "http://$addr" --model tiny --requests 1000 \
    >"target/bench/instr-latency-$mode-$round.json"
  kill $served; wait $served 2>/dev/null || true
  serve "$bin" "$MODEL" m "$@"
  RUST_LOG=warn "$CURRENT" bench --endpoint "http://$addr" --model m --requests 64 --concurrency 8 \
    --input-len 32 --output-len 64 --json >"target/bench/instr-bench-$mode-$round.json"
  kill $served; wait $served 2>/dev/null || true
}

for round in $(seq 1 "$ROUNDS"); do
  echo "round $round" >&2
  run baseline "$BASELINE"
  run current "$CURRENT"
  run export "$CURRENT" OTEL_EXPORTER_OTLP_ENDPOINT="$SINK" OTEL_SERVICE_NAME=bench
done

python3 - "$ROUNDS" <<'PY'
import json, statistics, sys
rounds = int(sys.argv[1])
def med(kind, mode, f):
    return statistics.median(f(json.load(open(f"target/bench/instr-{kind}-{mode}-{r}.json"))) for r in range(1, rounds + 1))
p50 = {m: med("latency", m, lambda r: r["p50_ms"]) for m in ("baseline", "current", "export")}
tps = {m: med("bench", m, lambda r: r["output_tokens_per_s"]) for m in ("baseline", "current", "export")}
print(f"| measurement (median of {rounds} rounds) | before instrumentation | metrics + spans, no export | metrics + spans exported |")
print("|---|---|---|---|")
print(f"| 1-token request over gRPC, p50 | {p50['baseline']:.3f} ms | {p50['current']:.3f} ms ({(p50['current'] - p50['baseline']) * 1000:+.0f} µs) | {p50['export']:.3f} ms ({(p50['export'] - p50['baseline']) * 1000:+.0f} µs) |")
print(f"| decode, 8 in flight, output tok/s | {tps['baseline']:.0f} | {tps['current']:.0f} ({tps['current'] / tps['baseline']:.3f}×) | {tps['export']:.0f} ({tps['export'] / tps['baseline']:.3f}×) |")
PY
