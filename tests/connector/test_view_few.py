"""A refresh of a few ring records, entry by entry (``view_few.py``), against the loop.

Two views of one index read the same ring: one applies every refresh entry by entry (its
threshold raised past any batch here), the reference takes the vectorized path with nothing
batched (every entry through ``IndexView._in_order``). The writer makes the random refreshes of
``test_view_pending`` (claims of keys new, pending elsewhere or READY elsewhere, commits,
moves, evictions, other namespaces' entries, one key in two entries), with the real hash and
a weak one; after each the two views must hold the same state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kvoffload.connector.index_view import IndexView
from kvoffload.connector.view_few import ring_records
from kvoffload.daemon.store import shared_index as si

from tests.connector.test_view_pending import _key, _same, _writes, two_views


@pytest.mark.parametrize("weak", (0, 61))
@pytest.mark.parametrize("seed", range(6))
def test_entry_by_entry_refreshes_leave_the_view_as_the_loop_does(
        index_path: Path, seed: int, weak: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng, slots, keys, w, few, ref = two_views(index_path, seed, weak, monkeypatch)
    few.few, ref.few = 10**6, 0
    taken: list[int] = []
    take_few = few._take_few

    def counted(chosen: list[int]) -> int:
        taken.append(len(chosen))
        return take_few(chosen)
    few._take_few = counted  # type: ignore[method-assign,assignment]
    gen = 0
    for _ in range(300):
        for s, ns, state, flags, key in _writes(rng, few, keys, slots):
            gen += 1
            w.write(s, gen, ns, state, flags, key)
        few.refresh()
        ref.refresh()
        assert few.applied == ref.applied == w.head
        _same(few, ref, keys, slots)
    assert len(taken) == 300 and sum(taken) > 3000  # every refresh took the entry path
    w.close()
    few.close()
    ref.close()


def test_a_few_records_take_the_entry_path_and_a_burst_does_not(index_path: Path) -> None:
    w = si.SharedIndexWriter(index_path, 4096, "d1")
    view = IndexView(index_path, 0, "d1")
    calls = {"few": 0, "take": 0}
    take_few, take = view._take_few, view._take

    def few(chosen: list[int]) -> int:
        calls["few"] += 1
        return take_few(chosen)

    def vectorized(chosen: np.ndarray) -> int:
        calls["take"] += 1
        return take(chosen)
    view._take_few, view._take = few, vectorized  # type: ignore[method-assign,assignment]
    for s in range(view.few):
        w.write(s, 1, 0, si.READY, 0, _key(s))
    view.refresh()
    assert calls == {"few": 1, "take": 0} and len(view.ready) == view.few
    for s in range(view.few, 3 * view.few):
        w.write(s, 1, 0, si.READY, 0, _key(s))
    view.refresh()
    assert calls == {"few": 1, "take": 1} and len(view.ready) == 3 * view.few
    w.close()
    view.close()


def test_ring_records_across_the_ring_end(index_path: Path) -> None:
    w = si.SharedIndexWriter(index_path, 64, "d1")
    view = IndexView(index_path, 0, "d1")
    cap = view.ring_capacity
    for i in range(cap + 5):  # the head passes the ring's end
        w.write(i % 64, i + 1, 0, si.READY, 0, _key(i % 64))
    head = w.head
    assert ring_records(view.mm, view.ring_off, cap, head - 10, head) == [
        i % 64 for i in range(cap - 5, cap + 5)]
    w.close()
    view.close()
