#!/usr/bin/env bash
# Prints the directory holding libnvrtc.so.* in target/pyenv (PyPI's nvidia-cuda-nvrtc),
# or nothing when it is not installed.
cd "$(dirname "$0")/.."
PY=target/pyenv/bin/python
[ -x "$PY" ] || exit 0
"$PY" - <<'PY' 2>/dev/null
import importlib.util, pathlib
spec = importlib.util.find_spec("nvidia")
for root in (spec.submodule_search_locations if spec else []):
    for lib in sorted(pathlib.Path(root).rglob("libnvrtc.so*")):
        if "builtins" not in lib.name:
            print(lib.parent)
            raise SystemExit
PY
