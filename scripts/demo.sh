#!/usr/bin/env bash
# Starts `strata serve` on a model directory, streams a few generations through
# `strata generate --endpoint ... --stream`, and stops the server (SIGTERM, drained).
#   scripts/demo.sh STRATA_BINARY MODEL_DIR
set -euo pipefail
bin=$1
model=$2
log=$(mktemp)
ready=$(mktemp)
"$bin" serve "$model" --name demo --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 >"$ready" 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$log" "$ready"' EXIT
addr=$("$(dirname "$0")/ready_address.sh" "$ready" $pid 30) || { cat "$log" >&2; exit 1; }
http=$(sed -n 's/.*"event":"http".*"address":"\([^"]*\)".*/\1/p' "$ready" | head -n 1)
echo "strata serve is listening on $addr (gRPC) and http://$http/v1 (OpenAI HTTP; model \"demo\" from $model)"
echo "(a model of random weights, as \`make demo\` writes, answers gibberish: the tokens are real,"
echo " the words are not; serve a real model directory for real text)"
for prompt in "Once upon a time" "The quick brown fox" "Strata serves"; do
  echo
  echo "── prompt: $prompt"
  RUST_LOG=warn "$bin" generate --endpoint "http://$addr" --model demo --prompt "$prompt" \
    --max-tokens 32 --temperature 0.8 --top-p 0.95 --seed 7 --stream
done
kill -TERM $pid
wait $pid
echo
echo "server drained and stopped."
