#!/usr/bin/env bash
# The copy engine's GPU checks, as one prepared script for a CUDA machine that has python with
# torch (and, ideally, pytest) but not this package installed: nothing is installed here.
# About 5-7 minutes on an H200 (each step bounded by `timeout`, ~7.5 min in all at worst);
# every output lands under $OUT (default: a fresh temp folder, printed at the end): one
# .out/.err per step, summary.txt, and results.json + results.md (the GPU rows of
# BENCHMARKS.md's copy section).
#   OUT=/some/dir bash scripts/gpu_check.sh     # PYTHON=... to pick the interpreter
#   DEVICE=cpu QUICK=1 bash scripts/gpu_check.sh   # dry run of every step on a CPU box
# Steps (a failed step does not stop the others):
#   gpu_tests           tests/connector/transfer/test_cuda.py: every copy backend (batch, index, rows),
#                       pinned and pageable, the expedited stream behind a held-up store stream
#   bench_pinned_*      copy bench, pinned pool: batched (cuMemcpyBatchAsync) / device
#                       gathers / per-row, against pinned cudaMemcpy (target 0.9)
#   bench_pageable      copy bench, pageable pool (batched)
#   expedited_latency   a one-block load behind a 512 MiB store in flight, vs idle
#   two_processes       two processes, one pool file, each registering it with CUDA itself
#   first_job           the first job after a worker's creation (pool mapped and pinned in the
#                       background) vs later jobs, and vs pinning inside the first job
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
SIZE=--full
[ -n "${QUICK:-}" ] && SIZE=

# The interpreter: $PYTHON if given; else the first of python3, python, .venv/bin/python whose
# torch sees CUDA (a CPU-only venv must not win on a GPU box); on DEVICE=cpu, the first with torch.
pick_python() {
  local want=$1 cand
  for cand in python3 python .venv/bin/python; do
    command -v "$cand" > /dev/null 2>&1 || [ -x "$cand" ] || continue
    if [ "$want" = cuda ]; then
      "$cand" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null \
        && { echo "$cand"; return; }
    else
      "$cand" -c 'import torch' 2>/dev/null && { echo "$cand"; return; }
    fi
  done
  [ "$want" = cuda ] && pick_python cpu
}
PY=${PYTHON:-$(pick_python "$DEVICE")}
PY=${PY:-python3}

# kvoffload.* maps top-level folders (setup.py); without an install, build that package tree
# from symlinks so `import kvoffload.connector` works.
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
: > "$OUT/steps.txt"
step() {  # step NAME SECONDS CMD...: run, keep its output, note its exit code and time
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$summary"
  echo "$name $rc $((SECONDS - t0)) $limit" >> "$OUT/steps.txt"
  [ "$rc" -eq 0 ] || status=1
}

date -u +%FT%TZ > "$OUT/date.txt"
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || echo unknown > "$OUT/commit.txt"
{ nvidia-smi 2>&1 || true; } > "$OUT/nvidia-smi.txt"
"$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' \
  2>&1 | tee "$OUT/env.txt"
"$PY" -c 'from kvoffload.connector.transfer.cuda import BatchMemcpy; print("cuMemcpyBatchAsync:", BatchMemcpy.load() is not None)' \
  2>&1 | tee -a "$OUT/env.txt"
# Pool files go to /dev/shm when it has 4 GiB free, else $TMPDIR (bench/copy_setup.pool_folder).
df -h /dev/shm "${TMPDIR:-/tmp}" 2>&1 | tee "$OUT/df.txt"

if [ "$DEVICE" = cuda ] && ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "CUDA is not available to $PY: the GPU tests below only skip" | tee "$OUT/NO_CUDA.txt"
  status=2
fi

if "$PY" -c 'import pytest' 2>/dev/null; then
  # --noconftest and -o addopts=: other tests' fixtures and plugins need packages this box lacks.
  step gpu_tests 100 "$PY" -m pytest -p no:cacheprovider --noconftest -o addopts= -m gpu -v -rs \
    tests/connector/transfer/test_cuda.py
else
  step gpu_tests 100 "$PY" tests/connector/transfer/test_cuda.py
fi

bench=("$PY" -m kvoffload.bench.suites.copy --device "$DEVICE")
step bench_pinned_batch 60 "${bench[@]}" $SIZE --no-first-job --backend auto
step bench_pinned_index 50 "${bench[@]}" $SIZE --no-first-job --backend index
step bench_pinned_rows 50 "${bench[@]}" $SIZE --no-first-job --backend rows
step bench_pageable 50 "${bench[@]}" --no-first-job --backend auto --pageable
step expedited_latency 40 "${bench[@]}" $SIZE --expedited
step two_processes 50 "${bench[@]}" --processes 2
step first_job 40 "${bench[@]}" $SIZE --first-job

# results.json + results.md from every step's output; a step that failed is "not run" with
# the tail of its stderr as the reason.
"$PY" - "$OUT" > "$OUT/report.err" 2>&1 <<'EOF' || { status=1; cat "$OUT/report.err"; }
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
steps = {}
for line in (out / "steps.txt").read_text().splitlines():
    name, rc, secs, limit = line.split()
    steps[name] = {"rc": int(rc), "seconds": int(secs), "limit_s": int(limit)}


def load(name):
    """The step's JSON, or a not-run reason (its rc and last stderr line)."""
    try:
        return json.loads((out / f"{name}.out").read_text())
    except (OSError, ValueError):
        err = (out / f"{name}.err").read_text(errors="replace").strip().splitlines()
        rc = steps.get(name, {}).get("rc")
        why = "timed out" if rc in (124, 137) else (err[-1] if err else "no output")
        return {"not_run": f"rc={rc}: {why}"}


tests = (out / "gpu_tests.out").read_text(errors="replace").strip().splitlines()
results = {
    "date": (out / "date.txt").read_text().strip(),
    "commit": (out / "commit.txt").read_text().strip(),
    "env": (out / "env.txt").read_text().strip(),
    "steps": steps,
    "gpu_tests": {"rc": steps.get("gpu_tests", {}).get("rc"), "last": tests[-1] if tests else ""},
}
for name in steps:
    if name != "gpu_tests":
        results[name] = load(name)
(out / "results.json").write_text(json.dumps(results, indent=2))

env = results["env"].replace("\n", "; ")
md = [f"GPU checks, {results['date']} (commit {results['commit'][:10]}): {env}", "",
      f"tests/connector/transfer/test_cuda.py: rc={results['gpu_tests']['rc']}, "
      f"`{results['gpu_tests']['last']}`", ""]
cols = ("contiguous store", "contiguous load", "shuffled store", "shuffled load")
for name in ("bench_pinned_batch", "bench_pinned_index", "bench_pinned_rows", "bench_pageable"):
    d = results.get(name, {})
    if "pages" not in d:
        md += [f"**{name}**: not run ({d.get('not_run', 'missing')})", ""]
        continue
    first = d["pages"][0]
    md += [f"**{name}** (backend {first['cuda_backend']}, pinned {first['pinned']}): worst "
           f"{d['ratio']} of the floor (target {d['target']}; medians {d['ratio_median']})", "",
           "| page | floor store / load GB/s | " + " | ".join(cols) + " |",
           "|---|---|" + "---|" * len(cols)]
    for p in d["pages"]:
        g = p["gbps"]
        md.append(f"| {p['page']} | {g['floor store']} / {g['floor load']} | "
                  + " | ".join(f"{p['ratios'][c]} ({g[c]} GB/s)" for c in cols) + " |")
    md.append("")
e = results.get("expedited_latency", {})
md.append(f"**expedited latency** (p50 ms, a {e.get('load_bytes', '?')} B load behind a "
          f"{e.get('store_bytes', '?')} B store): {e.get('p50_ms', e)}")
t = results.get("two_processes", {})
md.append(f"**two processes, one registered pool**: meets={t.get('meets')} "
          f"ranks={t.get('ranks', t)}")
f = results.get("first_job", {})
md.append(f"**first job after worker creation**: {f.get('mapped at creation', f)}; "
          f"pinned inside the first job: {f.get('mapped in the first job', '-')}")
(out / "results.md").write_text("\n".join(md) + "\n")
EOF

cat "$summary"
[ -f "$OUT/results.md" ] && cat "$OUT/results.md"
echo "outputs in $OUT (status $status)"
exit $status
