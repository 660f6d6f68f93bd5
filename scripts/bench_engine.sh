#!/usr/bin/env bash
# Engine benchmark: Strata vs HF transformers vs the memory-bandwidth roofline, on a
# random-weight model with Llama-3.2-1B's shape, bf16 and f32, in one run.
#
#   scripts/bench_engine.sh            # needs target/release/strata (make bench-engine)
#   PYTHON=.venv/bin/python scripts/bench_engine.sh   # a python with torch + transformers
#
# Prints a markdown table for docs/PERFORMANCE.md; raw JSON goes to target/bench/.
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=${STRATA:-target/release/strata}
PYTHON=${PYTHON:-python3}
THREADS=${THREADS:-2}
PROMPT_LEN=${PROMPT_LEN:-512}
DECODE=${DECODE:-32}
DTYPES=${DTYPES:-"bf16 f32"}
# Extra flags for `strata model bench`, e.g. STRATA_EXTRA='--dtype f32'.
STRATA_EXTRA=${STRATA_EXTRA:-}
out=target/bench
mkdir -p "$out"

have_hf=1
"$PYTHON" -c "import torch, transformers" 2>/dev/null || { have_hf=0; echo "no torch/transformers in $PYTHON: HF columns skipped" >&2; }

rows=()
for dtype in $DTYPES; do
  model=target/bench-models/llama-1b-$dtype
  if [ ! -f "$model/model.safetensors" ]; then
    echo "writing $model" >&2
    "$STRATA" model random --preset llama-1b --dtype "$dtype" --out "$model"
  fi
  echo "== strata, $dtype" >&2
  RAYON_NUM_THREADS=$THREADS "$STRATA" model bench --model "$model" --prompt-len "$PROMPT_LEN" \
    --decode-tokens "$DECODE" $STRATA_EXTRA > "$out/strata-$dtype.json"
  hf_prefill=n/a; hf_decode=n/a
  if [ $have_hf = 1 ]; then
    echo "== HF transformers, $dtype" >&2
    "$PYTHON" scripts/bench_hf.py "$model" "$dtype" --threads "$THREADS" --prompt-len "$PROMPT_LEN" \
      --decode "$DECODE" > "$out/hf-$dtype.json"
  fi
  rows+=("$("$PYTHON" - "$out/strata-$dtype.json" "$out/hf-$dtype.json" "$dtype" <<'PY'
import json, os, sys
s = json.load(open(sys.argv[1]))
hf = json.load(open(sys.argv[2])) if os.path.exists(sys.argv[2]) and os.path.getsize(sys.argv[2]) else None
def ratio(a, b):
    return f"{a / b:.2f}×" if b else "n/a"
hp = hf["prefill_tokens_per_s"] if hf else None
hd = hf["decode_tokens_per_s"] if hf else None
print(f"| {sys.argv[3]} | {s['bandwidth_gb_per_s']:.1f} | {s['roofline_decode_tokens_per_s']:.2f} | "
      f"{s['decode_tokens_per_s']:.2f} ({s['decode_share_of_roofline'] * 100:.0f}%) | "
      f"{hd and f'{hd:.2f}' or 'n/a'} | {ratio(s['decode_tokens_per_s'], hd)} | "
      f"{s['prefill_tokens_per_s']:.1f} | {hp and f'{hp:.1f}' or 'n/a'} | {ratio(s['prefill_tokens_per_s'], hp)} |")
PY
)")
done
echo
echo "| weights | bandwidth GB/s | roofline decode tok/s | Strata decode tok/s (share) | HF decode tok/s | Strata/HF decode | Strata prefill tok/s | HF prefill tok/s | Strata/HF prefill |"
echo "|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
