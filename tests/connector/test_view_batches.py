"""The view's batched additions against its one-entry-at-a-time loop.

``IndexView._apply_rows`` puts the entries that only make a key READY (``_plain``) into the
table at once and runs the loop over the rest; the loop alone (every entry in order) is what
the view did before. Two views of one index, one of them with nothing plain, are fed the same
random batches of entries -- keys from a small pool, so a batch holds one key in two slots,
moves, commits of PENDING keys, reassignments, removals and other namespaces' entries, over
whatever stale PENDING bookkeeping earlier batches left -- and must hold the same state after
each batch."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from kvoffload.connector.index_view import IndexView
from kvoffload.daemon.store import shared_index as si


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


def _same(fast: IndexView, slow: IndexView, keys: list[bytes], slots: int) -> None:
    for key in keys:
        got = fast.ready.get(key)
        assert got == slow.ready.get(key), key
        if got is not None:
            assert fast.ready.declined(got[0]) == slow.ready.declined(got[0])
    assert len(fast.ready) == len(slow.ready)
    assert [fast.ready.holds(s) for s in range(slots)] == [slow.ready.holds(s)
                                                           for s in range(slots)]
    assert fast.pending == slow.pending
    assert fast._pending_slot == slow._pending_slot
    assert fast._slot_pending == slow._slot_pending
    assert (fast._pmask == slow._pmask).all() and (fast._mine == slow._mine).all()


@pytest.mark.parametrize("seed", range(8))
def test_batched_additions_leave_the_view_as_the_loop_does(index_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    slots = 48
    keys = [_key(i) for i in range(40)]
    w = si.SharedIndexWriter(index_path, slots, "d1")
    fast, slow = IndexView(index_path, 0, "d1"), IndexView(index_path, 0, "d1")
    slow._plain = lambda slots, states, keys, hashes: np.zeros(len(slots), dtype=bool)  # type: ignore[method-assign]
    batched: list[int] = []
    put_many = fast.ready.put_many

    def counted(slots: np.ndarray, hashes: np.ndarray, gens: np.ndarray,
                declined: np.ndarray) -> None:
        batched.append(len(slots))
        put_many(slots, hashes, gens, declined)

    fast.ready.put_many = counted  # type: ignore[method-assign]
    gen = 0
    for _ in range(400):
        batch = sorted(rng.sample(range(slots), rng.randrange(1, slots + 1)))
        # Mostly commits and additions (what the batch takes), the rest anything.
        commit = rng.random() < 0.4
        for s in batch:
            gen += 1
            r = rng.random()
            held = fast._slot_pending.get(s)
            if commit and held is not None and r < 0.8:
                w.write(s, gen, 0, si.READY, 0, held)  # the commit of the slot's PENDING key
            elif r < 0.55:
                flags = si.FLAG_NOT_WORTH if rng.random() < 0.2 else 0
                w.write(s, gen, 0, si.READY, flags, rng.choice(keys))
            elif r < 0.8:
                w.write(s, gen, 0, si.PENDING, 0, rng.choice(keys))
            elif r < 0.9:
                w.write(s, gen, 0, si.FREE, 0, None)
            else:
                w.write(s, gen, 1, si.READY, 0, rng.choice(keys))  # another namespace's
        chosen = np.array(batch, dtype=np.int64)
        fast._apply(chosen)
        slow._apply(chosen)
        _same(fast, slow, keys, slots)
    assert sum(batched) > 2000, "the batch path was hardly taken"
    w.close()
    fast.close()
    slow.close()
