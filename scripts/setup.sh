#!/usr/bin/env bash
# Sets up .venv from nothing: CPU torch first (a bare `torch` requirement would pull a
# multi-GB CUDA build), then kvoffload with its test extras, then vLLM 0.33.0 as pure Python
# for the interop tests and baselines (see docs/vllm.md). Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; }
pip install --upgrade pip
# torch: on CUDA hosts install the matching CUDA build before running this script.
.venv/bin/python -c 'import torch' 2>/dev/null || pip install "torch==2.13.0"
pip install -e '.[test]'
# Shared tier (docs/tiers.md): the CPU build of Mooncake's store client and mooncake_master.
# Any mooncake build already there (the CUDA one on GPU hosts) is kept.
if [ "${KVOFFLOAD_SKIP_MOONCAKE:-0}" != 1 ]; then
  .venv/bin/python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("mooncake") is None)' \
    2>/dev/null || pip install "mooncake-transfer-engine-non-cuda==0.3.13.post1"
fi
if [ "${KVOFFLOAD_SKIP_VLLM:-0}" != 1 ]; then
  .venv/bin/python -c 'import vllm, sys; sys.exit(vllm.__version__ != "0.33.0")' 2>/dev/null \
    || { pip install --no-deps "vllm==0.33.0"; pip install --no-deps -r requirements/vllm-cpu.txt; }
fi
.venv/bin/python -c 'import kvoffload, torch, zmq, msgspec; print("kvoffload", kvoffload.__version__, "torch", torch.__version__)'
