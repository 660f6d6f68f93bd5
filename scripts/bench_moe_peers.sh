#!/usr/bin/env bash
# Mixture-of-experts decode on the CPU against llama.cpp, in one run on the same weights:
# a Mixtral-shaped random bf16 model (the Qwen3-MoE-1B preset's shape: 16 layers of 32
# experts of 512 columns, 4 a token, hidden 1024) for Strata and, converted to GGUF, for
# llama.cpp; and Strata alone on the Qwen3-MoE preset (its active-weights roofline).
#
#   LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin GGUF=/path/to/mixtral-moe-1b.gguf \
#   ROUNDS=3 scripts/bench_moe_peers.sh
#
# Make the GGUF from MODEL with llama.cpp's convert_hf_to_gguf.py --outtype bf16
# (docs/PERFORMANCE.md says how). Each round runs every measurement once; the table
# gives medians over rounds and the median of each round's ratio. Raw JSON goes to
# target/bench/moe-peers/.
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=${STRATA:-target/release/strata}
MODEL=${MODEL:-target/bench-models/mixtral-moe-1b}
QWEN_MODEL=${QWEN_MODEL:-target/bench-models/qwen3-moe-1b}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-3}
LLAMA_CPP_BIN=${LLAMA_CPP_BIN:-}
GGUF=${GGUF:-}
out=target/bench/moe-peers
mkdir -p "$out"
rm -f "$out"/*.json
export RAYON_NUM_THREADS=$THREADS RUST_LOG=warn
[ -f "$MODEL/model.safetensors" ] ||
  "$STRATA" model random --preset qwen3-moe-1b --arch mixtral --dtype bf16 --out "$MODEL"
[ -f "$QWEN_MODEL/model.safetensors" ] ||
  "$STRATA" model random --preset qwen3-moe-1b --dtype bf16 --out "$QWEN_MODEL"

echo "== CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
  "$(grep -o 'amx_bf16\|avx512_bf16\|avx512_vnni\|avx512f\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')" >&2

for r in $(seq "$ROUNDS"); do
  echo "== round $r: strata model bench, Mixtral shape" >&2
  "$STRATA" model bench --model "$MODEL" --prompt-len 128 --decode-tokens 64 --repeats 1 \
    --batch-sizes 32 > "$out/strata-mixtral-$r.json"
  echo "== round $r: strata model bench, Qwen3-MoE shape" >&2
  "$STRATA" model bench --model "$QWEN_MODEL" --prompt-len 128 --decode-tokens 64 --repeats 1 \
    > "$out/strata-qwen3moe-$r.json"
  if [ -n "$LLAMA_CPP_BIN" ] && [ -n "$GGUF" ]; then
    echo "== round $r: llama-bench" >&2
    "$LLAMA_CPP_BIN/llama-bench" -m "$GGUF" -t "$THREADS" -p 128 -n 64 -r 1 -o json \
      > "$out/llama-bench-$r.json" 2> /dev/null
    # Strata's batched decode: 32 sequences of 16-token prompts, 64 steps.
    echo "== round $r: llama-batched-bench, 32 sequences" >&2
    "$LLAMA_CPP_BIN/llama-batched-bench" -m "$GGUF" -t "$THREADS" -c 4096 -b 2048 -ub 512 \
      -npp 16 -ntg 64 -npl 32 --output-format jsonl 2> /dev/null | grep '^{' > "$out/llama-batched-$r.json"
  fi
done

python3 scripts/bench_moe_peers_table.py "$out" "$ROUNDS"
