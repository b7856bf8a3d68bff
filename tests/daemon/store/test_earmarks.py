"""Earmarked grants (``daemon/store/earmarks.py``): a full pool reserves READY blocks, evicted
only when claimed; the slot's generation reaches the granted one only after reclamation, and
never once the grant is given up."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, KeyStatus, make_key
from kvoffload.daemon.store import shared_index as si
from kvoffload.daemon.store.index import BlockIndex, SlotState
from kvoffload.daemon.store.pool import Pool

GEOM = Geometry(namespace="t", groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION,
                                                 tokens_per_block=16, bytes_per_block=64),),
                tokens_per_hash=16)
SLOTS = 16
HOLDER = "engine-a"


def key(i: int) -> bytes:
    return make_key(hashlib.sha256(i.to_bytes(8, "big")).digest(), 0)


@pytest.fixture
def index(tmp_path) -> Iterator[BlockIndex]:
    """A full pool of READY blocks 0..15 (key(0) the least recently used), one engine
    reading it in place (no record: it holds what its last report says), earmarks on."""
    idx, pool = _index(tmp_path, SLOTS)
    yield idx
    _close(idx, pool)


def _index(tmp_path, slots: int) -> tuple[BlockIndex, Pool]:
    pool = Pool(str(tmp_path / "pool"), 64 * slots, prefault=False)
    pool.open()
    idx = BlockIndex(pool, "lru")
    idx.share(str(tmp_path / "pool.index"), "d1")  # epochs move: readers can lag
    idx.configure(64)
    idx.earmark_reservations = True
    ns = idx.namespace(GEOM)
    for i in range(slots):
        assert idx.prepare(ns, key(i), 16, False).slot is not None
        assert idx.commit(ns, key(i))
    idx.reclaimer.add_reader(b"reader", idx.epoch)
    return idx, pool


def _close(idx: BlockIndex, pool: Pool) -> None:
    assert idx.shared is not None
    idx.shared.close()
    pool.close(remove=True)


def _shared_gen(tmp_path, slot: int) -> int:
    """The generation a worker reads for ``slot`` in the shared index."""
    from kvoffload.connector.index_map import SlotGenerations

    view = SlotGenerations(str(tmp_path / "pool.index"), "d1")
    try:
        table = view._table()
        gen = int(table["ident"][slot]) & si.GEN_MASK
        del table
        return gen
    finally:
        view.close()


def _ns(idx: BlockIndex):
    return idx.namespace(GEOM)


def _report(idx: BlockIndex) -> None:
    """The reader's view caught up with everything published (its Step was handled)."""
    idx.reclaimer.report(b"reader", idx.epoch)
    idx.reclaim()


def test_a_full_pool_grants_ready_blocks_that_stay_loadable(index: BlockIndex) -> None:
    ns = _ns(index)
    gens = [index.gen[ns.keys[key(i)]] for i in range(3)]
    granted, evicted = index.reserve(HOLDER, 3)
    assert not evicted
    # The policy's next victims, at their generation + 1; their blocks still READY.
    assert granted == [(ns.keys[key(i)], (gens[i] + 1) & si.GEN_MASK) for i in range(3)]
    assert index.count(SlotState.READY) == SLOTS and index.pool.free_slots == 0
    assert all(index.status(ns, key(i)) is KeyStatus.HIT for i in range(3))
    assert all(index.gen[ns.keys[key(i)]] == gens[i] for i in range(3))  # nothing moved


def test_a_claim_evicts_the_block_and_hands_over_only_after_readers(
        index: BlockIndex, tmp_path) -> None:
    ns = _ns(index)
    [(slot, gen)] = index.reserve(HOLDER, 1)[0]
    assert index.claim(ns, key(100), slot, gen, 16, False, HOLDER) is True
    assert index.status(ns, key(0)) is KeyStatus.MISS  # evicted at the claim
    assert index.status(ns, key(100)) is KeyStatus.HIT_PENDING
    assert index.gen[slot] == gen - 1  # not handed over: the reader may still load key(0)
    index.reclaim()
    assert index.gen[slot] == gen - 1 and slot in index.handovers
    assert _shared_gen(tmp_path, slot) == gen - 1  # what the waiting worker reads
    _report(index)
    assert index.gen[slot] == gen and not index.handovers  # the writer's now
    assert _shared_gen(tmp_path, slot) == gen
    assert index.state[slot] == SlotState.PENDING and index.commit(ns, key(100))


def test_without_readers_a_claim_hands_over_at_once(index: BlockIndex) -> None:
    index.reclaimer.remove_reader(b"reader")
    ns = _ns(index)
    [(slot, gen)] = index.reserve(HOLDER, 1)[0]
    assert index.claim(ns, key(100), slot, gen, 16, False, HOLDER) is True
    assert index.gen[slot] == gen and not index.handovers


def test_another_holder_or_generation_is_refused_and_changes_nothing(
        index: BlockIndex) -> None:
    ns = _ns(index)
    [(slot, gen)] = index.reserve(HOLDER, 1)[0]
    assert index.claim(ns, key(100), slot, gen, 16, False, "engine-b") is None
    assert index.claim(ns, key(100), slot, gen - 1, 16, False, HOLDER) is None
    assert index.earmarks[slot] == HOLDER and index.gen[slot] == gen - 1
    assert index.status(ns, key(0)) is KeyStatus.HIT


def test_a_load_of_an_earmarked_block_withdraws_it_and_burns_after_the_load(
        index: BlockIndex, tmp_path) -> None:
    """A pinned block is never evicted: the load keeps it (back in the eviction order, as
    vLLM's LRU keeps what it uses), the holder is told, and its grant is burnt only once the
    load is done (a burn moves the generation, which would fail the load's check)."""
    ns = _ns(index)
    [(slot, gen)] = index.reserve(HOLDER, 1)[0]
    assert index.pin_generation(slot, gen - 1)  # another engine loads key(0) meanwhile
    assert slot not in index.earmarks and slot in index.policy
    assert index.take_withdrawn(HOLDER) == [slot] and index.take_withdrawn(HOLDER) == []
    assert index.gen[slot] == gen - 1  # the load in flight still checks out
    # A claim already on its way is refused and evicts nothing.
    assert index.claim(ns, key(100), slot, gen, 16, False, HOLDER) is None
    assert index.status(ns, key(0)) is KeyStatus.HIT and key(100) not in ns.keys
    index.unpin(slot)
    assert index.gen[slot] == gen + 1  # skips the grant's: its worker writes nothing
    assert _shared_gen(tmp_path, slot) == gen + 1  # published at once
    assert index.status(ns, key(0)) is KeyStatus.HIT


def test_a_touch_withdraws_an_earmark_and_burns_it_at_once(index: BlockIndex) -> None:
    ns = _ns(index)
    (a, gen_a), (b, _) = index.reserve(HOLDER, 2)[0]
    index.touch(a)  # a request reused key(0): most recently used now
    assert index.take_withdrawn(HOLDER) == [a] and index.gen[a] == gen_a + 1
    assert list(index.policy.victims(1, lambda s: True)) == [ns.keys[key(2)]]
    assert b in index.earmarks


def test_a_claim_of_a_withdrawn_earmark_after_its_burn_is_refused(index: BlockIndex) -> None:
    ns = _ns(index)
    [(slot, gen)] = index.reserve(HOLDER, 1)[0]
    index.touch(slot)
    assert index.claim(ns, key(100), slot, gen, 16, False, HOLDER) is None
    assert index.status(ns, key(0)) is KeyStatus.HIT and key(100) not in ns.keys


def test_a_key_stored_meanwhile_burns_the_grant(index: BlockIndex) -> None:
    ns = _ns(index)
    [(slot, gen)] = index.reserve(HOLDER, 1)[0]
    assert index.claim(ns, key(5), slot, gen, 16, False, HOLDER) is None  # not ``exists``
    assert index.gen[slot] == gen + 1 and index.status(ns, key(0)) is KeyStatus.HIT
    assert index.take_withdrawn(HOLDER) == [slot]  # the holder drops it from its reservation


def test_earmarks_handed_back_or_revoked_are_burnt_their_blocks_kept(
        index: BlockIndex) -> None:
    ns = _ns(index)
    (a, gen_a), (b, gen_b) = index.reserve(HOLDER, 2)[0]
    index.unreserve(a)  # a surplus (or so the engine says: its store may still wait for it)
    index.unreserve(b, fence_s=1.0)  # its session ended: vLLM may hold a spec naming it
    assert index.gen[a] == gen_a + 1 and index.gen[b] == gen_b + 1
    assert not index.earmarks and index.status(ns, key(0)) is KeyStatus.HIT
    assert index.status(ns, key(1)) is KeyStatus.HIT and a in index.policy
    assert index.take_withdrawn(HOLDER) == []  # its engine knows: nothing to tell it
    granted = dict(index.reserve("engine-b", SLOTS)[0])  # every block, earmarked again
    assert granted[a] == gen_a + 2 and granted[b] == gen_b + 2  # never a grant given out


def test_a_handed_back_earmark_that_is_loaded_is_burnt_after_the_load(
        index: BlockIndex) -> None:
    [(slot, gen)] = index.reserve(HOLDER, 1)[0]
    index.pins[slot] += 1  # a load of its block in flight (as pin() counts it, earmark kept)
    index.n_pinned += 1
    index.unreserve(slot, fence_s=1.0)
    assert index.gen[slot] == gen - 1  # the load's check still passes
    index.unpin(slot)
    assert index.gen[slot] == gen + 1


def test_an_abort_before_the_handover_burns_and_keeps_the_slot_retired(
        index: BlockIndex) -> None:
    ns = _ns(index)
    cancelled: list[tuple[object, int]] = []
    index.on_cancel.append(lambda holder, slot: cancelled.append((holder, slot)))
    [(slot, gen)] = index.reserve(HOLDER, 1)[0]
    index.claim(ns, key(100), slot, gen, 16, False, HOLDER)
    assert index.abort(ns, key(100), fence_s=1.0)  # its engine went away
    assert cancelled == [(HOLDER, slot)] and key(100) not in ns.keys
    assert index.gen[slot] == gen + 1 and index.state[slot] == SlotState.RETIRED
    assert index.pool.free_slots == 0  # the reader may still load key(0) from it
    _report(index)
    assert index.state[slot] == SlotState.FREE and index.pool.free_slots == 1
    assert index.gen[slot] == gen + 1  # freed as burnt: no later grant lands on ``gen``


class _Clock:
    """``time`` for earmarks.py: ``monotonic()`` is the real clock plus ``ahead``."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    from kvoffload.daemon.store import earmarks

    c = _Clock()
    monkeypatch.setattr(earmarks, "time", c)
    return c


def test_past_its_deadline_a_handover_is_burnt(index: BlockIndex, clock: _Clock) -> None:
    ns = _ns(index)
    (a, gen_a), (b, gen_b) = index.reserve(HOLDER, 2)[0]
    now = time.monotonic()
    index.claim(ns, key(100), a, gen_a, 16, False, HOLDER, stamp=now)
    index.claim(ns, key(101), b, gen_b, 16, False, HOLDER, stamp=now)
    assert index.expire_handovers() == 0
    clock.ahead = 2 * si.HANDOVER_S  # the reader still holds them, past the deadline
    assert index.expire_handovers() == 2  # burnt at once: their workers stop waiting
    assert index.gen[a] == gen_a + 1 and index.gen[b] == gen_b + 1
    assert key(100) not in ns.keys and key(101) not in ns.keys
    _report(index)
    assert index.pool.free_slots == 2


def test_reclaimed_past_the_deadline_is_burnt_not_handed_over(index: BlockIndex,
                                                              clock: _Clock) -> None:
    ns = _ns(index)
    [(slot, gen)] = index.reserve(HOLDER, 1)[0]
    assert index.claim(ns, key(100), slot, gen, 16, False, HOLDER, stamp=time.monotonic())
    clock.ahead = 2 * si.HANDOVER_S
    _report(index)  # reclaim before any expire pass
    assert index.gen[slot] == gen + 1 and index.state[slot] == SlotState.FREE


def test_a_stamp_in_the_future_counts_from_the_claims_arrival(index: BlockIndex) -> None:
    ns = _ns(index)
    [(slot, gen)] = index.reserve(HOLDER, 1)[0]
    index.claim(ns, key(100), slot, gen, 16, False, HOLDER, stamp=time.monotonic() + 3600)
    assert index.handovers[slot].deadline <= time.monotonic() + si.HANDOVER_S


def test_earmarks_are_neither_dropped_nor_reset_and_count_as_reserved(
        index: BlockIndex) -> None:
    ns = _ns(index)
    granted, _ = index.reserve(HOLDER, 3)
    assert not index.drop(ns, key(0))
    assert index.reset(ns) == SLOTS - 3
    assert all(index.status(ns, key(i)) is KeyStatus.HIT for i in range(3))
    assert sorted(index.earmarks) == sorted(s for s, _ in granted)


def test_evict_ahead_counts_earmarks_toward_its_target(tmp_path) -> None:
    from kvoffload.daemon.store.slot_arrays import MIN_FREE

    idx, pool = _index(tmp_path, 128)
    assert idx.free_target == 8
    granted, _ = idx.reserve(HOLDER, 6)
    assert len(granted) == 6 and idx.count(SlotState.READY) == 128
    # 6 earmarked + MIN_FREE emptied: the target of 8 is met with 2 blocks evicted, not 8.
    assert idx.keep_free() == MIN_FREE
    assert idx.count(SlotState.READY) == 128 - MIN_FREE
    _close(idx, pool)


def test_a_claim_arriving_past_its_deadline_is_refused_and_burnt(index: BlockIndex) -> None:
    """A Step that reached the daemon after its stamp's deadline: the engine's workers may
    have given up already, so the slot never goes to it (and the claim leaves no store)."""
    index.reclaimer.remove_reader(b"reader")  # no reader: an accepted claim hands over at once
    ns = _ns(index)
    cancelled: list[tuple[object, int]] = []
    index.on_cancel.append(lambda holder, slot: cancelled.append((holder, slot)))
    [(slot, gen)] = index.reserve(HOLDER, 1)[0]
    late = time.monotonic() - 2 * si.HANDOVER_S
    assert index.claim(ns, key(100), slot, gen, 16, False, HOLDER, stamp=late) is None
    assert index.gen[slot] == gen + 1 and key(100) not in ns.keys and not cancelled
    assert index.status(ns, key(0)) is KeyStatus.HIT
    assert index.take_withdrawn(HOLDER) == [slot]
