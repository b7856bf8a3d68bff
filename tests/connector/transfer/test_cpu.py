"""The CPU copy executor (connector/transfer/cpu.py): helpers that pull a job's units from one
shared list, so a helper that cannot run costs nothing but its share; the placement hint that
keeps helpers off the caller's CPU; lanes that outlive the copiers using them."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest
import torch
from kvoffload.connector.transfer import cpu as copy_cpu
from kvoffload.connector.transfer.engine import STORE, BlockCopier, PoolMapping, build_cpu_lanes
from kvoffload.connector.transfer.plan import plan_work, segment_views

from tests.connector.transfer.test_paths import (
    SLOT,
    block_bytes,
    check_pool,
    layer_compact,
    mapping,  # noqa: F401  (the fixture)
)

ITEMS = [(0, b, s) for b, s in zip(range(2, 14), [5, 9, 0, 17, 3, 11, 21, 7, 14, 1, 19, 2],
                                   strict=True)]


class _StuckRun:
    """Stands in for a job that keeps a helper busy until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def join(self) -> bool:
        self.entered.set()
        assert self.release.wait(30)
        return False


def _work(pool_map: PoolMapping, items: list[tuple[int, int, int]]) -> Any:
    views = [[(kv.numpy(), pool.numpy()) for kv, pool in segs]
             for segs in segment_views(layer_compact(3), pool_map.slot_view(SLOT))]
    return plan_work(views, np.array(items, dtype=np.int64), by_slot=True)


def test_a_helper_that_cannot_run_does_not_hold_the_job(
        mapping: PoolMapping, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # Small units: every item is its own unit, so the job has twelve to share.
    monkeypatch.setattr(copy_cpu, "_CHUNK_BYTES", SLOT // 2)
    memcpy = copy_cpu.CpuMemcpy(3)
    stuck = _StuckRun()
    try:
        memcpy._helpers[0].queue.put(stuck)  # type: ignore[arg-type]
        assert stuck.entered.wait(10)  # helper 0 is busy elsewhere for the whole job
        memcpy.copy(_work(mapping, ITEMS), True)  # returns: the others took its share
        src = layer_compact(3)
        check_pool(mapping.slot_view(SLOT), src, ITEMS)
    finally:
        stuck.release.set()
        memcpy.close()


def test_an_error_on_a_helper_fails_the_job(
        mapping: PoolMapping, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setattr(copy_cpu, "_CHUNK_BYTES", SLOT // 2)
    real = copy_cpu.np.copyto
    failed = threading.Event()
    memcpy = copy_cpu.CpuMemcpy(2)
    helper = memcpy._helpers[0]._thread

    def copyto(dst: Any, src: Any) -> None:
        if threading.current_thread() is helper:
            failed.set()
            raise MemoryError("a piece fails on the helper")
        failed.wait(10)  # the caller holds its first piece until the helper has failed
        real(dst, src)

    try:
        monkeypatch.setattr(copy_cpu.np, "copyto", copyto)
        with pytest.raises(MemoryError):
            memcpy.copy(_work(mapping, ITEMS), True)
        assert failed.is_set()
    finally:
        monkeypatch.setattr(copy_cpu.np, "copyto", real)
        memcpy.close()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two allowed CPUs")
def test_helpers_are_kept_off_the_callers_cpu() -> None:
    import ctypes

    memcpy = copy_cpu.CpuMemcpy(2)
    try:
        tid = memcpy._helpers[0].tid
        allowed = os.sched_getaffinity(0)
        memcpy._spread.apply()
        here = ctypes.CDLL(None).sched_getcpu()
        # The hint is re-applied only when the caller moves: check against where it ran then.
        cpu = memcpy._spread._last
        assert cpu is not None and cpu in allowed
        assert os.sched_getaffinity(tid) == allowed - {cpu}
        assert here in allowed
    finally:
        memcpy.close()


def test_lanes_outlive_the_copiers_that_share_them(mapping: PoolMapping) -> None:  # noqa: F811
    lanes = build_cpu_lanes(rank=7, threads=2)
    try:
        names = {t.name for t in threading.enumerate()}
        assert {"kvoffload-store-r7", "kvoffload-load-r7", "kvoffload-expedited-r7"} <= names
        src = layer_compact(4)
        for job, block in ((1, 3), (2, 9)):  # two copiers in turn, as after a daemon restart
            with BlockCopier(mapping, src, 0, 1, SLOT, cpu_lanes=lanes) as w:
                assert w.submit_store(job, [(0, block, job)])
                w.wait([job])
                assert [(r.job_id, r.ok) for r in w.get_finished()] == [(job, True)]
            assert torch.equal(mapping.slot_view(SLOT)[job, : src.groups[0].bytes_per_block],
                               block_bytes(src, 0, block))
        assert lanes[STORE]._thread.is_alive()  # the copiers' close left the threads running
    finally:
        for lane in lanes.values():
            lane.close()
    assert not lanes[STORE]._thread.is_alive()


def test_store_threads_step_aside_while_an_expedited_load_is_in_flight(
        mapping: PoolMapping, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setattr(copy_cpu, "_CHUNK_BYTES", SLOT // 2)  # many small units per job
    lanes = build_cpu_lanes(rank=5, threads=1)  # one thread a lane: the order is exact
    events: list[str] = []
    lock = threading.Lock()
    holding, release = threading.Event(), threading.Event()
    real = copy_cpu.np.copyto

    def copyto(dst: Any, src: Any) -> None:
        kind = "E" if "expedited" in threading.current_thread().name else "S"
        with lock:
            events.append(kind)
        if kind == "S" and not holding.is_set():
            holding.set()  # the store's first unit is held mid-copy
            assert release.wait(10)
        real(dst, src)

    src = layer_compact(6)
    try:
        with BlockCopier(mapping, src, 0, 1, SLOT, cpu_lanes=lanes) as w:
            monkeypatch.setattr(copy_cpu.np, "copyto", copyto)
            assert w.submit_store(1, ITEMS)
            assert holding.wait(10)
            with lock:
                events.append("submit")
            assert w.submit_load(2, [(0, 30, 5), (0, 31, 9)], expedited=True)
            release.set()
            w.wait([1, 2])
            monkeypatch.setattr(copy_cpu.np, "copyto", real)
            assert sorted((r.job_id, r.ok) for r in w.get_finished()) == [(1, True), (2, True)]
    finally:
        for lane in lanes.values():
            lane.close()
    after = events[events.index("submit") + 1 :]
    assert "E" in after and "S" in after
    # Every piece of the expedited load ran before the store copied its next unit.
    first_store = after.index("S")
    assert set(after[:first_store]) == {"E"} and "E" not in after[first_store:]
    check_pool(mapping.slot_view(SLOT), src, ITEMS)
