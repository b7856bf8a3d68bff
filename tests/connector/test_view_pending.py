"""The view's batched claims and commits (``view_pending.py``) against its per-entry loop.

``IndexView._apply_rows`` pends at once the PENDING entries that only pend their own key in
their own slot (``_claims``) and unpends at once the commits of the PENDING key a slot holds
(``_commits``, through ``_plain``); the loop alone, every entry in order, is the reference. Two
views of one index, the reference with no batch at all, are fed the same random refreshes --
mostly claims (of keys new, pending in another slot, READY elsewhere, over a slot holding a
READY or another PENDING key), commits, moves, evictions, other namespaces' entries, one key in
two entries -- and must hold the same state after each. With a weak hash (a few values) keys
of different bytes collide as the table sees them, and probe runs grow past
``ReadyTable.absent``'s lockstep rounds."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from kvoffload.connector import ready_table, view_rows
from kvoffload.connector.index_view import IndexView
from kvoffload.daemon.store import shared_index as si

_hash = hash


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


def _loop_only(view: IndexView) -> None:
    def nothing(slots: np.ndarray, *_: object) -> np.ndarray:
        return np.zeros(len(slots), dtype=bool)
    view._plain = nothing  # type: ignore[method-assign,assignment]
    view._claims = nothing  # type: ignore[method-assign,assignment]


def _counting(view: IndexView) -> list[int]:
    """How many entries each ``_claims`` call batched (and, in ``left``, how many of those
    it was offered it did not)."""
    counts: list[int] = []
    left: list[int] = []
    batch = view._claims

    def counted(slots: np.ndarray, keys: list[bytes], hashes: np.ndarray,
                claims: np.ndarray) -> np.ndarray:
        offered = int(claims.sum())
        out = batch(slots, keys, hashes, claims)
        counts.append(int(out.sum()))
        left.append(offered - counts[-1])
        return out
    view._claims = counted  # type: ignore[method-assign]
    view.left = left  # type: ignore[attr-defined]
    return counts


def _same(fast: IndexView, slow: IndexView, keys: list[bytes], slots: int) -> None:
    for key in keys:
        assert fast.ready.get(key) == slow.ready.get(key), key
    assert len(fast.ready) == len(slow.ready)
    assert (fast.ready.holding(np.arange(slots)) == slow.ready.holding(np.arange(slots))).all()
    assert fast.pending == slow.pending
    assert fast._pending_slot == slow._pending_slot
    assert fast._slot_pending == slow._slot_pending
    assert (fast._pmask == slow._pmask).all() and (fast._mine == slow._mine).all()
    # The mask is the slot dict's key set, and the key set the pending dict's.
    assert set(np.flatnonzero(fast._pmask).tolist()) == set(fast._slot_pending)
    assert fast.pending == set(fast._pending_slot)


def _weak(monkeypatch: pytest.MonkeyPatch, values: int, fixed: dict[bytes, int] | None = None,
          ) -> None:
    """Keys hash to ``values`` values (never -1, the tombstone's), or as ``fixed`` says:
    collisions between keys of different bytes, and long probe runs, in the view's table and
    its batches alike."""
    def weak(key: bytes) -> int:
        return fixed[key] if fixed and key in fixed else _hash(key) % values
    monkeypatch.setattr(ready_table, "hash", weak, raising=False)
    monkeypatch.setattr(view_rows, "hash", weak, raising=False)


def _writes(rng: random.Random, fast: IndexView, keys: list[bytes], slots: int,
            ) -> list[tuple[int, int, int, int, bytes | None]]:
    """One refresh's entries (slot, ns, state, flags, key): claims first of all."""
    batch = sorted(rng.sample(range(slots), rng.randrange(1, slots + 1)))
    out: list[tuple[int, int, int, int, bytes | None]] = []
    for s in batch:
        r = rng.random()
        held = fast._slot_pending.get(s)
        if r < 0.5:
            out.append((s, 0, si.PENDING, 0, rng.choice(keys)))  # a claim, of any key
        elif r < 0.62 and held is not None:
            out.append((s, 0, si.READY, 0, held))  # the commit of the slot's PENDING key
        elif r < 0.8:
            flags = si.FLAG_NOT_WORTH if rng.random() < 0.2 else 0
            out.append((s, 0, si.READY, flags, rng.choice(keys)))
        elif r < 0.9:
            out.append((s, 0, si.FREE, 0, None))
        else:
            out.append((s, 1, si.PENDING if r < 0.95 else si.READY, 0, rng.choice(keys)))
    return out


def two_views(index_path: Path, seed: int, weak: int, monkeypatch: pytest.MonkeyPatch,
              ) -> tuple[random.Random, int, list[bytes], si.SharedIndexWriter, IndexView,
                         IndexView]:
    """A writer of 48 slots and two views of it, the second loop-only (the reference); keys
    from a pool of 40 or 120 by ``seed``; a weak hash of ``weak`` values unless 0."""
    if weak:
        _weak(monkeypatch, weak)
    slots = 48
    keys = [_key(i) for i in range(40 if seed % 2 else 120)]
    w = si.SharedIndexWriter(index_path, slots, "d1")
    fast, slow = IndexView(index_path, 0, "d1"), IndexView(index_path, 0, "d1")
    _loop_only(slow)
    return random.Random(seed), slots, keys, w, fast, slow


@pytest.mark.parametrize("weak", (0, 61))
@pytest.mark.parametrize("seed", range(8))
def test_batched_claims_and_commits_leave_the_view_as_the_loop_does(
        index_path: Path, seed: int, weak: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng, slots, keys, w, fast, slow = two_views(index_path, seed, weak, monkeypatch)
    counts = _counting(fast)
    gen = 0
    for _ in range(400):
        writes = _writes(rng, fast, keys, slots)
        for s, ns, state, flags, key in writes:
            gen += 1
            w.write(s, gen, ns, state, flags, key)
        # The slots written (a ring's records), or now and then all (a drain, a rescan).
        every = rng.random() < 0.2
        chosen = np.arange(slots) if every else np.array([e[0] for e in writes])
        fast._apply(chosen)
        slow._apply(chosen)
        _same(fast, slow, keys, slots)
    assert sum(counts) > 200, "the claims batch was hardly taken"
    assert sum(fast.left) > 400, "claims the loop must apply were hardly offered"  # type: ignore[attr-defined]
    w.close()
    fast.close()
    slow.close()


def _edge(index_path: Path, setup: Callable[[si.SharedIndexWriter], None],
          claim: tuple[int, bytes], batched: bool,
          check: Callable[[IndexView], None] | None = None) -> None:
    """``setup``, applied (then ``check`` of the view); then one claim in its own refresh:
    batched or left to the loop as said, and the state the loop's."""
    w = si.SharedIndexWriter(index_path, 16, "d1")
    fast, slow = IndexView(index_path, 0, "d1"), IndexView(index_path, 0, "d1")
    _loop_only(slow)
    setup(w)
    for s in range(16):  # one at a time: the table's buckets in slot order
        fast._apply(np.array([s], dtype=np.int64))
        slow._apply(np.array([s], dtype=np.int64))
    if check is not None:
        check(fast)
    counts = _counting(fast)
    w.write(claim[0], 9, 0, si.PENDING, 0, claim[1])
    fast._apply(np.array([claim[0]], dtype=np.int64))
    slow._apply(np.array([claim[0]], dtype=np.int64))
    assert counts == [int(batched)]
    _same(fast, slow, [_key(i) for i in range(8)], 16)
    assert slow._pending_slot[claim[1]] == claim[0] and slow.ready.get(claim[1]) is None
    w.close()
    fast.close()
    slow.close()


def test_a_claim_in_a_free_slot_of_a_new_key_is_batched(index_path: Path) -> None:
    _edge(index_path, lambda w: w.write(1, 1, 0, si.READY, 0, _key(1)), (2, _key(2)), True)


def test_a_claim_over_a_slot_holding_a_ready_key_is_the_loops(index_path: Path) -> None:
    _edge(index_path, lambda w: w.write(2, 1, 0, si.READY, 0, _key(1)), (2, _key(2)), False)


def test_a_claim_of_a_key_ready_elsewhere_is_the_loops(index_path: Path) -> None:
    _edge(index_path, lambda w: w.write(1, 1, 0, si.READY, 0, _key(2)), (2, _key(2)), False)


def test_a_claim_of_a_key_pending_elsewhere_is_the_loops(index_path: Path) -> None:
    _edge(index_path, lambda w: w.write(1, 1, 0, si.PENDING, 0, _key(2)), (2, _key(2)), False)


def test_a_claim_over_another_pending_key_is_the_loops(index_path: Path) -> None:
    _edge(index_path, lambda w: w.write(2, 1, 0, si.PENDING, 0, _key(1)), (2, _key(2)), False)


def test_a_claim_of_a_key_whose_hash_is_ready_elsewhere_is_the_loops(
        index_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another key's bytes, the claimed key's hash: the table takes them as one key, and the
    loop drops the one READY in slot 1 (``find`` is by hash)."""
    _weak(monkeypatch, 1 << 20, {_key(1): 5, _key(2): 5})
    _edge(index_path, lambda w: w.write(1, 1, 0, si.READY, 0, _key(1)), (2, _key(2)), False)


@pytest.mark.parametrize("held", (False, True))
def test_a_claim_whose_probe_outruns_the_lockstep_rounds_is_the_loops(
        index_path: Path, monkeypatch: pytest.MonkeyPatch, held: bool) -> None:
    """READY keys in buckets 0-4 of 32 (a run of five), the claimed key's home bucket 0 --
    READY itself in the run (``held``: slot 4, bucket 3), or absent, its probe ending at
    bucket 5: either way it runs past ``absent``'s lockstep rounds, which answers False (maybe
    held), and the loop decides."""
    fixed = {_key(i): i - 1 for i in range(1, 6)} | {_key(0): 32}
    _weak(monkeypatch, 1 << 20, fixed)

    def setup(w: si.SharedIndexWriter) -> None:
        for i in range(1, 6):
            w.write(i, 1, 0, si.READY, 0, _key(0 if held and i == 4 else i))

    def check(view: IndexView) -> None:
        assert view.ready._slots[:6].tolist() == [1, 2, 3, 4, 5, -1]  # the run
        assert view.ready.find(_key(0)) == (4 if held else -1)
        assert not view.ready.absent(np.array([32]))  # past its rounds: maybe held
    _edge(index_path, setup, (9, _key(0)), False, check)


def test_a_burst_of_claims_then_commits_through_refresh(index_path: Path) -> None:
    """What the bench measures: 2,000 claims in free slots, then their commits, in budgeted
    refreshes -- every claim batched, and both views alike at every step."""
    slots = 4096
    w = si.SharedIndexWriter(index_path, slots, "d1")
    fast, slow = IndexView(index_path, 0, "d1"), IndexView(index_path, 0, "d1")
    _loop_only(slow)
    counts = _counting(fast)
    fast.budget_s = slow.budget_s = 0.0  # REFRESH_AT_LEAST a step each: the views in step
    keys = [_key(i) for i in range(2000)]
    for state in (si.PENDING, si.READY):
        for i, key in enumerate(keys):
            w.write(i, 2, 0, state, 0, key)
        while not (fast.caught_up and slow.caught_up and fast.applied == w.head):
            fast.refresh()
            slow.refresh()
            _same(fast, slow, keys[::7], slots)
        _same(fast, slow, keys, slots)
    assert sum(counts) == len(keys) and len(fast.ready) == len(keys) and not fast.pending
    w.close()
    fast.close()
    slow.close()
