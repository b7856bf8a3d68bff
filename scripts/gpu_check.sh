#!/usr/bin/env bash
# The copy engine's GPU checks, as one prepared script for a CUDA machine that has python with
# torch (and, ideally, pytest) but not this package installed: nothing is installed here.
# About 5-8 minutes on an H200; every output lands under $OUT (default: a fresh temp folder,
# printed at the end), one file per step, plus summary.txt.
#   OUT=/some/dir bash scripts/gpu_check.sh        # PYTHON=python3.11 to pick the interpreter
# Steps (each bounded by `timeout`, a failed step does not stop the others):
#   1. tests/test_copier_cuda.py: every copy backend (batch, index, rows), pinned and pageable,
#      the expedited stream behind a held-up store stream
#   2. copy bench, pinned pool: batched (cuMemcpyBatchAsync) / device gathers / per-row
#   3. copy bench, pageable pool (batched)
#   4. expedited-load latency with a 2 GiB store in flight, vs idle
#   5. two processes, one pool file, each registering it with CUDA itself
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
trap 'rm -rf "$pkg"' EXIT

status=0
summary="$OUT/summary.txt"
: > "$summary"
step() {  # step NAME SECONDS CMD...: run, keep its output, note its exit code
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$summary"
  [ "$rc" -eq 0 ] || status=1
}

date -u +%FT%TZ > "$OUT/date.txt"
{ nvidia-smi 2>&1 || true; } > "$OUT/nvidia-smi.txt"
"$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' \
  2>&1 | tee "$OUT/env.txt"
"$PY" -c 'from kvoffload.connector.copy_cuda import BatchMemcpy; print("cuMemcpyBatchAsync:", BatchMemcpy.load() is not None)' \
  2>&1 | tee -a "$OUT/env.txt"

if ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "CUDA is not available to $PY: the GPU tests below only skip" | tee "$OUT/NO_CUDA.txt"
  status=2
fi

if "$PY" -c 'import pytest' 2>/dev/null; then
  # --noconftest and -o addopts=: other tests' fixtures and plugins need packages this box lacks.
  step gpu_tests 120 "$PY" -m pytest -p no:cacheprovider --noconftest -o addopts= -m gpu -v -rs \
    tests/test_copier_cuda.py
else
  step gpu_tests 120 "$PY" tests/test_copier_cuda.py
fi

bench="$PY -m kvoffload.bench.copy --device cuda"
step bench_pinned_batch 70 $bench --full --backend auto
step bench_pinned_index 70 $bench --full --backend index
step bench_pinned_rows 70 $bench --full --backend rows
step bench_pageable 60 $bench --backend auto --pageable
step expedited_latency 40 $bench --full --expedited
step two_processes 60 $bench --processes 2

# One line per bench: worst ratio against pinned cudaMemcpy, and the per-page ratios.
for f in "$OUT"/bench_*.out; do
  "$PY" - "$f" >> "$summary" 2>/dev/null <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
rows = "; ".join(f"{p['page']}: {p['ratios']}" for p in d["pages"])
print(f"{sys.argv[1].rsplit('/', 1)[-1]}: worst {d['ratio']} (target {d['target']}) "
      f"backend {d['pages'][0]['cuda_backend']} pinned {d['pages'][0]['pinned']} | {rows}")
EOF
done
cat "$summary"
echo "outputs in $OUT (status $status)"
exit $status
