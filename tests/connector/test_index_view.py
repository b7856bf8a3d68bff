"""An engine's view under bursts in its own namespace, against the shared index's true state.

A budgeted refresh applies every change to what the view holds at once -- removals,
reassignments, moves out of a slot, flag changes -- and lets only additions of keys wait: after
any refresh the view never answers a READY key the index no longer has in that slot at that
generation, every slot not waiting is exactly as the index had it at the head the refresh read,
and what waited arrives. Checked against a model of the index after each refresh (in process)
and under a writer in another process; own stores are not settled against a slot that waits."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from kvoffload.connector import index_view
from kvoffload.connector.index_view import IndexView
from kvoffload.connector.vllm.own_stores import OwnStores
from kvoffload.daemon.store import shared_index as si

CHUNK = index_view.REFRESH_CHUNK
LEAST = index_view.REFRESH_AT_LEAST  # additions applied per refresh whatever the budget
Write = tuple[int, int, int, int, int]  # slot, state, namespace, flags, key id (-1: none)


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


def _script(seed: int, slots: int, n: int) -> list[Write]:
    """``n`` index writes a daemon could make: one slot per key, a new generation per write
    (its ring position + 1); additions, commits, removals, reassignments, moves (either order),
    flag changes, another namespace's entries."""
    rng = random.Random(seed)
    at: dict[int, tuple[int, int, int]] = {}  # slot -> (state, ns, key id)
    where: dict[int, int] = {}  # key id of ours -> slot
    out: list[Write] = []
    fresh = iter(range(10**9))

    def write(s: int, state: int, ns: int = 0, flags: int = 0, key: int = -1) -> None:
        old = at.pop(s, None)
        if old is not None and old[1] == 0:
            where.pop(old[2], None)
        if state != si.FREE:
            at[s] = (state, ns, key)
            if ns == 0:
                where[key] = s
        out.append((s, state, ns, flags, key))

    while len(out) < n:
        s, r = rng.randrange(slots), rng.random()
        cur = at.get(s)
        if cur is None:
            write(s, si.READY if r < 0.5 else si.PENDING, 0, 0, next(fresh)) if r < 0.9 \
                else write(s, si.READY, 1, 0, next(fresh))
            continue
        state, ns, k = cur
        free = [t for t in range(slots) if t not in at]
        if ns == 1 or r < 0.25:
            write(s, si.FREE)  # removal (eviction, abort, reset)
        elif state == si.PENDING and r < 0.6:
            write(s, si.READY, 0, 0, k)  # the commit
        elif r < 0.45:
            write(s, rng.choice((si.READY, si.PENDING)), 0, 0, next(fresh))  # reassigned
        elif r < 0.7 and state == si.READY and free:
            t = rng.choice(free)  # the key moves to another slot, published in either order
            if rng.random() < 0.5:
                write(s, si.FREE)
                write(t, si.READY, 0, 0, k)
            else:
                at.pop(s)
                write(t, si.READY, 0, 0, k)
                out.append((s, si.FREE, 0, 0, -1))
        else:
            write(s, state, 0, si.FLAG_NOT_WORTH if r < 0.85 else 0, k)  # flags only
    return out[:n]


class _Truth:
    """The index as of a ring position, replayed from the script."""

    def __init__(self, script: list[Write], slots: int) -> None:
        self.script, self.pos = script, 0
        self.at: dict[int, tuple[int, int, int, int, int]] = {}  # slot -> state, ns, flags, key, gen
        self.last = [-1] * slots  # the latest write to each slot before ``pos``

    def advance(self, head: int) -> None:
        for p in range(self.pos, head):
            s, state, ns, flags, key = self.script[p]
            self.at[s] = (state, ns, flags, key, p + 1)
            self.last[s] = p
        self.pos = max(self.pos, head)


def _play(w: si.SharedIndexWriter, script: list[Write], lo: int, hi: int) -> None:
    for p in range(lo, hi):
        s, state, ns, flags, key = script[p]
        w.write(s, p + 1, ns, state, flags, _key(key) if key >= 0 else None)


def _check_exact(view: IndexView, truth: _Truth, keys: int) -> None:
    """After a refresh that read ``truth.pos`` with nobody writing."""
    for k in range(keys):
        key = _key(k)
        got = view.ready.get(key)
        if got is not None:  # never a READY answer the index does not hold, as it is
            slot, ident = got
            state, ns, _, held, gen = truth.at.get(slot, (si.FREE, 0, 0, -1, 0))
            assert (state, ns, held, ident) == (si.READY, 0, k, si.ident(gen, key)), (k, slot)
    for slot, (state, ns, flags, k, gen) in truth.at.items():
        if view.lags(slot) or ns != 0 or state == si.FREE:
            continue
        key = _key(k)  # a slot that does not wait is exactly the index's
        if state == si.READY:
            got = view.ready.get(key)
            if got is not None and got[0] != slot:
                # A move published new slot first: the index holds the key READY in both
                # until the old one's removal comes, and the view answers one of them.
                assert truth.at[got[0]][:4:3] == (si.READY, k), (slot, k)
                continue
            assert got == (slot, si.ident(gen, key)), (slot, k)
            assert view.ready.declined(slot) == bool(flags & si.FLAG_NOT_WORTH)
        else:
            assert key in view.pending and view.slot_of(key) == slot, (slot, k)
    for slot in range(view.num_slots):
        if not view.lags(slot) and truth.at.get(slot, (si.FREE,))[0] == si.FREE:
            assert not view.ready.holds(slot)
    # The PENDING bookkeeping agrees with itself: the refresh's split reads the slot mask.
    assert set(view._pmask.nonzero()[0].tolist()) == set(view._slot_pending)
    assert view.pending == set(view._pending_slot)


@pytest.mark.parametrize("seed", range(4))
def test_after_every_budgeted_refresh_nothing_held_is_stale(path: Path, seed: int,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.setattr(index_view, "REFRESH_CHUNK", 4)  # a burst is many chunks of 64 slots:
    monkeypatch.setattr(index_view, "REFRESH_AT_LEAST", 4)  # additions wait past 4 a refresh
    slots, n = 64, 6000
    script = _script(seed, slots, n)
    w = si.SharedIndexWriter(path, slots, "d1")
    view = IndexView(path, 0, "d1")
    view.budget_s = 0.0  # one chunk of additions per refresh: they wait as long as they can
    truth = _Truth(script, slots)
    rng = random.Random(seed)
    pos, lagged = 0, 0
    while pos < n:
        step = min(n - pos, rng.choice((1, 7, 40, 192, 500)))
        _play(w, script, pos, pos + step)
        pos += step
        view.refresh()
        assert view.applied == view.seen == w.head  # the epoch is the head: nothing held lags
        truth.advance(w.head)
        lagged += not view.caught_up
        _check_exact(view, truth, n)
    assert lagged, "additions never waited: the budget was not exercised"
    while not view.caught_up:
        view.refresh()
    _check_exact(view, truth, n)
    assert not any(view.lags(s) for s in range(slots))
    assert view.ready == _fresh(path) and view.rescans == 1
    w.close()
    view.close()


def test_additions_wait_a_chunk_at_a_time_and_arrive(path: Path) -> None:
    n = 5 * LEAST + 7
    w = si.SharedIndexWriter(path, 4 * n, "d1")
    view = IndexView(path, 0, "d1")
    view.budget_s = 0.0  # the least per refresh: the slowest host
    for i in range(n):
        w.write(i, 1, 0, si.READY, 0, _key(i))
    refreshes = 0
    while not refreshes or not view.caught_up:
        view.refresh()
        refreshes += 1
        assert view.applied == w.head
        assert len(view.ready) == min(n, refreshes * LEAST)
        assert set(view.ready) <= {_key(i) for i in range(n)}
    assert refreshes == -(-n // LEAST)
    assert view.ready == _fresh(path)
    w.close()
    view.close()


def test_a_burst_of_removals_is_applied_at_once_and_its_tombstones_purged(path: Path) -> None:
    n = 20 * CHUNK
    w = si.SharedIndexWriter(path, n, "d1")
    for i in range(n):
        w.write(i, 1, 0, si.READY, 0, _key(i))
    view = IndexView(path, 0, "d1")
    view.budget_s = 0.0
    assert len(view.ready) == n
    for i in range(0, n, 2):
        w.write(i, 2, 0, si.FREE, 0, None)  # evicted
    for i in range(1, n, 4):
        w.write(i, 3, 0, si.READY, 0, _key(n + i))  # reassigned to another key
    view.refresh()
    assert view.caught_up  # nothing added a key to an empty slot: nothing waited
    assert all(view.ready.get(_key(i)) is None for i in range(0, n, 2))
    assert all(view.ready.get(_key(i)) is None for i in range(1, n, 4))
    assert all(view.ready.get(_key(n + i)) == (i, si.ident(3, _key(n + i)))
               for i in range(1, n, 4))
    while view.ready.tombs:
        view.refresh()  # no change, but tombstones owed: emptied a few per step
    assert view.ready == _fresh(path)
    w.close()
    view.close()


WRITER = """
import sys, time
sys.path.insert(0, sys.argv[4])
from tests.connector.test_index_view import _script, _play
from kvoffload.daemon.store import shared_index as si
path, seed, slots = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
script = _script(seed, slots, 20000)
w = si.SharedIndexWriter(path, slots, "d1")
print("ready", flush=True)
sys.stdin.readline()
for lo in range(0, len(script), 50):
    _play(w, script, lo, min(len(script), lo + 50))
    time.sleep(0.0005)
print("done", flush=True)
sys.stdin.readline()  # no close() before we check: that marks the index superseded
"""


def test_no_stale_ready_answer_under_a_writer_in_another_process(
        path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_view, "REFRESH_CHUNK", 4)
    monkeypatch.setattr(index_view, "REFRESH_AT_LEAST", 4)  # additions wait past 4 a refresh
    slots, seed = 128, 11
    script = _script(seed, slots, 20000)
    root = str(Path(__file__).resolve().parents[2])
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(seed), str(slots),
                               root], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert writer.stdin is not None and writer.stdout is not None
    try:
        assert writer.stdout.readline().strip() == "ready"
        view = IndexView(path, 0, "d1")
        view.budget_s = 0.0
        truth = _Truth(script, slots)
        writer.stdin.write("go\n")
        writer.stdin.flush()
        checks = 0
        while writer.poll() is None and truth.pos < len(script):
            view.refresh()
            truth.advance(view.seen)
            checks += 1
            for slot in range(slots):  # a READY answer at or after the slot's last write
                # before the head read (the view may be ahead of it, never behind)
                state, ns, _, k, _ = truth.at.get(slot, (si.FREE, 0, 0, -1, 0))
                for key_id in {k, *(script[p][4] for p in range(max(0, truth.last[slot] - 8),
                                                                truth.last[slot]))}:
                    got = view.ready.get(_key(key_id)) if key_id >= 0 else None
                    if got is None or got[0] != slot:
                        continue
                    p = (got[1] & si.GEN_MASK) - 1
                    assert p >= truth.last[slot], ("stale READY", slot, key_id, p)
                    assert script[p][:3] == (slot, si.READY, 0) and script[p][4] == key_id
        assert writer.stdout.readline().strip() == "done"
        truth.advance(len(script))
        while not view.caught_up or view.applied != len(script):
            view.refresh()
        _check_exact(view, truth, len(script))
        assert checks > 10
        view.close()
    finally:
        writer.stdin.write("end\n")
        writer.stdin.flush()
        writer.wait(10)


def _own_claim_in_flight(path: Path) -> tuple[si.SharedIndexWriter, IndexView, OwnStores, bytes]:
    """A view with no budget beyond its floor, and one own store claimed in slot 4000 (gen 3)
    whose claim went out in Step 1."""
    w = si.SharedIndexWriter(path, 4096, "d1")
    view = IndexView(path, 0, "d1")
    view.budget_s = 0.0
    own = OwnStores(Counter())
    mine = _key(10_000)
    own.claimed([mine], [(4000, 3)])
    own.sent(1, [mine])
    return w, view, own, mine


def test_own_committed_stores_are_not_settled_against_a_slot_that_waits(path: Path) -> None:
    w, view, own, mine = _own_claim_in_flight(path)
    for i in range(3 * LEAST):  # another engine's burst in our namespace ...
        w.write(i, 1, 0, si.READY, 0, _key(i))
    w.write(4000, 3, 0, si.PENDING, 0, mine)  # ... then the daemon applies our claim
    own.answered(1, [], [])  # and its reply is read before the step's refresh
    own.done(mine, True)
    view.refresh()
    assert view.lags(4000) and view.slot_of(mine) is None  # our claim waits
    own.settle(view)
    assert own.hit(mine), "our committed store was forgotten against a lagging view"
    while not view.caught_up:
        view.refresh()
    own.settle(view)
    assert own.hit(mine) and view.slot_of(mine) == 4000  # still PENDING in our slot: ours
    for i in range(3 * LEAST):  # another burst waits; our slot's eviction does not
        w.write(1000 + i, 1, 0, si.READY, 0, _key(1000 + i))
    w.write(4000, 4, 0, si.FREE, 0, None)
    view.refresh()
    assert not view.caught_up and not view.lags(4000)
    own.settle(view)
    assert mine not in own  # gone from the index: forgotten now, vLLM stores it again
    w.close()
    view.close()


def test_a_commit_over_a_pending_key_may_wait_but_settles_once_ready(path: Path) -> None:
    w, view, own, mine = _own_claim_in_flight(path)
    w.write(4000, 3, 0, si.PENDING, 0, mine)
    own.answered(1, [], [])
    own.done(mine, True)
    view.refresh()
    assert view.slot_of(mine) == 4000 and mine in view.pending
    for i in range(3 * LEAST):
        w.write(i, 1, 0, si.READY, 0, _key(i))
    w.write(4000, 3, 0, si.READY, 0, mine)  # the commit: only adds a READY key
    view.refresh()
    own.settle(view)
    assert own.hit(mine) or mine in view.ready  # ours or the view's: never lost
    while not view.caught_up:
        view.refresh()
        own.settle(view)
        assert own.hit(mine) or mine in view.ready
    assert mine in view.ready and mine not in own
    w.close()
    view.close()


def test_a_lagging_view_is_never_lapped_by_the_ring(path: Path) -> None:
    w = si.SharedIndexWriter(path, 16, "d1")  # the ring holds 1024 records
    view = IndexView(path, 0, "d1")
    view.budget_s = 0.0
    cap = w.ring_capacity
    for i in range(cap // 2 + 100):  # more behind than half a ring
        w.write(i % 16, i + 1, 0, si.READY, 0, _key(i))
    view.refresh()
    assert view.applied == w.head  # every record read: the backlog holds slots, not records
    for i in range(cap - 1):
        w.write(i % 16, cap + i, 0, si.READY, 0, _key(cap + i))
    while not (view.applied == w.head and view.caught_up):
        view.refresh()
    assert view.rescans == 1  # at attach only: it never fell a whole ring behind
    assert view.ready == _fresh(path)
    w.close()
    view.close()
