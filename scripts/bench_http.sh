#!/usr/bin/env bash
# The OpenAI-style HTTP API's costs, on one `strata serve` in one run:
# 1. streaming over HTTP (SSE) vs gRPC (GenerateStream): the same 16-token greedy request
#    alternately, 1000 times each, on the llama_gqa fixture (serving work is tiny, so the
#    protocol's share shows): time to first token and to the end, p50/p90/p99;
# 2. batch throughput vs the same requests online: 256 completions (64-token prompts, 32
#    output tokens) through the Batch API vs `strata batch run --concurrency 32`, five
#    alternating rounds, on a 6-layer 512-wide random Llama.
#   scripts/bench_http.sh        (needs target/release/strata and target/pyenv with openai)
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=${STRATA:-target/release/strata}
PY=${PY:-target/pyenv/bin/python}
out=target/bench
mkdir -p "$out"
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null || true' EXIT

serve() {
  "$STRATA" serve --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 "$@" >"$out/http.ready" 2>"$out/http-serve.log" &
  pid=$!
  grpc=$(scripts/ready_address.sh "$out/http.ready" $pid 120)
  http=$(sed -n 's/.*"event":"http".*"address":"\([^"]*\)".*/\1/p' "$out/http.ready" | head -n 1)
}

echo "== streaming: HTTP (SSE) vs gRPC, llama_gqa fixture" >&2
serve --model tests/fixtures/models/llama_gqa --name m
"$STRATA" model latency --model m --endpoint "http://$grpc" --http "http://$http" --requests 1000 --tokens 16
kill -TERM $pid; wait $pid || true

MODEL=target/bench-models/llama-6x512
[ -f "$MODEL/model.safetensors" ] || "$STRATA" model random --arch llama --hidden 512 --layers 6 --heads 8 \
  --kv-heads 4 --intermediate 1536 --vocab 2048 --out "$MODEL" >/dev/null
echo "== batch vs online, $MODEL" >&2
data=$(mktemp -d)
serve --model "$MODEL" --name m --data-dir "$data" --batch-concurrency 32 --max-num-seqs 32
"$PY" scripts/bench_batch.py "$STRATA" "$http" --requests 256 --rounds 5
kill -TERM $pid; wait $pid || true
rm -rf "$data"
