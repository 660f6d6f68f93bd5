#!/usr/bin/env bash
# Two `strata` binaries on the Llama-3.2-1B-shape bf16 model, alternating round by round
# (before, after, before, after, …) so that both see the machine's same phases: prefill of
# a 512-token prompt, batch-1 decode, decode steps at 32 sequences, and batch-1 decode of a
# TP=2 replica (ranks as threads over the TCP communicator). Prints the median of each
# measure and the median of the rounds' after/before ratios, with their range.
#   BEFORE=.../strata-before AFTER=target/release/strata ROUNDS=5 scripts/bench_before_after.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=${BEFORE:?the binary before the change}
AFTER=${AFTER:-target/release/strata}
ROUNDS=${ROUNDS:-5}
MODEL=${MODEL:-target/bench-models/llama-1b-bf16}
out=${OUT:-target/bench/before-after}
mkdir -p "$out"
[ -f "$MODEL/model.safetensors" ] || "$AFTER" model random --preset llama-1b --dtype bf16 --out "$MODEL"
for r in $(seq "$ROUNDS"); do
  for side in before after; do
    bin=$BEFORE
    [ "$side" = after ] && bin=$AFTER
    echo "== round $r: $side" >&2
    RUST_LOG=warn "$bin" model bench --model "$MODEL" --prompt-len 512 --decode-tokens 64 --repeats 1 \
      --batch-sizes 32 > "$out/$side-$r.json"
    RUST_LOG=warn "$bin" model bench --model "$MODEL" --tp 2 --prompt-len 64 --decode-tokens 32 --repeats 1 \
      > "$out/$side-tp2-$r.json"
  done
done
python3 - "$out" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def load(side, r, tp=""):
    return json.load(open(f"{out}/{side}{tp}-{r}.json"))
measures = [
    ("prefill, 512-token prompt (tok/s)", "", lambda j: j["prefill_tokens_per_s"]),
    ("batch-1 decode (tok/s)", "", lambda j: j["decode_tokens_per_s"]),
    ("decode step at 32 sequences (output tok/s)", "", lambda j: dict(j["batched_decode"])[32]),
    ("TP=2 batch-1 decode, threads over TCP (tok/s)", "-tp2", lambda j: j["decode_tokens_per_s"]),
]
j = load("after", 1)
print(f"{rounds} alternating rounds; CPU kernels {j['cpu_kernels']}; {j['threads']} threads\n")
print("| measure | before (median) | after (median) | after / before (median of rounds, range) |")
print("|---|---|---|---|")
for name, tp, get in measures:
    b = [get(load("before", r, tp)) for r in range(1, rounds + 1)]
    a = [get(load("after", r, tp)) for r in range(1, rounds + 1)]
    ratios = [x / y for x, y in zip(a, b)]
    print(f"| {name} | {statistics.median(b):.2f} | {statistics.median(a):.2f} | "
          f"{statistics.median(ratios):.3f}× ({min(ratios):.3f}–{max(ratios):.3f}) |")
PY
