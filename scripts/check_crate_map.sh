#!/usr/bin/env bash
# The crate map's arrows, checked: `proto ← common ← engine ← worker`, `common ←
# coordinator`, everything ← `cli`. Each crate's own dependency tree — resolved for that
# crate alone, with each of its feature sets, not the workspace's unified features —
# must not link what the map keeps from it: the engine no gRPC, etcd or OpenTelemetry
# (whatever its features), the coordinator no engine and no CUDA, the worker no
# coordinator. `cargo tree` resolves without building: this takes seconds.
#
#   scripts/check_crate_map.sh        # exits 1 and names every crate that breaks the map
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
failed=0

# The crates `$1` links (normal and build dependencies) with features `$2`.
links() {
  local features=()
  [ -n "$2" ] && features=(--features "$2")
  "$CARGO" tree -p "$1" "${features[@]}" -e normal,build --prefix none --format '{p}' |
    sed 's/ v[0-9].*//' | sort -u
}

# crate, features ("" for its defaults), forbidden crates (an ERE), why.
forbid() {
  local bad
  bad=$(links "$1" "$2" | grep -Ex "$3" | grep -vx "$1" | tr '\n' ' ' || true)
  if [ -n "$bad" ]; then
    echo "crate map: $1${2:+ with features $2} links ${bad}— $4"
    failed=1
  fi
}

GRPC='tonic.*|prost.*|etcd-client|opentelemetry.*|tracing-opentelemetry|strata-proto'
for f in "" cuda cuda-emulator "cuda,cuda-emulator"; do
  forbid strata-engine "$f" "$GRPC|strata-(worker|coordinator|cli)" \
    "the engine knows nothing of gRPC, etcd or telemetry export"
done
forbid strata-common "" "$GRPC|strata-(engine|worker|coordinator|cli)" \
  "common's gRPC, etcd and telemetry parts are features the engine never enables"
forbid strata-proto "" "strata-.*" "proto is the leaf"
forbid strata-coordinator "" "strata-(engine|worker|cli)|cudarc|gemm.*" \
  "the coordinator never links the engine"
for f in "" cuda; do
  forbid strata-worker "$f" "strata-(coordinator|cli)" "a worker is not a coordinator"
done

if [ "$failed" = 0 ]; then
  echo "crate map: every crate links only what the map allows"
fi
exit "$failed"
