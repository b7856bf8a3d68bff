#!/usr/bin/env bash
# Sets up .venv from nothing: CPU torch first (a bare `torch` requirement would pull a
# multi-GB CUDA build), then kvoffload with its test extras, then vLLM 0.33.0 as pure Python
# for the interop tests and baselines (see docs/vllm.md). Idempotent; safe to re-run.
#
# System packages (Debian/Ubuntu, when root or password-less sudo is available): the Mooncake
# wheel's shared libraries need libibverbs1, librdmacm1 and libnuma1 even for TCP
# (docs/tiers.md), and the Prometheus tests need Debian's `prometheus` (it ships promtool).
# Only missing ones are installed; without apt the script says what to install and goes on
# (those tests then skip with that reason). KVOFFLOAD_SKIP_APT=1 skips this step.
set -euo pipefail
cd "$(dirname "$0")/.."
apt_packages() {
  local need=() pkg
  [ "${KVOFFLOAD_SKIP_MOONCAKE:-0}" = 1 ] || need+=(libibverbs1 librdmacm1 libnuma1)
  [ "${KVOFFLOAD_SKIP_PROMETHEUS:-0}" = 1 ] || need+=(prometheus)
  local missing=()
  for pkg in "${need[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  [ "${#missing[@]}" -gt 0 ] || return 0
  local sudo=
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"
    else
      echo "setup: not root and no password-less sudo: install ${missing[*]} with apt yourself" \
           "(Mooncake and Prometheus tests skip without them)" >&2
      return 0
    fi
  fi
  echo "setup: apt-get install ${missing[*]}" >&2
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    "${missing[@]}" >/dev/null
}
if [ "${KVOFFLOAD_SKIP_APT:-0}" != 1 ]; then
  if command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1; then
    apt_packages
  else
    echo "setup: no apt-get here: install libibverbs1 librdmacm1 libnuma1 (Mooncake tier) and" \
         "prometheus + promtool 2.42+ (Prometheus tests) with your package manager" >&2
  fi
fi
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
# Dynamo's KV indexer for the router tests, in its own venv (its pydantic pin clashes with vLLM).
bash scripts/setup_dynamo.sh
.venv/bin/python -c 'import kvoffload, torch, zmq, msgspec; print("kvoffload", kvoffload.__version__, "torch", torch.__version__)'
