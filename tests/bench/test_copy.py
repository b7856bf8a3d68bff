"""The copy benchmark's own machinery, at toy sizes: every number it reports comes from copies
whose bytes it checked (the GPU script runs the same code on CUDA)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from kvoffload.bench.suites import copy as bench

CPU = torch.device("cpu")


def test_one_page_size_verifies_its_copies() -> None:
    r = bench._one_page("tiny", 4096, 4, 1 << 20, 1, CPU)
    assert r["verified"] and r["items_per_job"] == 64
    assert set(r["ratios"]) == {"contiguous store", "contiguous load", "shuffled store",
                                "shuffled load", "native gather, 1 thread (access pattern)"}
    assert r["worst"] == min(v for k, v in r["ratios"].items() if not k.startswith("native"))


def test_expedited_latency_runs_every_case() -> None:
    r = bench.run_expedited_latency(quick=True)
    assert set(r["p50_ms"]) == {"idle", "behind store: regular", "behind store: expedited"}
    assert r["samples"] == 10


def test_processes_sharing_one_pool_check_each_others_pages() -> None:
    r = bench.run_two_process_check(world=2)
    assert r["meets"], r
    assert {int(k) for k in r["ranks"]} == {0, 1}


def test_first_job_check_runs_both_worker_lives_and_verifies() -> None:
    from kvoffload.bench import copy_checks

    if not copy_checks._has_vllm():
        pytest.skip("vLLM is not installed")
    r = bench.run_first_job(sizes=(64 << 20, 4 << 20, 2))
    for case in ("mapped at creation", "mapped in the first job"):
        life = r[case]
        assert life["verified"], r
        assert life["driver"] == "VllmWorker"
        assert len(life["lives"]) == 2
        assert life["first_job_ms"] > 0 and life["later_jobs_p50_ms"] > 0
    # Mapping at creation happens before the first step; the old path has none of it there.
    assert r["mapped at creation"]["setup_before_first_step_s"] > 0
    assert r["mapped in the first job"]["setup_before_first_step_s"] == 0


def test_first_job_check_runs_where_vllm_is_not_installed() -> None:
    """The GPU script's machines have torch but no vLLM: the check uses the worker's pieces."""
    code = ("import sys, json; sys.modules['vllm'] = None\n"
            "from kvoffload.bench.copy_checks import run_first_job\n"
            "r = run_first_job(sizes=(64 << 20, 4 << 20, 2))\n"
            "print(json.dumps(r))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    for case in ("mapped at creation", "mapped in the first job"):
        assert r[case]["verified"] and r[case]["driver"] == "PiecesWorker", r
