#!/usr/bin/env bash
# Serving benchmark on the Llama-3.2-1B-shape model (bf16): `strata bench` against
# `strata serve` at concurrency 1, 8 and 32; TTFT with a 1000-token shared prefix on a
# prefix-cache hit vs a miss; the compute roofline (2 × parameters FLOPs per token over
# the GEMM peak measured in the same run); HF transformers' batched generate beside it.
#   scripts/bench_serving.sh        (needs target/release/strata; PYTHON= with torch for HF)
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=${STRATA:-target/release/strata}
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-target/bench-models/llama-1b-bf16}
IN=${IN:-64}
OUT_LEN=${OUT_LEN:-32}
out=target/bench
mkdir -p "$out"
[ -f "$MODEL/model.safetensors" ] || "$STRATA" model random --preset llama-1b --dtype bf16 --out "$MODEL"

start_server() {
  log=$out/serve.log
  "$STRATA" serve --model "$MODEL" --name m --listen 127.0.0.1:0 --kv-cache-memory 3GiB \
    --max-num-seqs 32 --max-batched-tokens 512 "$@" >"$out/serve.ready" 2>"$log" &
  pid=$!
  addr=http://$(scripts/ready_address.sh "$out/serve.ready" $pid 60)
}
stop_server() { kill -TERM $pid; wait $pid || true; }
trap 'kill $pid 2>/dev/null || true' EXIT

echo "== GEMM peak and bandwidth (strata model bench)" >&2
RUST_LOG=warn "$STRATA" model bench --model "$MODEL" --prompt-len 64 --decode-tokens 2 --repeats 3 > "$out/peak.json"

start_server
for c in 1 8 32; do
  n=$(( c == 1 ? 4 : c * 2 ))
  [ "$c" = 32 ] && n=32
  echo "== strata bench, concurrency $c, $n requests" >&2
  "$STRATA" bench --endpoint "$addr" --model m --requests $n --concurrency $c --input-len $IN \
    --output-len $OUT_LEN --seed $c --json > "$out/serve-c$c.json"
done
echo "== TTFT, 1000-token shared prefix: warm the cache, then hits" >&2
"$STRATA" bench --endpoint "$addr" --model m --requests 1 --concurrency 1 --input-len 1016 \
  --shared-prefix 1000 --output-len 1 --seed 100 --json > /dev/null
"$STRATA" bench --endpoint "$addr" --model m --requests 3 --concurrency 1 --input-len 1016 \
  --shared-prefix 1000 --output-len 1 --seed 101 --json > "$out/ttft-hit.json"
stop_server
echo "== TTFT, 1000-token shared prefix, prefix caching off (misses)" >&2
start_server --no-prefix-caching
"$STRATA" bench --endpoint "$addr" --model m --requests 2 --concurrency 1 --input-len 1016 \
  --shared-prefix 1000 --output-len 1 --seed 101 --json > "$out/ttft-miss.json"
stop_server

if "$PYTHON" -c "import torch, transformers" 2>/dev/null; then
  echo "== HF transformers batched generate" >&2
  "$PYTHON" scripts/bench_hf_batched.py "$MODEL" --batches 1,8,32 --input-len $IN --output-len $OUT_LEN > "$out/hf-batched.json"
else
  echo "[]" > "$out/hf-batched.json"
fi

"$PYTHON" - "$out" "$MODEL" <<'PY'
import json, sys, os
out, model = sys.argv[1], sys.argv[2]
peak = json.load(open(f"{out}/peak.json"))
cfg = json.load(open(f"{model}/config.json"))
h, L, V, I = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["intermediate_size"]
kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
params = L * (2 * h * h + 2 * h * kv + 3 * h * I) + V * h  # matmul parameters (tied LM head)
hf = {r["batch"]: r["output_tokens_per_s"] for r in json.load(open(f"{out}/hf-batched.json"))}
rows = {c: json.load(open(f"{out}/serve-c{c}.json")) for c in (1, 8, 32)}
base = rows[1]["output_tokens_per_s"]
print(f"GEMM peak (f32, this run): {peak['gemm_gflops']:.1f} GFLOP/s; compute roofline "
      f"{peak['gemm_gflops'] * 1e9 / (2 * params):.1f} tok/s; bandwidth {peak['bandwidth_gb_per_s']:.1f} GB/s\n")
print("| concurrency | output tok/s | × concurrency 1 | share of compute roofline | TTFT p50 ms | TPOT p50 ms | ITL p99 ms | HF batched generate tok/s |")
print("|---|---|---|---|---|---|---|---|")
for c, r in rows.items():
    share = r["output_tokens_per_s"] * 2 * params / (peak["gemm_gflops"] * 1e9)
    print(f"| {c} | {r['output_tokens_per_s']:.1f} | {r['output_tokens_per_s'] / base:.2f}× | {share * 100:.0f}% | "
          f"{r['ttft_ms']['p50']:.0f} | {r['tpot_ms']['p50']:.0f} | {r['itl_ms']['p99']:.0f} | {hf.get(c, float('nan')):.1f} |")
hit = json.load(open(f"{out}/ttft-hit.json"))["ttft_ms"]["p50"]
miss = json.load(open(f"{out}/ttft-miss.json"))["ttft_ms"]["p50"]
print(f"\nTTFT, 1016-token prompt with a 1000-token shared prefix: hit {hit:.0f} ms, miss {miss:.0f} ms "
      f"(hit = {hit / miss * 100:.0f}% of miss)")
PY
