"""Distinct blocks resident (bench/residency.py): counted from the daemon's shared index and
from vLLM's own cache-policy dicts, each checked against a count taken another way. No timing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kvoffload.bench.residency import daemon_resident
from kvoffload.bench.vllm_baseline import vllm_import_error
from kvoffload.daemon.store import shared_index as si

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def test_index_count_tells_copies_from_keys(tmp_path: Path) -> None:
    """Written the way the daemon writes it: a key READY in two namespaces is two resident
    blocks and one distinct key; PENDING and FREE entries hold nothing yet."""
    pool = tmp_path / "pool"
    w = si.SharedIndexWriter(si.index_path_for(pool), 8, "test")
    try:
        w.write(0, 1, 1, si.READY, 0, b"a" * 36)
        w.write(1, 1, 2, si.READY, 0, b"a" * 36)  # the same key, another namespace
        w.write(2, 1, 1, si.READY, 0, b"c" * 36)
        w.write(3, 1, 1, si.PENDING, 0, b"d" * 36)
        w.write(4, 1, 1, si.READY, 0, b"e" * 36)
        w.write(4, 2, 0, si.FREE, 0, None)  # evicted since
        got = daemon_resident(str(pool))
    finally:
        w.close()
    assert got == {"resident": 3, "distinct": 2, "namespaces": 2, "pending": 1, "slots": 8}


@pytest.mark.vllm
@pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error()))
@pytest.mark.parametrize(("routing", "config"), [("round_robin", "chunk-lru"),
                                                  ("kv_aware_cpu", "chunk-arc")])
def test_counts_on_the_shipped_trace(routing: str, config: str) -> None:
    """The shipped generated trace, 4 engines, a pool that fills: our distinct count is the
    daemon's Stats ``ready`` (read over the control socket) and one copy per key; vLLM's union
    is at most its sum, each engine's count is what its chunk allocator has handed out (LRU's
    table; ARC's T1 and T2 without its ghost lists)."""
    from kvoffload.bench.residency import capacity, vllm_resident_keys
    from kvoffload.bench.suites.trace import run_ours, run_vllm
    from kvoffload.bench.trace_replay import Scale, load_trace

    shipped = Path(__file__).resolve().parents[1] / "data" / "mooncake_like_trace.jsonl"
    window, gpu, host = load_trace(shipped)[:30], 176, 4 * 48
    ours = run_ours(window, routing, 4, gpu, host, Scale(), residency_every=10)
    res = ours["residency"]
    assert res["at"] == [10, 20, 30]
    assert res["stats_ready_final"] == res["resident"]["final"] == res["distinct"]["final"]
    assert res["namespaces"] == 1  # every engine of one model in one namespace: no copies
    # A full pool: every slot is a block, a reservation or free, nothing else.
    assert 0 < res["distinct"]["final"] + res["reserved"]["final"] <= host

    held: list[list[int]] = []

    def allocator(replay: object, i: int, config: str) -> None:
        # Chunks handed out and not freed, from vLLM's allocator rather than its policy dicts.
        held.append([e.connector.connector_scheduler.manager._num_allocated_chunks
                     - len(e.connector.connector_scheduler.manager._free_list)
                     for e in replay.engines])  # type: ignore[attr-defined]
        if i == 10:
            keys = [vllm_resident_keys(e.connector.connector_scheduler.manager)
                    for e in replay.engines]  # type: ignore[attr-defined]
            assert [len(k) for k in keys] == held[-1]

    theirs = run_vllm(window, routing, 4, gpu, host, Scale(), config,
                      residency_every=10, before=allocator)
    v = theirs["residency"]
    assert v["union"]["final"] <= v["sum"]["final"] <= host
    assert max(v["per_engine_final"]) <= v["union"]["final"]
    assert all(n <= host // 4 for n in v["per_engine_final"])
    assert v["duplication"]["final"] >= 1.0
    cap = capacity(res, v)
    assert cap["final"] == round(res["distinct"]["final"] / v["union"]["final"], 3)
    if routing == "round_robin":
        # Consecutive requests on different engines share the trace's common first blocks:
        # per-engine caches hold some of them more than once.
        assert v["sum"]["final"] > v["union"]["final"]
