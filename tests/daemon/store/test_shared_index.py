"""The shared index: what the daemon writes, what an engine's view reads back, in place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kvoffload.connector.index_view import IndexGone, IndexView, SlotGenerations
from kvoffload.connector.reader_record import ReaderRecord
from kvoffload.daemon.store import shared_index as si
from kvoffload.daemon.store.session_file import SessionFile


def _id(gen: int, i: int) -> int:
    return si.ident(gen, _key(i))


@pytest.fixture
def path(index_path: Path) -> Path:
    return index_path


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
    assert view.ready == {_key(1): (3, _id(1, 1)), _key(3): (5, _id(7, 3))}
    assert view.pending == set()
    assert view.declines(_key(1)) and not view.declines(_key(3))
    w.write(3, 1, 0, si.FREE, 0, None)  # evicted
    w.write(6, 2, 0, si.PENDING, 0, _key(1))  # and stored again elsewhere
    view.refresh()
    assert view.ready == {_key(3): (5, _id(7, 3))} and view.pending == {_key(1)}
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
    assert view.ready == {_key(i): (i % 16, _id(i, i)) for i in range(cap + 5 - 16, cap + 5)}
    w.close()


def test_generations_and_supersession(path: Path) -> None:
    w = si.SharedIndexWriter(path, 8, "d1")
    w.write(2, 5, 0, si.READY, 0, _key(1))
    gens = SlotGenerations(path, "d1")
    assert gens.intact(2, _id(5, 1)) and not gens.intact(2, _id(4, 1))
    assert not gens.intact(99, _id(5, 1))
    # The same generation with another key's tag is not the block the engine saw ...
    assert not gens.intact(2, _id(5, 2))
    # ... though a store (its key not claimed yet) checks the generation half only.
    assert gens.intact(2, 5, key_bound=False)
    with pytest.raises(IndexGone):
        IndexView(path, 0, "another-daemon")
    assert si.supersede(path)  # a new daemon takes the pool over
    assert not gens.intact(2, _id(5, 1)) and not path.exists()
    gens.close()
    w.close(remove=False)


def test_generations_of_many_slots_at_once_agree_with_one_by_one(path: Path) -> None:
    import numpy as np

    w = si.SharedIndexWriter(path, 16, "d1")
    for slot in range(16):
        w.write(slot, (slot * 7) % 5 + (1 << 32 if slot == 3 else 0), 0, si.READY, 0, _key(slot))
    gens = SlotGenerations(path, "d1")
    slots = np.array([0, 3, 5, 15, 16, -1, 7, 3], dtype=np.int64)
    gen_of = [0, 1, 0, 0, 0, 0, 3, 2]  # slot 3 wrapped: gen 1
    asked = np.array([si.ident(g, _key(max(0, int(s)))) for s, g in zip(slots, gen_of, strict=True)],
                     dtype=np.uint64)
    want = [gens.intact(int(s), int(g)) for s, g in zip(slots, asked, strict=True)]
    assert want == [True, True, True, True, False, False, False, False]
    assert gens.intact_mask(slots, asked).tolist() == want
    assert si.supersede(path)
    assert not gens.intact_mask(slots, asked).any()  # a superseded index proves nothing
    gens.close()  # no view of the mapping outlives a call
    w.close(remove=False)


def test_shared_memory_per_block_stays_under_72_bytes(path: Path) -> None:
    slots = 100_000
    w = si.SharedIndexWriter(path, slots, "d1")
    # A cache-line entry (64) + a ring entry (4) + the header's share.
    assert os.stat(path).st_size / slots <= 72
    w.close()


def test_session_file_records_round_trip(path: Path) -> None:
    w = si.SharedIndexWriter(path, 8, "d1")
    session = SessionFile(path)
    assert session.path.name.startswith(path.name + ".s-")
    assert session.path.stat().st_mode & 0o777 == 0o600
    record = ReaderRecord(str(session.path))
    assert session.read() == (0, 0, 0) and session.heartbeat_ns() == 0
    record.write(True, 17, 3)
    assert session.read() == (1, 17, 3)
    record.write(False, 20, 4)
    record.stamp()
    assert session.read() == (0, 20, 4) and 0 < session.heartbeat_ns() <= si.now_ns()
    with pytest.raises(IndexGone):
        ReaderRecord(str(session.path), 4)  # one record per file
    other = SessionFile(path)  # every session gets its own file, never a reused record
    assert other.path != session.path and other.read() == (0, 0, 0)
    record.close()
    for f in (session, other):
        f.close()
        assert not f.path.exists()
    w.close()
