#!/usr/bin/env bash
# The copier's GPU checks, as one script for a CUDA machine that has python with torch (and,
# ideally, pytest) but not this package installed: nothing is installed here. It runs the
# CUDA tests (tests/test_copier_cuda.py) and the copy benchmark, and writes every output under
# $OUT (default: a fresh temp folder, printed at the end).
#   bash scripts/gpu_check.sh            # PYTHON=python3.11 to pick the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && .venv/bin/python -c 'import torch' 2>/dev/null && PY=${PYTHON:-.venv/bin/python}

# kvoffload.* maps top-level folders (see pyproject's package-dir); without an install, build
# that package tree from symlinks so `import kvoffload.connector` works.
pkg=$(mktemp -d)
mkdir -p "$pkg/kvoffload"
for f in kvoffload/*.py; do ln -s "$repo/$f" "$pkg/kvoffload/"; done
for sub in connector bench daemon events; do
  [ -d "$sub" ] && ln -s "$repo/$sub" "$pkg/kvoffload/$sub"
done
export PYTHONPATH="$pkg${PYTHONPATH:+:$PYTHONPATH}"

status=0
{ nvidia-smi 2>&1 || true; } > "$OUT/nvidia-smi.txt"
"$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' \
  2>&1 | tee "$OUT/env.txt"

if ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "CUDA is not available to $PY: the GPU tests below only skip" | tee "$OUT/NO_CUDA.txt"
  status=2
fi

if "$PY" -c 'import pytest' 2>/dev/null; then
  # --noconftest and -o addopts=: other tests' fixtures and plugins need packages this box lacks.
  "$PY" -m pytest -p no:cacheprovider --noconftest -o addopts= -m gpu -v -rs \
    tests/test_copier_cuda.py 2>&1 | tee "$OUT/gpu_tests.txt"
  rc=${PIPESTATUS[0]}
else
  "$PY" tests/test_copier_cuda.py 2>&1 | tee "$OUT/gpu_tests.txt"
  rc=${PIPESTATUS[0]}
fi
[ "$rc" -eq 0 ] || status=1

"$PY" -m kvoffload.bench.copy --full 2>"$OUT/copy_bench.err" | tee "$OUT/copy_bench.json"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

rm -rf "$pkg"
echo "outputs in $OUT (status $status)"
exit $status
