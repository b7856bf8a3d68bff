"""The copy benchmark's own machinery, at toy sizes: every number it reports comes from copies
whose bytes it checked (the GPU script runs the same code on CUDA)."""

from __future__ import annotations

import torch
from kvoffload.bench import copy as bench

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
