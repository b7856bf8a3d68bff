"""The index alone: state transitions, pins, futures, eviction, and bytes per stored block."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import tracemalloc

import pytest
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, KeyStatus, make_key
from kvoffload.daemon.store.eviction import ARCPolicy
from kvoffload.daemon.store.index import BlockIndex, SlotState
from kvoffload.daemon.store.pool import Pool, PoolInUse

GEOM = Geometry(namespace="t", groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION,
                                                 tokens_per_block=16, bytes_per_block=64),),
                tokens_per_hash=16)


def key(i: int) -> bytes:
    return make_key(hashlib.sha256(i.to_bytes(8, "big")).digest(), 0)


@pytest.fixture
def index(tmp_path):
    pool = Pool(str(tmp_path / "pool"), 64 * 4, prefault=False)
    pool.open()
    idx = BlockIndex(pool, "lru")
    idx.configure(64)
    yield idx
    pool.close(remove=True)


def test_states_and_eviction_order(index: BlockIndex) -> None:
    ns = index.namespace(GEOM)
    for i in range(4):
        assert index.prepare(ns, key(i), 16, False).slot is not None
        assert index.status(ns, key(i)) is KeyStatus.HIT_PENDING
        assert index.commit(ns, key(i))
    assert index.count(SlotState.READY) == 4 and index.pool.free_slots == 0
    index.touch(ns.keys[key(0)])  # 1 is now the least recently used
    index.pin(ns.keys[key(1)])  # ... but pinned: 2 goes first
    got = index.prepare(ns, key(9), 16, False)
    assert [k for _, k, _ in got.evicted] == [key(2)]
    assert index.status(ns, key(2)) is KeyStatus.MISS
    assert index.status(ns, key(1)) is KeyStatus.HIT


def test_no_room_when_all_pending_or_pinned(index: BlockIndex) -> None:
    ns = index.namespace(GEOM)
    for i in range(4):
        index.prepare(ns, key(i), 16, False)
    got = index.prepare(ns, key(5), 16, False)
    assert got.slot is None and not got.exists
    assert index.prepare(ns, key(0), 16, False).exists


async def test_futures_resolve_on_commit_and_abort(index: BlockIndex) -> None:
    ns = index.namespace(GEOM)
    index.prepare(ns, key(1), 16, False)
    index.prepare(ns, key(2), 16, False)
    f1, f2 = index.wait(ns, key(1)), index.wait(ns, key(2))
    assert f1 is not None and f2 is not None and not f1.done()
    index.commit(ns, key(1))
    index.abort(ns, key(2))
    assert await asyncio.wait_for(f1, 1) is True
    assert await asyncio.wait_for(f2, 1) is False
    assert index.wait(ns, key(1)) is None  # ready keys need no future
    assert index.pool.free_slots == 3  # the aborted slot is reusable


def test_namespaces_do_not_share_blocks(index: BlockIndex) -> None:
    a = index.namespace(GEOM)
    b = index.namespace(Geometry(namespace="other", groups=GEOM.groups, tokens_per_hash=16))
    index.prepare(a, key(1), 16, False)
    index.commit(a, key(1))
    assert index.status(b, key(1)) is KeyStatus.MISS
    with pytest.raises(ValueError, match="another geometry"):
        index.namespace(Geometry(namespace="t", groups=GEOM.groups, tokens_per_hash=8))


def test_second_pool_on_same_path_is_refused(tmp_path) -> None:
    first = Pool(str(tmp_path / "p"), 4096, prefault=True)
    first.open()
    with pytest.raises(PoolInUse):
        Pool(str(tmp_path / "p"), 4096).open()
    first.close(remove=True)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_index_metadata_under_256_bytes_per_block(tmp_path, policy: str) -> None:
    n = 100_000
    pool = Pool(str(tmp_path / "pool"), 64 * n, prefault=False)
    pool.open()
    idx = BlockIndex(pool, policy)
    keys = [key(i) for i in range(n)]  # as they arrive from the wire, before the index
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx.configure(64)
    ns = idx.namespace(GEOM)
    for k in keys:
        idx.prepare(ns, k, 16, False)
        idx.commit(ns, k)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    # The keys' own bytes objects are kept alive by the index: count them too.
    per_block = (used + sum(len(k) + 33 for k in keys)) / n
    assert idx.count(SlotState.READY) == n
    assert per_block <= 256, f"{per_block:.0f} bytes per block"
    pool.close(remove=True)


def _store(idx: BlockIndex, ns, k: bytes) -> int:
    slot = idx.prepare(ns, k, 16, False).slot
    assert slot is not None and idx.commit(ns, k)
    return slot


@pytest.mark.parametrize(("policy", "hot_survive"), [("lru", False), ("arc", True)])
def test_a_scan_through_the_index_keeps_blocks_used_again_only_under_arc(
        tmp_path, policy: str, hot_survive: bool) -> None:
    # The index hands the policy slot numbers, which the next block reuses at once: ARC must
    # still tell a new block from a returning one, or every insert into a full pool looks like
    # a ghost hit and the scan flushes the blocks used twice (as LRU does).
    pool = Pool(str(tmp_path / "pool"), 64 * 4, prefault=False)
    pool.open()
    idx = BlockIndex(pool, policy)
    idx.configure(64)
    ns = idx.namespace(GEOM)
    hot = [key(1000), key(1001)]
    for k in hot:
        idx.touch(_store(idx, ns, k))
    for i in range(20):
        _store(idx, ns, key(i))
    assert [k in ns.keys for k in hot] == [hot_survive, hot_survive]
    assert idx.count(SlotState.READY) == 4
    pool.close(remove=True)


def test_arc_ghosts_remember_the_block_not_its_slot(tmp_path) -> None:
    pool = Pool(str(tmp_path / "pool"), 64 * 4, prefault=False)
    pool.open()
    idx = BlockIndex(pool, "arc")
    idx.configure(64)
    arc = idx.policy
    assert isinstance(arc, ARCPolicy)
    ns = idx.namespace(GEOM)
    for k in (key(100), key(101)):
        idx.touch(_store(idx, ns, k))  # T2: used twice
    slot_a = _store(idx, ns, key(1))
    _store(idx, ns, key(2))
    # Full: c evicts a (T1's oldest) and lands in a's slot, yet c is new: no ghost hit.
    slot_c = _store(idx, ns, key(3))
    assert key(1) not in ns.keys and slot_c == slot_a
    assert not arc.is_frequent(slot_c) and arc.target_t1 == 0
    # a comes back (into b's slot): a ghost hit, so T1 deserved more room.
    slot_a2 = _store(idx, ns, key(1))
    assert key(2) not in ns.keys and slot_a2 != slot_a
    assert arc.is_frequent(slot_a2) and arc.target_t1 == 1
    pool.close(remove=True)


def _readers_index(tmp_path, slots: int) -> tuple[Pool, BlockIndex]:
    pool = Pool(str(tmp_path / "pool"), 64 * slots, prefault=False)
    pool.open()
    idx = BlockIndex(pool, "lru")
    idx.configure(64)
    idx.reclaimer.add_reader(b"engine", idx.epoch)  # an engine reads the index in place
    return pool, idx


def test_evict_ahead_counts_engines_reservations_as_empty_slots(tmp_path) -> None:
    """Issue 24: slots an engine holds reserved are empty too; evicting ahead on top of them
    left the pool holding fewer blocks than vLLM's own manager in the same memory."""
    pool, idx = _readers_index(tmp_path, 128)
    assert idx.free_target == 8
    ns = idx.namespace(GEOM)
    for i in range(118):
        _store(idx, ns, key(i))
    granted, evicted = idx.reserve("engine", 6)
    assert len(granted) == 6 and not evicted and pool.free_slots == 4
    assert idx.keep_free() == 0  # 4 free + 6 reserved: the target of 8 is met
    assert idx.count(SlotState.READY) == 118
    pool.close(remove=True)


def test_evict_ahead_keeps_min_free_slots_free_whatever_is_reserved(tmp_path) -> None:
    """However many slots engines hold reserved, MIN_FREE stay free or retiring: a client
    without a reservation (or a refill while a reader is stuck) still finds one."""
    from kvoffload.daemon.store.slot_arrays import MIN_FREE

    pool, idx = _readers_index(tmp_path, 128)
    ns = idx.namespace(GEOM)
    for i in range(118):
        _store(idx, ns, key(i))
    granted, _ = idx.reserve("engine", 10)  # the 10 free slots, all of them
    assert len(granted) == 10 and pool.free_slots == 0
    assert idx.keep_free() == MIN_FREE  # evicted (retiring: a reader may see them)
    assert pool.free_slots + idx.reclaimer.backlog == MIN_FREE
    assert idx.count(SlotState.READY) == 118 - MIN_FREE
    pool.close(remove=True)


def test_with_a_tier_below_evict_ahead_keeps_slots_free_for_promotions(tmp_path) -> None:
    """A tier's promotions need free slots, not an engine's reservation (issue 25's
    below-memory run starved when reservations counted)."""
    from kvoffload.daemon.ops.metrics import DaemonMetrics
    from kvoffload.daemon.tiers.promote import Promoter

    pool, idx = _readers_index(tmp_path, 128)
    Promoter(idx, [], DaemonMetrics())
    assert idx.has_tiers
    ns = idx.namespace(GEOM)
    for i in range(118):
        _store(idx, ns, key(i))
    idx.reserve("engine", 6)
    assert idx.keep_free() == 4  # 4 free + 4 retiring: the target of 8, reservation aside
    assert idx.count(SlotState.READY) == 114
    pool.close(remove=True)
