"""Epoch-based reclamation in the index: a slot an engine may still act on is never reused."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from kvoffload.connector.reader_record import ReaderRecord
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec
from kvoffload.daemon.store.index import BlockIndex, SlotState
from kvoffload.daemon.store.pool import Pool
from kvoffload.daemon.store.session_file import SessionFile

GEO = Geometry(namespace="t", groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16, 64),),
               tokens_per_hash=16)


@pytest.fixture
def index() -> Iterator[BlockIndex]:
    path = f"/dev/shm/kvoffload-test-reclaim-{uuid.uuid4().hex[:10]}"
    pool = Pool(path, 4 * 64, prefault=False)
    pool.open()
    idx = BlockIndex(pool)
    idx.share(f"{path}.index", "d1")
    idx.configure(64)  # 4 slots
    yield idx
    assert idx.shared is not None
    idx.shared.close()
    pool.close(remove=True)


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


def _fill(idx: BlockIndex, n: int) -> list[int]:
    ns = idx.namespace(GEO)
    slots = []
    for i in range(n):
        got = idx.prepare(ns, _key(i), 16, False)
        assert got.slot is not None
        idx.commit(ns, _key(i))
        slots.append(got.slot)
    return slots


def test_without_readers_a_freed_slot_is_reused_at_once(index: BlockIndex) -> None:
    _fill(index, 4)
    got = index.prepare(index.namespace(GEO), _key(9), 16, False)
    assert got.slot is not None and len(got.evicted) == 1


def test_a_busy_reader_holds_what_it_may_still_see(index: BlockIndex) -> None:
    assert index.shared is not None
    slots = _fill(index, 4)
    session = SessionFile(index.shared.path)
    index.reclaimer.add_reader(b"engine", index.epoch, session)
    record = ReaderRecord(str(session.path))
    record.write(True, index.epoch, 0)
    ns = index.namespace(GEO)
    got = index.prepare(ns, _key(9), 16, False)
    assert got.slot is None and len(got.evicted) == 1  # evicted, but retired: not reusable
    victim = next(s for s in slots if index.state[s] == SlotState.RETIRED)
    gen = index.gen[victim]
    assert index.pin_generation(victim, gen)  # the engine's pin still finds its bytes
    record.write(True, index.epoch, 0)  # it read past the eviction ...
    index.reclaim()
    assert index.state[victim] == SlotState.RETIRED  # ... but its pin holds the slot
    index.unpin(victim)
    assert index.state[victim] == SlotState.FREE
    assert index.prepare(ns, _key(9), 16, False).slot == victim
    assert index.gen[victim] == gen + 1  # a new writer: the old generation no longer checks
    record.close()
    session.close()


def test_an_idle_reader_holds_nothing_but_unhandled_messages_do(index: BlockIndex) -> None:
    assert index.shared is not None
    _fill(index, 4)
    session = SessionFile(index.shared.path)
    index.reclaimer.add_reader(b"engine", index.epoch, session)
    record = ReaderRecord(str(session.path))
    record.write(False, index.epoch, 1)  # between steps, one message still on its way
    ns = index.namespace(GEO)
    assert index.prepare(ns, _key(9), 16, False).slot is None  # its pins may be in it
    index.reclaimer.report(b"engine", 0)  # the daemon handled that message
    index.reclaim()
    assert index.prepare(ns, _key(9), 16, False).slot is not None
    record.close()
    session.close()


def test_a_departed_writers_slots_are_fenced(index: BlockIndex) -> None:
    granted, _ = index.reserve("client", 2)
    assert len(granted) == 2
    for slot, _gen in granted:
        index.unreserve(slot, fence_s=3600)
    assert index.pool.free_slots == 2  # the two fenced slots are not back
    index.reclaim()
    assert index.pool.free_slots == 2


def test_a_reader_stuck_at_an_old_epoch_is_passed_over_after_the_hold_bound(
        index: BlockIndex) -> None:
    """A frozen, stuck or lying reader holds retired slots for ``hold_s`` at most: then they
    are reclaimed (its late loads fail their generation check) and stores go on."""
    import time

    assert index.shared is not None
    index.reclaimer.hold_s = 0.2
    _fill(index, 4)
    session = SessionFile(index.shared.path)
    index.reclaimer.add_reader(b"frozen", index.epoch, session)
    record = ReaderRecord(str(session.path))
    record.write(True, 0, 0)  # busy at epoch 0, forever
    ns = index.namespace(GEO)
    got = index.prepare(ns, _key(9), 16, False)
    assert got.slot is None and len(got.evicted) == 1  # retired: the reader may still see it
    assert index.prepare(ns, _key(9), 16, False).slot is None  # held within the bound
    time.sleep(0.25)
    got = index.prepare(ns, _key(9), 16, False)
    assert got.slot is not None  # past the bound: reclaimed, another writer's now
    assert index.reclaimer.passed_over >= 1
    old = next(s for s in range(4) if index.slot_key[s] == _key(9))
    assert not index.pin_generation(old, index.gen[old] - 1)  # the stuck reader's pin: lost
    record.close()
    session.close()


def test_a_pin_of_a_slot_handed_to_another_writer_is_refused(index: BlockIndex) -> None:
    slots = _fill(index, 4)
    ns = index.namespace(GEO)
    slot = slots[0]
    gen = index.gen[slot]
    assert index.pin_generation(slot, gen)
    index.unpin(slot)
    assert index.drop(ns, _key(0))  # no readers: freed at once ...
    assert index.prepare(ns, _key(7), 16, False).slot == slot  # ... and reused
    assert index.commit(ns, _key(7))  # READY again, another block's
    assert not index.pin_generation(slot, gen)  # the old generation pins nothing
    assert index.pins[slot] == 0
