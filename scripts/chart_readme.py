#!/usr/bin/env python3
"""Writes helm/strata/README.md: how to install the chart, and every value it takes —
generated from values.schema.json (the keys, their types and allowed values) with the
defaults of values.yaml and the comments above each key there.

    scripts/chart_readme.py           # write the README
    scripts/chart_readme.py --check   # exit 1 if the README is not what it would write
"""

import json
import os
import re
import sys

import yaml

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))
CHART = os.path.join(ROOT, "helm", "strata")
README = os.path.join(CHART, "README.md")

HEADER = """# The Strata Helm chart

Strata on Kubernetes: etcd (bundled, with TLS, or yours), coordinators behind one Service
(gRPC `50051`, the OpenAI HTTP API `8000`), workers as a StatefulSet (one GPU each in `gpu`
mode, the CPU backend in `cpu` mode), mutual TLS between them, the models of `models[]`
deployed by a hook Job after every install and upgrade, and `helm test`.

```sh
# GPU nodes: build and push the CUDA image (every role runs it), then install.
make image-cuda IMAGE=registry.example.com/strata && docker push registry.example.com/strata:0.1.0-cuda
helm install strata helm/strata -n inference --create-namespace \\
  --set image.repository=registry.example.com/strata \\
  --set 'models[0].name=llama' --set 'models[0].path=llama' --set 'models[0].replicas=2'

# A laptop cluster (kind, minikube): CPU workers, models from a directory on the node.
helm install strata helm/strata -n inference --create-namespace -f helm/strata/values-small.yaml \\
  --set 'models[0].name=demo' --set 'models[0].path=demo'

helm test strata -n inference
```

The admin token is in the `<release>-admin` Secret; `NOTES.txt` prints the commands. The
README of the repository says more (Kubernetes section); docs/RUNBOOK.md says what failures
look like.

## Values

Generated from `values.schema.json` and `values.yaml` by `scripts/chart_readme.py` (the
chart checks fail when this table is out of date). The schema refuses unknown keys.

| key | type | default | description |
|---|---|---|---|
"""


def comments(path):
    """The comment block right above each key of values.yaml, by dotted path."""
    out, stack, block = {}, [], []
    for line in open(path):
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        m = re.match(r"^( *)([A-Za-z0-9_]+):", line)
        if not m:
            block = []
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        key = ".".join(k for _, k in stack)
        text = " ".join(b for b in block if b)
        if text:
            out[key] = text
        block = []
    return out


def kind(schema):
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    t = schema.get("type", "")
    if isinstance(t, list):
        t = " or ".join(t)
    if t == "array" and "items" in schema:
        items = schema["items"]
        inner = "object" if "properties" in items else kind(items)
        return f"array of {inner}"
    return t or "any"


def default(values, key):
    v = values
    for part in key.split("."):
        if not isinstance(v, dict) or part not in v:
            return ""
        v = v[part]
    if isinstance(v, (dict, list)) and v:
        return "see values.yaml"
    return f"`{json.dumps(v)}`"


def rows(schema, values, notes, prefix=""):
    for name, sub in schema.get("properties", {}).items():
        key = f"{prefix}{name}"
        if sub.get("type") == "object" and "properties" in sub:
            text = notes.get(key) or sub.get("description", "")
            if text:
                yield f"| `{key}` | object |  | {text.replace('|', chr(92) + '|')} |"
            yield from rows(sub, values, notes, key + ".")
            continue
        text = notes.get(key) or sub.get("description", "")
        text = text.replace("|", "\\|")
        yield f"| `{key}` | {kind(sub)} | {default(values, key)} | {text} |"
        items = sub.get("items", {})
        if sub.get("type") == "array" and "properties" in items:
            for line in rows(items, {}, notes, key + "[]."):
                yield line


def render():
    schema = json.load(open(os.path.join(CHART, "values.schema.json")))
    values = yaml.safe_load(open(os.path.join(CHART, "values.yaml")))
    notes = comments(os.path.join(CHART, "values.yaml"))
    return HEADER + "\n".join(rows(schema, values, notes)) + "\n"


def main():
    text = render()
    if sys.argv[1:] == ["--check"]:
        current = open(README).read() if os.path.exists(README) else ""
        if current != text:
            print("helm/strata/README.md is out of date: run scripts/chart_readme.py")
            sys.exit(1)
        return
    with open(README, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
