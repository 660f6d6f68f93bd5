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
# transformers. A peer that is not given is left out of the table. ROUNDS rounds each run
# every measurement once; raw JSON goes to target/bench/peers/. To measure what a host
# with AVX2 only would run, set STRATA_CPU_KERNELS=avx2, ATEN_CPU_CAPABILITY=avx2 and
# ONEDNN_MAX_CPU_ISA=AVX2 (torch), point LLAMA_CPP_BIN at a llama.cpp built without
# AVX-512, and STRATA at a binary built without the gemm crate's AVX-512 kernels, which no
# environment variable caps (`cargo build --release -p strata-cli --bin strata
# --no-default-features`, then copy target/release/strata aside); the table's header says
# which prefill GEMM ran.
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=${STRATA:-target/release/strata}
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-target/bench-models/llama-1b-bf16}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-3}
LLAMA_CPP_BIN=${LLAMA_CPP_BIN:-}
GGUF_BF16=${GGUF_BF16:-}
GGUF_Q8=${GGUF_Q8:-}
out=target/bench/peers
mkdir -p "$out"
rm -f "$out"/*.json
export RAYON_NUM_THREADS=$THREADS RUST_LOG=warn
[ -f "$MODEL/model.safetensors" ] || "$STRATA" model random --preset llama-1b --dtype bf16 --out "$MODEL"

echo "== CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
  "$(grep -o 'avx512_bf16\|avx512_vnni\|avx512f\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')" \
  "STRATA_CPU_KERNELS=${STRATA_CPU_KERNELS:-native} ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-default}" \
  "ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-default}" >&2

serve_start() { # max-batched-tokens
  "$STRATA" serve --model "$MODEL" --name m --listen 127.0.0.1:0 --kv-cache-memory 3GiB \
    --max-num-seqs 32 --max-batched-tokens "$1" > "$out/serve.ready" 2> "$out/serve.log" &
  serve_pid=$!
  serve_addr=http://$(scripts/ready_address.sh "$out/serve.ready" $serve_pid 120)
}
serve_stop() {
  kill -TERM "$serve_pid"
  wait "$serve_pid" || true
}
serve_bench() { # tag, seed
  "$STRATA" bench --endpoint "$serve_addr" --model m --requests 32 --concurrency 32 --input-len 64 \
    --output-len 32 --seed "$2" --json > "$out/serve-$1-$2.json"
}
have_llama() { [ -n "$LLAMA_CPP_BIN" ] && [ -n "$GGUF_BF16" ]; }
have_hf() { "$PYTHON" -c "import torch, transformers" 2> /dev/null; }

# Every round runs each engine's measurement once, one after another, so that each ratio
# compares runs minutes apart at most; the table reports medians over rounds and the
# median of each round's ratio.
for r in $(seq "$ROUNDS"); do
  echo "== round $r: strata model bench, bf16" >&2
  "$STRATA" model bench --model "$MODEL" --prompt-len 512 --decode-tokens 64 --repeats 1 \
    --batch-sizes 32 > "$out/strata-bf16-$r.json"
  if have_llama; then
    echo "== round $r: llama-bench bf16" >&2
    "$LLAMA_CPP_BIN/llama-bench" -m "$GGUF_BF16" -t "$THREADS" -p 512 -n 64 -r 1 -o json \
      > "$out/llama-bench-bf16-$r.json" 2> /dev/null
  fi
  if have_hf; then
    echo "== round $r: HF transformers, bf16" >&2
    "$PYTHON" scripts/bench_hf.py "$MODEL" bf16 --threads "$THREADS" --prompt-len 512 --decode 32 \
      --repeats 1 > "$out/hf-$r.json"
  fi
  echo "== round $r: strata model bench, int8" >&2
  "$STRATA" model bench --model "$MODEL" --prompt-len 64 --decode-tokens 64 --repeats 1 \
    --quantize int8 > "$out/strata-int8-$r.json"
  if have_llama && [ -n "$GGUF_Q8" ]; then
    echo "== round $r: llama-bench q8_0" >&2
    "$LLAMA_CPP_BIN/llama-bench" -m "$GGUF_Q8" -t "$THREADS" -p 0 -n 64 -r 1 -o json \
      > "$out/llama-bench-q8_0-$r.json" 2> /dev/null
  fi
  echo "== round $r: strata serve + bench, concurrency 32" >&2
  serve_start 512
  serve_bench default "$r"
  serve_stop
  if have_llama; then
    echo "== round $r: llama-batched-bench bf16, 32 sequences" >&2
    "$LLAMA_CPP_BIN/llama-batched-bench" -m "$GGUF_BF16" -t "$THREADS" -c 4096 -b 2048 -ub 512 \
      -npp 64 -ntg 32 -npl 32 --output-format jsonl 2> /dev/null | grep '^{' > "$out/llama-batched-$r.json"
  fi
  if have_hf; then
    echo "== round $r: HF batched generate, 32 prompts" >&2
    "$PYTHON" scripts/bench_hf_batched.py "$MODEL" --batches 32 --input-len 64 --output-len 32 \
      --threads "$THREADS" > "$out/hf-batched-$r.json"
  fi
done

# The scheduler's token budget at concurrency 32 (Strata alone).
for budget in 256 1024 2048; do
  echo "== strata bench, concurrency 32, max-batched-tokens $budget" >&2
  serve_start "$budget"
  serve_bench "budget$budget" 1
  serve_stop
done

python3 scripts/bench_cpu_peers_table.py "$out"
