"""Earmarked store grants through the real worker: a store to a slot that still shows the
generation one below its grant's (the daemon has not handed it over yet) is parked -- no lock,
no byte written -- and lands only once the index shows the granted generation; a burnt grant,
a deadline passed and a spec without a stamp are never written.

Real parts: the daemon's ``SharedIndexWriter`` publishes the slot's entries, the pool is a file
in /dev/shm, the worker is ``DaemonOffloadingWorker`` over vLLM's canonical KV caches. Deadlines
are placed by the spec's stamp (30 s ahead, or already past), never by the wall clock.
"""

from __future__ import annotations

import fcntl
import mmap
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.connector.vllm.test_worker import SLOT_BYTES, Pools, canonical
from tests.vllm_harness import vllm_import_error

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]

SLOT = 3
OLD_GEN = 6  # the READY block's generation in slot 3; the grant is OLD_GEN + 1
GRANT = OLD_GEN + 1
OLD = b"\x33" * SLOT_BYTES  # the READY block's bytes
# Block 1 of group 0 (two 1024-byte layer pages, 0x11 and 0x22) at the slot's start; the
# rest of the slot is not this group's and keeps the old bytes.
NEW = b"\x11" * 1024 + b"\x22" * 1024 + OLD[2048:]
LATER = 30.0  # a stamp this far ahead: its deadline is never reached in a test


class Rig:
    """One pool, its index (slot 3 READY at OLD_GEN with OLD bytes) and a worker."""

    def __init__(self, pools: Pools, lock: Path, *, cpu_async: bool = False) -> None:
        from kvoffload.connector.vllm.worker import DaemonOffloadingWorker
        from kvoffload.daemon.store.shared_index import READY

        self.path = pools.pool()
        with open(self.path, "r+b") as f:
            f.seek(SLOT * SLOT_BYTES)
            f.write(OLD)
        self.info = pools.info("d1")
        self.index = pools.writers[-1]
        self.index.write(SLOT, OLD_GEN, 0, READY, 0, b"old-key")
        lock.touch()
        self.lock = str(lock)  # the session's writers' lock file
        kv = canonical()
        kv.tensors[0].tensor[1].fill_(0x11)  # block 1, group 0: layer 0's page
        kv.tensors[1].tensor[1].fill_(0x22)  # and layer 1's
        self.worker = DaemonOffloadingWorker(kv, 0, 1, cpu_async=cpu_async,
                                             pool_path=self.path)

    def submit(self, job: int, stamp: float, slot: int = SLOT, gen: int = GRANT) -> None:
        from kvoffload.connector.vllm.load_spec import PoolSlotsSpec
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        spec = PoolSlotsSpec([slot], self.info, gens=[gen], lock=self.lock, stamp=stamp)
        assert self.worker.submit_store(job, GPULoadStoreSpec([1], [1, 0], [0, 0]), spec)

    def publish(self, gen: int, slot: int = SLOT) -> None:
        """The daemon moves the slot's generation (a handover, a burn)."""
        from kvoffload.daemon.store.shared_index import PENDING

        self.index.write(slot, gen, 0, PENDING, 0, None)

    def slot(self, slot: int = SLOT) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(slot * SLOT_BYTES)
            return f.read(SLOT_BYTES)

    def results(self) -> list[tuple[int, bool, int | None]]:
        return [(r.job_id, r.success, r.transfer_size) for r in self.worker.get_finished()]

    def lock_free(self) -> bool:
        """The daemon's test: nobody holds the writers' lock (LOCK_EX|LOCK_NB succeeds)."""
        fd = os.open(self.lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)  # drops the test's lock with it
        return True


@pytest.fixture
def pools() -> Iterator[Pools]:
    p = Pools()
    yield p
    p.close()


@pytest.fixture
def rig(pools: Pools, tmp_path: Path) -> Iterator[Rig]:
    r = Rig(pools, tmp_path / "session.lock")
    yield r
    r.worker.shutdown()


def test_a_store_not_handed_over_is_parked_until_the_handover(rig: Rig) -> None:
    rig.submit(1, time.monotonic() + LATER)
    w = rig.worker
    assert w.stores_parked == 1 and 1 in w._parked
    for _ in range(3):  # steps go by: nothing reported, nothing written, no lock held
        assert rig.results() == []
        assert rig.slot() == OLD
        assert w.locks.jobs(rig.lock) == 0 and rig.lock_free()
    # A parked job does not hold up others: a plain grant to slot 5 lands meanwhile.
    rig.publish(4, slot=5)
    rig.submit(2, time.monotonic() + LATER, slot=5, gen=4)
    assert rig.results() == [(2, True, 2048)]
    assert rig.slot(5)[:2048] == NEW[:2048] and 1 in w._parked
    rig.publish(GRANT)  # the daemon hands slot 3 over
    assert rig.results() == [(1, True, 2048)]  # get_finished copied it
    assert rig.slot() == NEW
    assert len(w._parked) == 0 and rig.lock_free()  # unparked, the lock dropped
    assert (w.stores_parked, w.stores_handover_timeouts, w.stores_revoked) == (1, 0, 0)


def test_wait_on_a_parked_store_returns_once_another_thread_hands_it_over(rig: Rig) -> None:
    rig.submit(1, time.monotonic() + LATER)
    published = threading.Event()

    def daemon() -> None:
        time.sleep(0.05)
        rig.publish(GRANT)
        published.set()

    t = threading.Thread(target=daemon)
    t.start()
    rig.worker.wait({1})  # polls until the handover (its deadline is 30 s ahead)
    assert published.is_set()  # it returned for the handover, not for the deadline
    t.join(10)
    assert rig.slot() == NEW  # the bytes are in before wait returned
    assert rig.results() == [(1, True, 2048)]
    assert rig.worker.stores_handover_timeouts == 0


def test_a_burnt_grant_is_never_written(rig: Rig) -> None:
    rig.submit(1, time.monotonic() + LATER)
    assert rig.results() == []
    rig.publish(OLD_GEN + 2)  # the daemon gave the grant up: the generation skips GRANT
    assert rig.results() == [(1, True, 0)]  # a 0-byte success: the commit will be refused
    assert rig.slot() == OLD
    assert (rig.worker.stores_parked, rig.worker.stores_handover_timeouts) == (1, 0)


@pytest.mark.parametrize("when", ["at submission", "while parked"])
def test_a_store_past_its_deadline_is_given_up_for_good(
        rig: Rig, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    from kvoffload.connector.vllm import parked, worker
    from kvoffload.daemon.store.shared_index import HANDOVER_WAIT_S

    now = [time.monotonic()]
    clock = type("Clock", (), {"monotonic": staticmethod(lambda: now[0]),
                               "sleep": staticmethod(time.sleep)})
    monkeypatch.setattr(worker, "time", clock)  # the worker's and the parking's clock only
    monkeypatch.setattr(parked, "time", clock)
    stamp = now[0] - HANDOVER_WAIT_S - 1.0 if when == "at submission" else now[0]
    rig.submit(1, stamp)
    if when == "while parked":
        assert rig.results() == [] and rig.worker.stores_parked == 1
        now[0] += HANDOVER_WAIT_S  # exactly the deadline: given up
    else:
        assert rig.worker.stores_parked == 0
    assert rig.results() == [(1, True, 0)]  # dropped by the pre-check, never written
    assert rig.worker.stores_handover_timeouts == 1
    rig.publish(GRANT)  # a late handover (the daemon never does this) writes nothing either
    assert rig.results() == []
    rig.worker.wait({1})
    assert rig.slot() == OLD and rig.worker.stores_handover_timeouts == 1


def test_a_spec_without_a_stamp_is_not_parked(rig: Rig) -> None:
    rig.submit(1, 0.0)  # one below reads as revoked, as before earmarks
    assert rig.results() == [(1, True, 0)]
    assert (rig.worker.stores_parked, rig.worker.stores_handover_timeouts) == (0, 0)
    rig.publish(GRANT)
    assert rig.results() == []
    assert rig.slot() == OLD


def test_shutdown_drops_parked_stores(rig: Rig) -> None:
    rig.submit(1, time.monotonic() + LATER)
    rig.worker.shutdown()
    rig.publish(GRANT)
    assert len(rig.worker._parked) == 0 and rig.slot() == OLD and rig.lock_free()


def _read_old_block(path: str, old: bytes, stop: Any, reads: Any, torn: Any) -> None:
    """Another engine loading the READY block in place: copy it, compare, again."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as pool:
        while not stop.is_set():
            if pool[SLOT * SLOT_BYTES:(SLOT + 1) * SLOT_BYTES] != old:
                torn.value += 1
            reads.value += 1


def test_a_reader_of_the_old_block_sees_only_old_bytes_while_the_store_waits(
        pools: Pools, tmp_path: Path) -> None:
    rig = Rig(pools, tmp_path / "session.lock", cpu_async=True)  # the copy lanes' threads
    ctx = mp.get_context("spawn")
    stop, reads, torn = ctx.Event(), ctx.Value("q", 0), ctx.Value("q", 0)
    child = ctx.Process(target=_read_old_block, args=(rig.path, OLD, stop, reads, torn))
    child.start()
    try:
        give_up = time.monotonic() + 60  # a bound on the test, not a measurement
        while reads.value < 100 and time.monotonic() < give_up:
            time.sleep(0.001)
        assert reads.value >= 100, "the reader never ran"
        rig.submit(1, time.monotonic() + LATER)
        waiter = threading.Thread(target=rig.worker.wait, args=({1},))
        waiter.start()  # the step blocked on a flush of the parked store
        seen = reads.value
        while reads.value < seen + 1000 and time.monotonic() < give_up:
            assert rig.worker.get_finished() == []  # still parked
            time.sleep(0.001)
        assert reads.value >= seen + 1000 and waiter.is_alive()  # reads during the wait
        stop.set()  # the daemon hands over only once no reader can load the old block
        child.join(30)
        assert child.exitcode == 0
        assert (reads.value > 0, torn.value) == (True, 0)  # only old bytes, never torn
        rig.publish(GRANT)
        waiter.join(30)
        assert not waiter.is_alive()
        assert rig.slot() == NEW
        assert rig.results() == [(1, True, 2048)]
    finally:
        stop.set()
        child.join(30)
        rig.worker.shutdown()
