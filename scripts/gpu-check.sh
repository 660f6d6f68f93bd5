#!/usr/bin/env bash
# The CUDA backend on a machine with a GPU, in one run (≈ 5–8 minutes on one H200):
#   1. which CUDA libraries were found (from the python3 environment's `nvidia` packages
#      and the driver), and whether the carried binary starts at all;
#   2. every op on the GPU against the CPU backend on fresh random inputs, small shapes
#      and Llama-8B-sized ones (a MoE layer's routed experts among them: routing,
#      grouping and the grouped GEMM on the device);
#   3. greedy tokens of every fixture model on the GPU against the CPU backend and HF's
#      reference (a difference is reported as a bf16 near-tie or a mismatch);
#   4. the device-collectives contract over NCCL (all-reduce, all-gather, all-to-all with
#      uneven counts, send/recv, the host endpoint), one rank per GPU for every group size
#      the GPUs allow (one GPU: groups of one, NCCL's own path still), and NCCL's
#      all-reduce of device buffers (the CUDA backend's tensor-parallel path) with its bus
#      bandwidth;
#   5. batch-1 decode tokens/s of random Llama-3.2-1B- and Llama-8B-shaped bf16 models and
#      of a Qwen3-MoE-shaped one (32 experts, 4 a token) against the HBM roofline (weight
#      bytes a token reads — a MoE model's active experts — ÷ the device-to-device copy
#      bandwidth measured here), decode tokens/s at 8, 32 and 128 sequences, and prefill
#      tokens/s of a 512-token prompt; decode steps replay CUDA graphs, and the smaller
#      model's batch-1 and 8-sequence decode run again op by op (--enforce-eager) beside.
# Full logs go to $OUT (or target/gpu-check-out); a short table is printed last.
#
#   scripts/gpu-check.sh            # STRATA=path/to/strata built with --features cuda
#
# Build the binary on a machine with Rust (no CUDA needed):
#   cargo build --release --bin strata --features strata-cli/cuda
#   mkdir -p target/gpu-check && cp target/release/strata target/gpu-check/ && strip target/gpu-check/strata
set -uo pipefail
cd "$(dirname "$0")/.."
STRATA=${STRATA:-target/gpu-check/strata}
OUT=${OUT:-target/gpu-check-out}
MODELS=${MODELS_DIR:-/tmp/strata-gpu-models}
# DEVICE=cpu runs the same checks on the CPU backend (a dry run of this script).
DEVICE=${DEVICE:-cuda:0}
PRESETS=${PRESETS:-"llama-1b llama-8b qwen3-moe-1b"}
mkdir -p "$OUT" "$MODELS"
LOG="$OUT/gpu-check.log"
: > "$LOG"
say() { echo "$@" | tee -a "$LOG"; }
started=$(date +%s)

# 1. Libraries and the binary.
say "== binary: $STRATA"
if ! "$STRATA" --version >>"$LOG" 2>&1; then
  say "the strata binary does not start here:"
  ldd "$STRATA" 2>&1 | tee -a "$LOG"
  ldd --version 2>&1 | head -1 | tee -a "$LOG"
  exit 1
fi
PY=${PYTHON:-python3}
NV=$("$PY" - <<'PY' 2>/dev/null
import importlib.util, os, pathlib
spec = importlib.util.find_spec("nvidia")
roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
libs = set()
for r in roots:
    for p in pathlib.Path(r).rglob("lib"):
        if p.is_dir() and any(f.name.endswith(".so") or ".so." in f.name for f in p.iterdir()):
            libs.add(str(p))
print(":".join(sorted(libs)))
PY
)
export LD_LIBRARY_PATH="${NV:+$NV:}${LD_LIBRARY_PATH:-}"
say "== CUDA libraries on LD_LIBRARY_PATH (from $PY's nvidia packages):"
for d in ${NV//:/ }; do say "   $d: $(ls "$d" | grep -E '^lib(nvrtc|cublas|cublasLt|cudart|nccl)\.so' | tr '\n' ' ')"; done
say "   driver: $(ldconfig -p 2>/dev/null | grep -m1 'libcuda.so.1' || echo 'libcuda.so.1 not in the ldconfig cache')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/   gpu: /' | tee -a "$LOG"

rows=()
row() { rows+=("$1"); }

# 2. Ops.
for size in small large; do
  flag=""; [ "$size" = large ] && flag="--large"
  if "$STRATA" gpu-check --device "$DEVICE" ops $flag >"$OUT/ops-$size.jsonl" 2>>"$LOG"; then
    row "| ops ($size shapes) | all $(wc -l <"$OUT/ops-$size.jsonl") within tolerance | worst rel. error $("$PY" -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; w=max(r,key=lambda x:x['rel_err']/max(x['tolerance'],1e-12)); print(f\"{w['rel_err']:.1e} ({w['op']})\")" "$OUT/ops-$size.jsonl") |"
  else
    row "| ops ($size shapes) | FAILED | see ops-$size.jsonl and gpu-check.log |"
  fi
  cat "$OUT/ops-$size.jsonl" >>"$LOG" 2>/dev/null
done

# 3. Tokens of every fixture model.
fixtures=(tests/fixtures/models/*/)
if "$STRATA" gpu-check --device "$DEVICE" tokens --tokens 32 $(printf -- '--model %s ' "${fixtures[@]}") >"$OUT/tokens.jsonl" 2>>"$LOG"; then
  status="no mismatch"
else
  status="MISMATCH"
fi
summary=$("$PY" - "$OUT/tokens.jsonl" <<'PY'
import json, sys
rs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
same = sum(r["result"]["verdict"] == "identical" for r in rs)
tie = [r["model"] for r in rs if r["result"]["verdict"] == "bf16 near-tie"]
hf = sum(bool(r["matches_hf_reference"]) for r in rs)
print(f"{same}/{len(rs)} identical to CPU, {len(tie)} bf16 near-ties {tie}, {hf}/{len(rs)} equal to HF's greedy tokens")
PY
)
row "| greedy tokens, ${#fixtures[@]} fixture models | $status | $summary |"

# 4. The device-collectives contract over NCCL (the checks the CPU and emulator suites
#    run), one rank per GPU, then NCCL's all-reduce of device buffers.
if "$STRATA" gpu-check --device "$DEVICE" collectives >"$OUT/collectives.jsonl" 2>>"$LOG"; then
  row "| device-collectives contract | $("$PY" -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if l.strip() and 'mib' not in l]; print(f\"{r[0]['collectives']}: {len(r)} checks passed, groups of 1..{max(x['world'] for x in r)}\")" "$OUT/collectives.jsonl") | |"
else
  row "| device-collectives contract | FAILED | see collectives.jsonl and gpu-check.log |"
fi
cat "$OUT/collectives.jsonl" >>"$LOG" 2>/dev/null
if grep -q all_reduce_device "$OUT/collectives.jsonl" 2>/dev/null; then
  row "| NCCL all-reduce of device buffers | $("$PY" -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if 'all_reduce_device' in l][-1]; print(f\"{'ok' if r['ok'] else 'WRONG SUM'}: {r['world']} rank(s), {r['mib']} MiB in {r['median_ms']:.2f} ms, bus bandwidth {r['busbw_gb_per_s']:.0f} GB/s\")" "$OUT/collectives.jsonl") | |"
fi

# 5. Decode speed vs the roofline.
for preset in $PRESETS; do
  dir="$MODELS/$preset-bf16"
  if [ ! -f "$dir/config.json" ]; then
    say "== writing $dir"
    "$STRATA" model random --preset "$preset" --dtype bf16 --out "$dir" >>"$LOG" 2>&1 || { row "| decode $preset | could not write the model | |"; continue; }
  fi
  if "$STRATA" gpu-check --device "$DEVICE" decode --model "$dir" --tokens 64 --kv-cache-mib 4096 >"$OUT/decode-$preset.json" 2>>"$LOG"; then
    row "| decode batch 1, $preset bf16 | $("$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"{r['decode_tokens_per_s']:.1f} tok/s ({100*r['share_of_roofline']:.0f}% of roofline {r['roofline_tokens_per_s']:.1f})\")" "$OUT/decode-$preset.json") | $("$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"{r['weight_bytes_per_token']/1e9:.2f} GB/token, copy bandwidth {r['copy_bandwidth_gb_per_s']:.0f} GB/s, load {r['load_s']:.1f} s, {r['graph_steps']} steps from CUDA graphs\")" "$OUT/decode-$preset.json") |"
  else
    row "| decode batch 1, $preset bf16 | FAILED | see gpu-check.log |"
    continue
  fi
  row "| batched decode and prefill, $preset bf16 | $("$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(', '.join(f\"{b['batch']} seqs {b['tokens_per_s']:.0f} tok/s\" for b in r['batched_decode']))" "$OUT/decode-$preset.json") | prefill $("$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"{r['prefill_len']} tokens at {r['prefill_tokens_per_s']:.0f} tok/s\")" "$OUT/decode-$preset.json") |"
  # What the decode graphs save: the same steps op by op (the smaller model only, where
  # launch overhead weighs most).
  if [ "$preset" = "${PRESETS%% *}" ] && "$STRATA" gpu-check --device "$DEVICE" decode --model "$dir" --tokens 64 --kv-cache-mib 4096 --batches 8 --prefill-len 0 --enforce-eager >"$OUT/decode-$preset-eager.json" 2>>"$LOG"; then
    row "| decode without graphs (--enforce-eager), $preset bf16 | $("$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); g=json.load(open(sys.argv[2])); print(f\"batch 1 {r['decode_tokens_per_s']:.1f} tok/s (graphs: {g['decode_tokens_per_s']:.1f}, {g['decode_tokens_per_s']/r['decode_tokens_per_s']:.2f}x), 8 seqs {r['batched_decode'][0]['tokens_per_s']:.0f} tok/s\")" "$OUT/decode-$preset-eager.json" "$OUT/decode-$preset.json") | |"
  fi
done

say ""
say "| check | result | detail |"
say "|---|---|---|"
for r in "${rows[@]}"; do say "$r"; done
say "(finished in $(( $(date +%s) - started )) s)"
