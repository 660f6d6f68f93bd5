#!/usr/bin/env bash
# CPU throughput against the engines a user would pick instead, in one run on the same
# weights (the Llama-3.2-1B-shape random bf16 model): prefill, batch-1 decode (with the
# bandwidth roofline), batched decode at 32, serving at concurrency 32, int8 decode —
# Strata, llama.cpp (bf16 and q8_0 GGUF of the same weights) and HF transformers (bf16).
#
#   LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin GGUF_BF16=... GGUF_Q8=... \
#   PYTHON=/path/to/venv/bin/python scripts/bench_cpu_peers.sh
#
# llama.cpp is built from source outside this repository and the GGUF files converted
# with its convert_hf_to_gguf.py (docs/PERFORMANCE.md says how); PYTHON needs torch and
# transformers. A peer that is not given is left out of the table. Each figure is the
# median of REPEATS runs; batch-1 decode is also measured in PAIRS alternating pairs of
# Strata and llama.cpp runs. Raw JSON goes to target/bench/peers/.
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=${STRATA:-target/release/strata}
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-target/bench-models/llama-1b-bf16}
THREADS=${THREADS:-2}
REPEATS=${REPEATS:-3}
PAIRS=${PAIRS:-5}
LLAMA_CPP_BIN=${LLAMA_CPP_BIN:-}
GGUF_BF16=${GGUF_BF16:-}
GGUF_Q8=${GGUF_Q8:-}
out=target/bench/peers
mkdir -p "$out"
rm -f "$out"/*.json
export RAYON_NUM_THREADS=$THREADS RUST_LOG=warn
[ -f "$MODEL/model.safetensors" ] || "$STRATA" model random --preset llama-1b --dtype bf16 --out "$MODEL"

echo "== CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
  "$(grep -o 'avx512_bf16\|avx512_vnni\|avx512f\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')" >&2

for r in $(seq "$REPEATS"); do
  echo "== strata model bench, bf16 and int8 (run $r)" >&2
  "$STRATA" model bench --model "$MODEL" --prompt-len 512 --decode-tokens 64 --repeats 1 \
    --batch-sizes 32 > "$out/strata-bf16-$r.json"
  "$STRATA" model bench --model "$MODEL" --prompt-len 64 --decode-tokens 64 --repeats 1 \
    --quantize int8 > "$out/strata-int8-$r.json"
done

serve() { # max-batched-tokens, tag
  "$STRATA" serve --model "$MODEL" --name m --listen 127.0.0.1:0 --kv-cache-memory 3GiB \
    --max-num-seqs 32 --max-batched-tokens "$1" > "$out/serve.ready" 2> "$out/serve.log" &
  local pid=$!
  local addr
  addr=http://$(scripts/ready_address.sh "$out/serve.ready" $pid 120)
  for r in $(seq "$3"); do
    echo "== strata bench, concurrency 32, max-batched-tokens $1 (run $r)" >&2
    "$STRATA" bench --endpoint "$addr" --model m --requests 32 --concurrency 32 --input-len 64 \
      --output-len 32 --seed "$r" --json > "$out/serve-$2-$r.json"
  done
  kill -TERM $pid
  wait $pid || true
}
serve 512 default "$REPEATS"
for budget in 256 1024 2048; do serve $budget "budget$budget" 1; done

if [ -n "$LLAMA_CPP_BIN" ] && [ -n "$GGUF_BF16" ]; then
  for gguf in "$GGUF_BF16" ${GGUF_Q8:+"$GGUF_Q8"}; do
    tag=$([ "$gguf" = "$GGUF_BF16" ] && echo bf16 || echo q8_0)
    echo "== llama-bench $tag" >&2
    "$LLAMA_CPP_BIN/llama-bench" -m "$gguf" -t "$THREADS" -p 512 -n 64 -r "$REPEATS" -o json \
      > "$out/llama-bench-$tag.json" 2> /dev/null
  done
  # Batch-1 decode again, Strata and llama.cpp taking turns: this machine's bandwidth moves
  # between runs, so only alternating pairs compare the two fairly.
  for r in $(seq "$PAIRS"); do
    echo "== batch-1 decode, alternating pair $r" >&2
    "$STRATA" model bench --model "$MODEL" --prompt-len 16 --decode-tokens 64 --repeats 1 \
      > "$out/pair-strata-$r.json"
    "$LLAMA_CPP_BIN/llama-bench" -m "$GGUF_BF16" -t "$THREADS" -p 0 -n 64 -r 1 -o json \
      > "$out/pair-llama-$r.json" 2> /dev/null
  done
  echo "== llama-batched-bench bf16, 32 sequences" >&2
  "$LLAMA_CPP_BIN/llama-batched-bench" -m "$GGUF_BF16" -t "$THREADS" -c 4096 -b 2048 -ub 512 \
    -npp 64 -ntg 32 -npl 32 --output-format jsonl 2> /dev/null | grep '^{' > "$out/llama-batched.json"
fi

if "$PYTHON" -c "import torch, transformers" 2> /dev/null; then
  echo "== HF transformers, bf16" >&2
  "$PYTHON" scripts/bench_hf.py "$MODEL" bf16 --threads "$THREADS" --prompt-len 512 --decode 32 \
    --repeats "$REPEATS" > "$out/hf.json"
  "$PYTHON" scripts/bench_hf_batched.py "$MODEL" --batches 32 --input-len 64 --output-len 32 \
    --threads "$THREADS" > "$out/hf-batched.json"
fi

python3 scripts/bench_cpu_peers_table.py "$out"
