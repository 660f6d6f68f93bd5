#!/usr/bin/env bash
# Waits for a strata process's ready announcement (one JSON line on its stdout, written to
# FILE) and prints the address it serves at.
#   scripts/ready_address.sh FILE PID [SECONDS]
set -euo pipefail
file=$1
pid=$2
limit=${3:-60}
for _ in $(seq $((limit * 10))); do
  addr=$(sed -n 's/.*"event":"ready".*"address":"\([^"]*\)".*/\1/p' "$file" | head -n 1)
  if [ -n "$addr" ]; then echo "$addr"; exit 0; fi
  kill -0 "$pid" 2>/dev/null || { echo "strata (pid $pid) exited before it was ready" >&2; exit 1; }
  sleep 0.1
done
echo "strata (pid $pid) was not ready within ${limit}s" >&2
exit 1
