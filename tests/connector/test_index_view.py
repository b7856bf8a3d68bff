"""An engine's view under a burst of changes in its own namespace: spread over refreshes, never
wrong about what it has applied, never lapped by the ring; and the own stores it answers for
are not settled against a view that lags."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from kvoffload.connector import index_view
from kvoffload.connector.index_view import IndexView
from kvoffload.connector.vllm.own_stores import OwnStores
from kvoffload.daemon.store import shared_index as si

CHUNK = index_view.REFRESH_CHUNK


@pytest.fixture
def path(index_path: Path) -> Path:
    return index_path


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


def _fresh(path: Path) -> dict[bytes, tuple[int, int]]:
    """What a view that reads the whole table now sees (a rescan at attach)."""
    view = IndexView(path, 0, "d1")
    try:
        return dict(view.ready)
    finally:
        view.close()


def test_a_burst_is_applied_a_chunk_at_a_time_in_ring_order(path: Path) -> None:
    n = 5 * CHUNK + 7
    w = si.SharedIndexWriter(path, 4 * n, "d1")
    view = IndexView(path, 0, "d1")
    view.budget_s = 0.0  # one chunk per refresh: the slowest host
    for i in range(n):
        w.write(i, 1, 0, si.READY, 0, _key(i))
    refreshes = 0
    while not (view.applied == w.head and view.caught_up):
        before = view.applied
        assert view.refresh() == min(CHUNK, w.head - before)
        refreshes += 1
        assert not view.caught_up or view.applied == w.head
        # What is applied is exactly the ring's prefix up to the reported epoch: nothing
        # later shows, nothing earlier is missing.
        assert set(view.ready) == {_key(i) for i in range(view.applied)}
    assert refreshes == -(-n // CHUNK)
    assert view.ready == _fresh(path)
    w.close()
    view.close()


def test_a_lagging_view_is_never_lapped_by_the_ring(path: Path) -> None:
    w = si.SharedIndexWriter(path, 16, "d1")  # the ring holds 1024 records
    view = IndexView(path, 0, "d1")
    view.budget_s = 0.0
    cap = w.ring_capacity
    for i in range(cap // 2 + 2 * CHUNK):  # more behind than half a ring (a whole one)
        w.write(i % 16, i + 1, 0, si.READY, 0, _key(i))
    view.refresh()
    assert w.head - view.applied <= cap // 2  # it caught up past what the ring may overwrite
    for i in range(cap // 2):
        w.write(i % 16, cap + i, 0, si.READY, 0, _key(cap + i))
    while not (view.applied == w.head and view.caught_up):
        view.refresh()
    assert view.rescans == 1  # at attach only: it never fell a whole ring behind
    assert view.ready == _fresh(path)
    w.close()
    view.close()


def test_own_committed_stores_are_not_settled_against_a_lagging_view(path: Path) -> None:
    w = si.SharedIndexWriter(path, 4096, "d1")
    view = IndexView(path, 0, "d1")
    view.budget_s = 0.0
    own = OwnStores(Counter())
    mine = _key(10_000)
    own.claimed([mine], [(4000, 3)])
    own.sent(1, [mine])
    for i in range(3 * CHUNK):  # another engine's burst in our namespace ...
        w.write(i, 1, 0, si.READY, 0, _key(i))
    w.write(4000, 3, 0, si.PENDING, 0, mine)  # ... then the daemon applies our claim
    own.answered(1, [], [])  # and its reply is read before the step's refresh
    own.done(mine, True)
    view.refresh()
    assert not view.caught_up and view.slot_of(mine) is None  # our claim not applied yet
    own.settle(view)
    assert own.hit(mine), "our committed store was forgotten against a lagging view"
    while not view.caught_up:
        view.refresh()
    own.settle(view)
    assert own.hit(mine) and view.slot_of(mine) == 4000  # still PENDING in our slot: ours
    w.write(4000, 3, 0, si.READY, 0, mine)
    view.refresh()
    own.settle(view)
    assert mine not in own and mine in view.ready  # READY: the view answers now
    w.close()
    view.close()
