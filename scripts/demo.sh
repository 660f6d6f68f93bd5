#!/usr/bin/env bash
# Streams a few generations from a model directory with the given strata binary.
set -euo pipefail
bin=$1
model=$2
for prompt in "Once upon a time" "The quick brown fox" "Strata serves"; do
  echo "── prompt: $prompt"
  RUST_LOG=warn "$bin" generate --model "$model" --prompt "$prompt" --max-tokens 32 \
    --temperature 0.8 --top-p 0.95 --seed 7
done
