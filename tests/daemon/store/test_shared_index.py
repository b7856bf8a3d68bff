"""The shared index: what the daemon writes, what an engine's view reads back, in place."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvoffload.connector.index_view import IndexGone, IndexView, SlotGenerations
from kvoffload.connector.session import ReaderRecord
from kvoffload.daemon.store import shared_index as si


@pytest.fixture
def path() -> Iterator[Path]:
    p = Path(f"/dev/shm/kvoffload-test-idx-{uuid.uuid4().hex[:10]}")
    yield p
    for q in (p, si.readers_path_for(p)):
        q.unlink(missing_ok=True)


def _key(i: int, group: int = 0) -> bytes:
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def test_view_follows_writes_of_its_namespace_only(path: Path) -> None:
    w = si.SharedIndexWriter(path, 64, "d1")
    w.write(3, 1, 0, si.PENDING, 0, _key(1))
    w.write(4, 1, 1, si.READY, 0, _key(2))  # another namespace
    view = IndexView(path, 0, "d1")
    assert view.pending == {_key(1)} and view.ready == {}
    assert view.refresh() == 0  # nothing changed: nothing applied
    w.write(3, 1, 0, si.READY, si.FLAG_TAIL | si.FLAG_NOT_WORTH, _key(1))
    w.write(5, 7, 0, si.READY, 0, _key(3))
    assert view.refresh() == 2
    assert view.ready == {_key(1): (3, 1), _key(3): (5, 7)} and view.pending == set()
    assert view.not_worth == {_key(1)}
    w.write(3, 1, 0, si.FREE, 0, None)  # evicted
    w.write(6, 2, 0, si.PENDING, 0, _key(1))  # and stored again elsewhere
    view.refresh()
    assert view.ready == {_key(3): (5, 7)} and view.pending == {_key(1)}
    assert view.slot_of(_key(1)) == 6 and view.applied == w.head
    w.close()


def test_a_reader_a_whole_ring_behind_rescans_the_table(path: Path) -> None:
    w = si.SharedIndexWriter(path, 16, "d1")
    view = IndexView(path, 0, "d1")
    cap = w.ring_capacity
    for i in range(cap + 5):  # more changes than the ring holds
        w.write(i % 16, i, 0, si.READY, 0, _key(i))
    view.refresh()
    assert view.rescans == 2  # at attach, and now
    assert view.ready == {_key(i): (i % 16, i) for i in range(cap + 5 - 16, cap + 5)}
    w.close()


def test_generations_and_supersession(path: Path) -> None:
    w = si.SharedIndexWriter(path, 8, "d1")
    w.write(2, 5, 0, si.READY, 0, _key(1))
    gens = SlotGenerations(path, "d1")
    assert gens.intact(2, 5) and not gens.intact(2, 4) and not gens.intact(99, 5)
    with pytest.raises(IndexGone):
        IndexView(path, 0, "another-daemon")
    assert si.supersede(path)  # a new daemon takes the pool over
    assert not gens.intact(2, 5) and not path.exists()
    gens.close()
    w.close(remove=False)


def test_generations_of_many_slots_at_once_agree_with_one_by_one(path: Path) -> None:
    import numpy as np

    w = si.SharedIndexWriter(path, 16, "d1")
    for slot in range(16):
        w.write(slot, (slot * 7) % 5 + (1 << 32 if slot == 3 else 0), 0, si.READY, 0, _key(slot))
    gens = SlotGenerations(path, "d1")
    slots = np.array([0, 3, 5, 15, 16, -1, 7, 3], dtype=np.int64)
    asked = np.array([0, 1, 0, 0, 0, 0, 3, 2], dtype=np.int64)  # slot 3 wrapped: gen 1
    want = [gens.intact(int(s), int(g)) for s, g in zip(slots, asked, strict=True)]
    assert want == [True, True, True, True, False, False, False, False]
    assert gens.intact_mask(slots, asked).tolist() == want
    assert si.supersede(path)
    assert not gens.intact_mask(slots, asked).any()  # a superseded index proves nothing
    gens.close()  # no view of the mapping outlives a call
    w.close(remove=False)


def test_shared_memory_per_block_stays_under_64_bytes(path: Path) -> None:
    slots = 100_000
    w = si.SharedIndexWriter(path, slots, "d1")
    assert os.stat(path).st_size / slots <= 64  # table entry + ring entry + header share
    w.close()


def test_reader_records_round_trip(path: Path) -> None:
    w = si.SharedIndexWriter(path, 8, "d1", max_readers=4)
    record = ReaderRecord(str(w.readers_path), 2)
    record.write(True, 17, 3)
    assert w.read_reader(2) == (1, 17, 3) and w.read_reader(1) == (0, 0, 0)
    record.write(False, 20, 4)
    assert w.read_reader(2) == (0, 20, 4)
    with pytest.raises(IndexGone):
        ReaderRecord(str(w.readers_path), 4)
    record.close()
    w.close()
