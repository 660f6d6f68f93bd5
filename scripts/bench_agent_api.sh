#!/usr/bin/env bash
# The agent API's costs (#37's goals), measured against one `strata serve`:
# - constrained decoding: output tokens/s of 32 concurrent streams under a JSON schema vs
#   the same run unconstrained;
# - schema compile: latency of a 1-token request under a fresh typical tool schema (a
#   compile) and under a cached one, minus the same request unconstrained;
# - the Responses and Messages APIs: latency of the same 1-token request on each, against
#   chat completions.
# Model: Llama-3.2-1B's shape cut to 4 layers (a 128k vocabulary: the mask's cost is the
# vocabulary's), bf16, random weights.
#   scripts/bench_agent_api.sh      (needs target/release/strata and target/pyenv)
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=${STRATA:-target/release/strata}
MODEL=${MODEL:-target/bench-models/llama-4l-bf16}
out=target/bench
mkdir -p "$out"
[ -f "$MODEL/model.safetensors" ] || "$STRATA" model random --preset llama-1b --layers 4 --dtype bf16 --out "$MODEL"
# A ChatML template, so chat, Responses and Messages render the same prompt.
python3 - "$MODEL" <<'PY'
import json, sys
p = sys.argv[1] + "/tokenizer_config.json"
c = json.load(open(p))
c["chat_template"] = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
json.dump(c, open(p, "w"))
PY
"$STRATA" serve --model "$MODEL" --name m --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
  --kv-cache-memory 2GiB --max-num-seqs 32 --max-batched-tokens 512 >"$out/agent.ready" 2>"$out/agent.log" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
scripts/ready_address.sh "$out/agent.ready" $pid 120 >/dev/null
http=$(sed -n 's/.*"event":"http".*"address":"\([^"]*\)".*/\1/p' "$out/agent.ready" | head -n 1)
target/pyenv/bin/python scripts/bench_agent_api.py "http://$http" | tee "$out/agent_api.json"
kill -TERM $pid; wait $pid || true
