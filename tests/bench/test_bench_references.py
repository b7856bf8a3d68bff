"""What the copy, events and memory suites now report beside their headlines: the copy's
all-core STREAM-style reference, event batches of an engine step's size with CPU per event,
and the node's whole index memory. Tiny sizes; no figure is asserted against a speed."""

from __future__ import annotations

import pytest
from kvoffload.bench.suites import copy as copy_bench
from kvoffload.bench.suites.memory import ENGINES, run_memory_bench


def test_copy_reports_the_machine_reference_next_to_the_floor() -> None:
    r = copy_bench._one_page("tiny", 4096, 4, 1 << 20, 1, copy_bench.pick_device("cpu"))
    assert r["verified"] and r["gbps"]["stream copy"] > 0
    cells = {f"{p} {d}" for p in ("contiguous", "shuffled") for d in ("store", "load")}
    assert set(r["ratios_vs_stream"]) == cells
    # Each cell against the machine is its ratio against the floor times floor / machine.
    for cell, vs in r["ratios_vs_stream"].items():
        d = cell.split()[1]
        assert vs == pytest.approx(r["ratios"][cell] * r["floor_vs_stream"][d], rel=0.02,
                                   abs=0.002)
    assert r["worst_vs_stream"] == min(r["ratios_vs_stream"].values())


def test_events_cover_engine_step_batches_with_cpu_per_event() -> None:
    from kvoffload.bench.suites.events import STEP_BATCHES, run_events_bench

    r = run_events_bench(True, n_batches=512, rounds=1)
    for per in (1, 8, *STEP_BATCHES):
        suffix = "" if per == 1 else f"_{per}"
        assert r[f"ours_events_per_s{suffix}"] > 0 and r[f"lost_events{suffix}"]["ours"] == 0
        assert r[f"cpu_us_per_event{suffix}"]["ours"] > 0
        if r["vllm_events_per_s"] is not None:
            assert r[f"cpu_us_per_event{suffix}"]["vllm"] > 0
    assert r["n_batches"][256] == 4  # the same 1,024 events in 256-event batches


def test_memory_node_total_counts_daemon_shared_index_and_every_view() -> None:
    r = run_memory_bench(True, sizes=(200,), rss_sizes=(3_000,))
    # The engine's view holds the namespace's READY keys (the daemon may keep a few slots
    # free ahead once an index reader is registered).
    assert 2_700 <= r["index_view_keys"] <= r["ready_blocks"] == 3_000
    assert r["shared_index_bytes"] >= 64 * 3_000 and r["index_view_bytes"] > 0
    assert r["node_total_bytes"] == (r["rss_anon_bytes"]["3000"] + r["shared_index_bytes"]
                                     + ENGINES * r["index_view_bytes"])
    if "vllm_manager_bytes_per_block" in r:  # the same blocks, each indexed once by vLLM
        assert r["vllm_node_total_bytes"] == pytest.approx(
            r["vllm_manager_bytes_per_block"] * r["index_view_keys"], rel=1e-3)
