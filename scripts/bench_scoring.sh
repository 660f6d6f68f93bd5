#!/usr/bin/env bash
# Scoring and embedding costs (#37), against one `strata serve` and, in the same run, HF
# transformers (torch, CPU) on the same model directory:
# - a 512-token prompt with max_tokens 1: plain, with echo + logprobs (lm-eval's
#   loglikelihood request) and with prompt_logprobs 5, and HF's forward + log-softmax;
# - /v1/embeddings of 32 × 128-token inputs against HF's batched forward + pooling.
# Model: Llama-3.2-1B's shape cut to 4 layers (a 128k vocabulary), bf16, random weights.
#   scripts/bench_scoring.sh [PYTHON_WITH_TORCH]   (needs target/release/strata and
#   target/pyenv; without a torch Python the HF columns are left out)
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=${STRATA:-target/release/strata}
MODEL=${MODEL:-target/bench-models/llama-4l-bf16}
TORCH_PY=${1:-}
out=target/bench
mkdir -p "$out"
[ -f "$MODEL/model.safetensors" ] || "$STRATA" model random --preset llama-1b --layers 4 --dtype bf16 --out "$MODEL"
"$STRATA" serve --model "$MODEL" --name m --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
  --kv-cache-memory 2GiB --max-num-seqs 32 --max-batched-tokens 512 >"$out/scoring.ready" 2>"$out/scoring.log" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
scripts/ready_address.sh "$out/scoring.ready" $pid 120 >/dev/null
http=$(sed -n 's/.*"event":"http".*"address":"\([^"]*\)".*/\1/p' "$out/scoring.ready" | head -n 1)
# The server's measurements first, then (the server idle) HF's on the same cores.
target/pyenv/bin/python scripts/bench_scoring.py strata "http://$http" >"$out/scoring_strata.json"
if [ -n "$TORCH_PY" ]; then
  "$TORCH_PY" scripts/bench_scoring.py hf "$MODEL" >"$out/scoring_hf.json"
  python3 scripts/bench_scoring.py combine "$out/scoring_strata.json" "$out/scoring_hf.json" | tee "$out/scoring.json"
else
  tee "$out/scoring.json" <"$out/scoring_strata.json"
fi
kill -TERM $pid; wait $pid || true
