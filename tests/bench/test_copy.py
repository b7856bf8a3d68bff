"""The copy benchmark's own machinery, at toy sizes: every number it reports comes from copies
whose bytes it checked (the GPU script runs the same code on CUDA)."""

from __future__ import annotations

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


@pytest.mark.parametrize("with_vllm", [True, False])
def test_first_job_check_runs_both_worker_lives_and_verifies(
        with_vllm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvoffload.bench import copy_checks

    if not with_vllm:  # the GPU script's machines: the same pieces, without vLLM's classes
        monkeypatch.setattr(copy_checks, "_has_vllm", lambda: False)
    elif not copy_checks._has_vllm():
        pytest.skip("vLLM is not installed")
    r = bench.run_first_job(sizes=(64 << 20, 4 << 20, 2))
    for case in ("mapped at creation", "mapped in the first job"):
        life = r[case]
        assert life["verified"], r
        assert life["driver"] == ("VllmWorker" if with_vllm else "PiecesWorker")
        assert len(life["lives"]) == 2
        assert life["first_job_ms"] > 0 and life["later_jobs_p50_ms"] > 0
    # Mapping at creation happens before the first step; the old path has none of it there.
    assert r["mapped at creation"]["setup_before_first_step_s"] > 0
    assert r["mapped in the first job"]["setup_before_first_step_s"] == 0
