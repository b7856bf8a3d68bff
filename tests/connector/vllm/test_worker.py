"""Our vLLM worker's copy engine life cycle: the pool mapped at creation and kept across a daemon
restart that kept its file, impossible geometries refused in one line (at creation) or as
failed jobs (never an exception inside submit_*), expedited loads through the worker."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_harness import vllm_import_error  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]

SLOT_BYTES = 4096
SLOTS = 32


class Pools:
    """Pool files and daemon indexes in /dev/shm, as a daemon (and its restarts) leaves them."""

    def __init__(self) -> None:
        self.base = f"/dev/shm/kvoffload-wt-{uuid.uuid4().hex[:10]}"
        self.writers: list[Any] = []

    def pool(self) -> str:
        Path(self.base).unlink(missing_ok=True)  # a recreated file is a new inode
        Path(self.base).write_bytes(b"\x5a" * SLOT_BYTES * SLOTS)
        return self.base

    def info(self, daemon_id: str, slot_bytes: int = SLOT_BYTES, world: int = 1) -> Any:
        from kvoffload.connector.vllm.load_spec import PoolInfo
        from kvoffload.daemon.store.shared_index import SharedIndexWriter

        index = f"{self.base}.{daemon_id}.index"
        self.writers.append(SharedIndexWriter(index, SLOTS, daemon_id))
        return PoolInfo(daemon_id, self.base, SLOT_BYTES * SLOTS, slot_bytes,
                        slot_bytes // world, index)

    def close(self) -> None:
        for w in self.writers:
            w.close()
        Path(self.base).unlink(missing_ok=True)


@pytest.fixture
def pools() -> Iterator[Pools]:
    p = Pools()
    yield p
    p.close()


def canonical() -> Any:
    from tests.connector.transfer.test_engine import _vllm_canonical

    return _vllm_canonical("LBHNC")[0]  # groups of 2048 and 320 bytes per block


def store(worker: Any, job: int, info: Any, block: int = 1, slot: int = 3) -> list[Any]:
    from kvoffload.connector.vllm.load_spec import PoolSlotsSpec
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    assert worker.submit_store(job, GPULoadStoreSpec([block], [1, 0], [0, 0]),
                               PoolSlotsSpec([slot], info)) is True
    worker.wait({job})
    return worker.get_finished()


def load(worker: Any, job: int, info: Any, expedited: bool = False) -> bool:
    from kvoffload.connector.vllm.load_spec import PoolSlotsSpec
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    return bool(worker.submit_load(job, PoolSlotsSpec([3], info),
                                   GPULoadStoreSpec([9], [1, 0], [0, 0]), expedited=expedited))


def test_pool_mapped_at_creation_and_kept_across_restart(
    pools: Pools, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvoffload.connector.transfer.pool_map import PoolMapping
    from kvoffload.connector.vllm.worker import DaemonOffloadingWorker
    from prometheus_client import REGISTRY

    path = pools.pool()
    gate = threading.Event()
    real = PoolMapping._populate

    def slow_populate(self: PoolMapping) -> None:
        assert gate.wait(30)  # pre-faulting a big pool takes seconds
        real(self)

    monkeypatch.setattr(PoolMapping, "_populate", slow_populate)
    w = DaemonOffloadingWorker(canonical(), 0, 1, pool_path=path)
    assert w._task is not None and not w._task.ready  # creation did not wait for it
    # The copy threads run from creation, before any job and before the pool is mapped.
    assert w._lanes is not None
    lane_threads = {t.name for t in threading.enumerate() if t.name.startswith("kvoffload-")
                    and t.name.endswith("-r0")}
    assert {"kvoffload-store-r0", "kvoffload-load-r0", "kvoffload-expedited-r0"} <= lane_threads
    lanes = dict(w._lanes)
    gate.set()
    mapped = w._task.wait_ready(30)
    assert REGISTRY.get_sample_value("kvoffload_worker_pin_seconds") == w._task.seconds
    assert [(r.job_id, r.success) for r in store(w, 1, pools.info("d1"))] == [(1, True)]
    assert w._mapping is mapped  # the first job used the mapping made at creation
    # The daemon restarts and reopens the same file: same mapping, new daemon id.
    assert [(r.job_id, r.success) for r in store(w, 2, pools.info("d2"))] == [(2, True)]
    assert w._mapping is mapped
    # It restarts with a recreated file: the old mapping is let go, the new file mapped.
    pools.pool()
    assert [(r.job_id, r.success) for r in store(w, 3, pools.info("d3"))] == [(3, True)]
    assert w._mapping is not mapped and not mapped.same_file(path, SLOT_BYTES * SLOTS)
    assert bytes(w._mapping.tensor[3 * SLOT_BYTES : 3 * SLOT_BYTES + 4].numpy()) != b"\x5a" * 4
    assert w._lanes == lanes  # three copiers, one set of threads
    w.shutdown()
    assert not any(t.name == "kvoffload-store-r0" for t in threading.enumerate())


def test_impossible_geometry_refused_at_creation_in_one_line() -> None:
    from kvoffload.connector.transfer.engine import GeometryError
    from kvoffload.connector.vllm.worker import DaemonOffloadingWorker

    with pytest.raises(GeometryError) as info:  # --slot-bytes not divisible by the TP world
        DaemonOffloadingWorker(canonical(), 1, 2, slot_bytes=4097)
    assert "not a positive multiple of the 2 ranks" in str(info.value)
    with pytest.raises(GeometryError) as info:
        DaemonOffloadingWorker(canonical(), 0, 4, slot_bytes=SLOT_BYTES)
    assert "needs 2048 B per block" in str(info.value) and "\n" not in str(info.value)
    DaemonOffloadingWorker(canonical(), 1, 2, slot_bytes=SLOT_BYTES).shutdown()


@pytest.mark.parametrize("slot_bytes, world, missing", [(4097, 2, False), (SLOT_BYTES, 4, False),
                                                        (SLOT_BYTES, 1, True)])
def test_job_that_cannot_be_copied_fails_never_raises(
    pools: Pools, slot_bytes: int, world: int, missing: bool
) -> None:
    from kvoffload.connector.vllm.worker import DaemonOffloadingWorker

    pools.pool()
    info = pools.info("d1", slot_bytes, world)
    if missing:
        Path(pools.base).unlink()
    w = DaemonOffloadingWorker(canonical(), 0, world)
    assert [(r.job_id, r.success) for r in store(w, 1, info)] == [(1, False)]
    assert load(w, 2, info) is True  # submission succeeds; the job is reported failed
    w.wait({2})
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(2, False)]
    w.shutdown()


def test_expedited_load_through_the_worker(pools: Pools) -> None:
    from kvoffload.connector.transfer.engine import STORE, BlockCopier
    from kvoffload.connector.vllm.worker import DaemonOffloadingWorker

    w = DaemonOffloadingWorker(canonical(), 0, 1, pool_path=pools.pool())
    info = pools.info("d1")
    assert [r.success for r in store(w, 1, info)] == [True]  # slot 3 holds block 1
    release, started = threading.Event(), threading.Event()
    assert isinstance(w._copier, BlockCopier)  # the store above made the pool's copier
    memcpy = w._copier._lanes[STORE].memcpy
    real = memcpy.copy

    def blocked(work: Any, is_store: bool) -> None:
        started.set()
        assert release.wait(30)
        real(work, is_store)

    memcpy.copy = blocked  # type: ignore[method-assign, assignment]  # held until released
    from kvoffload.connector.vllm.load_spec import PoolSlotsSpec
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    w.submit_store(2, GPULoadStoreSpec([5], [1, 0], [0, 0]), PoolSlotsSpec([7], info))
    assert started.wait(10)  # a long store is in flight
    assert load(w, 3, info, expedited=True)
    w.wait({3})
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(3, True)]
    release.set()
    w.wait({2})
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(2, True)]
    w.shutdown()
