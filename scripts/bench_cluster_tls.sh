#!/usr/bin/env bash
# What cluster mTLS costs: the cluster benchmark (real etcd, 2 coordinators, 4 workers on
# loopback) run alternately with mutual TLS inside the cluster (the default) and without
# (STRATA_TEST_PLAIN_CLUSTER=1), on the tiny fixture: routing latency through the
# coordinators (whose hop to the worker is mTLS or plain) and kill -9 failover.
#
#   scripts/bench_cluster_tls.sh [rounds] [requests]
#
# Prints a markdown table for docs/PERFORMANCE.md; raw JSON goes to target/bench/.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
REQUESTS=${2:-1000}
cargo build --release --bin strata -p strata-cli
cargo build --release --bin cluster-bench -p strata-tests
STRATA=target/release/strata
mkdir -p target/bench target/bench-models
slow=target/bench-models/stream-21m
[ -f "$slow/model.safetensors" ] || "$STRATA" model random --arch llama --hidden 512 --layers 6 --heads 8 \
  --kv-heads 4 --intermediate 1536 --vocab 2048 --out "$slow"
for round in $(seq 1 "$ROUNDS"); do
  for mode in tls plain; do
    echo "round $round: $mode" >&2
    if [ "$mode" = plain ]; then export STRATA_TEST_PLAIN_CLUSTER=1; else unset STRATA_TEST_PLAIN_CLUSTER; fi
    STRATA_BIN=$STRATA target/release/cluster-bench --model tests/fixtures/models/llama_gqa \
      --stream-model "$slow" --repeats 3 --requests "$REQUESTS" > "target/bench/cluster-$mode-$round.json"
  done
done
unset STRATA_TEST_PLAIN_CLUSTER
python3 - "$ROUNDS" <<'PY'
import json, statistics, sys
rounds = int(sys.argv[1])
def load(mode):
    return [json.load(open(f"target/bench/cluster-{mode}-{r}.json")) for r in range(1, rounds + 1)]
rows = {m: load(m) for m in ("tls", "plain")}
def med(mode, f):
    return statistics.median(f(r) for r in rows[mode])
metrics = [
    ("1-token request via coordinators, p50", "ms", lambda r: r["routing"]["via_coordinators_ms"]["p50"]),
    ("1-token request via coordinators, p99", "ms", lambda r: r["routing"]["via_coordinators_ms"]["p99"]),
    ("straight to rank 0 over worker.v1, p50", "ms", lambda r: r["routing"]["direct_to_worker_ms"]["p50"]),
    ("kill -9 → every stream's next token", "s", lambda r: r["failover"]["kill_to_every_streams_next_token_s_median"]),
]
print(f"| measurement (median of {rounds} rounds) | mTLS | plain | mTLS − plain |")
print("|---|---|---|---|")
for name, unit, f in metrics:
    t, p = med("tls", f), med("plain", f)
    print(f"| {name} | {t:.3f} {unit} | {p:.3f} {unit} | {t - p:+.3f} {unit} |")
PY
