"""The view's READY table against a plain dict model: every find answers what the model does
after any sequence of puts, moves and drops (a tiny table, so probe runs wrap and backward
shifts cross the end), and a key costs no Python object."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest
from kvoffload.connector import ready_table
from kvoffload.connector.ready_table import ReadyTable
from kvoffload.daemon.store import shared_index as si


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


class _Model:
    """What the table must answer: key -> slot, one slot per key, one key per slot."""

    def __init__(self) -> None:
        self.slot_key: dict[int, bytes] = {}
        self.key_slot: dict[bytes, int] = {}

    def put(self, slot: int, key: bytes) -> None:
        self.drop(slot)
        moved = self.key_slot.pop(key, None)
        if moved is not None:
            del self.slot_key[moved]
        self.slot_key[slot], self.key_slot[key] = key, slot

    def drop(self, slot: int) -> None:
        key = self.slot_key.pop(slot, None)
        if key is not None:
            del self.key_slot[key]


@pytest.mark.parametrize("seed", range(6))
def test_finds_match_a_dict_after_random_puts_moves_and_drops(seed: int) -> None:
    rng = random.Random(seed)
    slots = 12  # 32 buckets: runs wrap around the end of the table
    model = _Model()
    table = ReadyTable(slots, model.slot_key.get)
    keys = [_key(i) for i in range(40)]
    for _ in range(3000):
        slot, key = rng.randrange(slots), rng.choice(keys)
        if rng.random() < 0.6:
            gen = rng.randrange(1 << 32)
            table.put(slot, key, gen, declined=rng.random() < 0.1)
            model.put(slot, key)
            assert table.get(key) == (slot, si.ident(gen, key))
        else:
            table.drop(slot)
            model.drop(slot)
        assert len(table) == len(model.key_slot)
        for k in keys:
            assert table.find(k) == model.key_slot.get(k, -1)
        for s in range(slots):
            assert table.holds(s) == (s in model.slot_key)
    assert dict(table) == {k: table[k] for k in model.key_slot}


def test_a_probe_run_across_the_tables_end_shifts_back_whole() -> None:
    """Keys whose home is the last bucket fill it and wrap to the first ones; dropping them in
    any order keeps the rest reachable (the backward shift across the end)."""
    slots = 8
    table = ReadyTable(slots, lambda slot: None)
    mask = table._mask
    last = [k for k in (_key(i) for i in range(20_000)) if hash(k) & mask == mask][:3]
    near = [k for k in (_key(i) for i in range(20_000, 40_000)) if hash(k) & mask == 0][:2]
    run = last + near  # buckets mask, 0, 1 (homes: mask) then 2, 3 (homes: 0)
    for order in ([0, 1, 2, 3, 4], [1, 3, 0, 4, 2], [4, 2, 0, 3, 1]):
        for slot, key in enumerate(run):
            table.put(slot, key, slot, declined=False)
        alive = set(range(len(run)))
        for gone in order:
            table.drop(gone)
            alive.discard(gone)
            assert [table.find(k) for k in run] == [s if s in alive else -1
                                                    for s in range(len(run))]
        assert len(table) == 0


def test_a_key_moved_to_another_slot_leaves_the_first() -> None:
    table = ReadyTable(8, lambda slot: None)
    table.put(2, _key(1), 5, declined=True)
    table.put(6, _key(1), 9, declined=False)
    assert table.get(_key(1)) == (6, si.ident(9, _key(1))) and not table.holds(2)
    assert table.declined(2) and not table.declined(6)  # the flag is the slot's
    table.drop(2)  # the old slot going does not take the key with it
    assert table.find(_key(1)) == 6 and len(table) == 1
    with pytest.raises(KeyError):
        table[_key(2)]


def test_the_ident_answered_is_the_asked_keys_not_the_tables() -> None:
    """A lookup whose hash matches another key's (a collision, forced here by asking through
    the table's own probe with that key's hash) would carry its own key's tag: the worker's
    post-copy check against the slot's ident word then fails it."""
    table = ReadyTable(8, lambda slot: None)
    table.put(3, _key(1), 7, declined=False)
    slot, ident = table[_key(1)]
    assert ident >> 32 == si.key_tag(_key(1)) and ident & si.GEN_MASK == 7
    assert si.ident(7, _key(2)) != ident  # what a colliding _key(2) would carry to the worker


def test_keys_cost_no_python_objects() -> None:
    """The memory a table holds is fixed at its creation: 20,000 keys added allocate nothing."""
    n = 20_000
    keys = [_key(i) for i in range(n)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        table = ReadyTable(n, lambda slot: None)
        made = tracemalloc.get_traced_memory()[0]
        for i, key in enumerate(keys):
            table.put(i, key, i, declined=False)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(table) == n and all(table.find(k) == i for i, k in enumerate(keys))
    assert made - before >= table.nbytes()  # the arrays are what it holds ...
    assert after - made < 4096  # ... and the keys add nothing per key


@pytest.mark.parametrize("seed", range(6))
def test_many_drops_at_once_and_purges_keep_every_find_right(seed: int) -> None:
    """``drop_many``'s tombstones, passed over by probes and emptied by ``purge`` a few at a
    time (a deadline already past) or all at once when they would fill a quarter of the
    buckets: finds match the model throughout, and the table never fills."""
    rng = random.Random(seed)
    slots = 24  # 64 buckets: 16 tombstones force a purge
    model = _Model()
    table = ReadyTable(slots, model.slot_key.get)
    keys = [_key(i) for i in range(80)]
    forced = 0
    for _ in range(3000):
        r = rng.random()
        if r < 0.55:
            slot, key = rng.randrange(slots), rng.choice(keys)
            table.put(slot, key, 1, declined=False)
            model.put(slot, key)
        elif r < 0.8:
            chosen = sorted(rng.sample(range(slots), rng.randrange(1, 12)))
            before = table.tombs
            table.drop_many(np.array(chosen, dtype=np.int64))
            forced += table.tombs < before
            for s in chosen:
                model.drop(s)
        else:
            table.purge(0.0)
        assert table.tombs < 16 and len(table) == len(model.key_slot)
        for k in keys:
            assert table.find(k) == model.key_slot.get(k, -1)
        for s in range(slots):
            assert table.holds(s) == (s in model.slot_key)
    assert forced, "the forced purge was never reached"
    table.purge(float("inf"))
    assert table.tombs == 0 and not (table._hashes == -1).any()


@pytest.mark.parametrize("rounds", (1, 2, 4))
@pytest.mark.parametrize("seed", range(6))
def test_batched_puts_match_a_dict_among_puts_drops_and_purges(
        seed: int, rounds: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``put_many`` (lockstep probes for ``rounds`` buckets, then one key at a time) in
    random mixes with ``put``, ``drop``, ``drop_many`` and ``purge``: batches of keys new,
    held elsewhere (moves), held by their own slot already, over slots holding another key,
    sharing home buckets, in runs that wrap around the table's end and pass tombstones."""
    monkeypatch.setattr(ready_table, "_VECTOR_ROUNDS", rounds)
    rng = random.Random(seed)
    slots = 24  # 64 buckets, 80 keys: homes shared, probe runs past ``rounds``
    model = _Model()
    table = ReadyTable(slots, model.slot_key.get)
    keys = [_key(i) for i in range(80)]
    gens = [0] * slots
    batches = 0
    for _ in range(2500):
        r = rng.random()
        if r < 0.35:
            chosen = rng.sample(range(slots), rng.randrange(1, slots + 1))
            picked = rng.sample(keys, len(chosen))
            new_gens = [rng.randrange(1 << 32) | rng.randrange(1 << 32) << 32 for _ in chosen]
            flags = [rng.random() < 0.2 for _ in chosen]
            table.put_many(np.array(chosen, dtype=np.int64),
                           np.array([hash(k) for k in picked], dtype=np.int64),
                           np.array(new_gens, dtype=np.uint64), np.array(flags))
            for s, k, g, f in zip(chosen, picked, new_gens, flags, strict=True):
                model.put(s, k)
                gens[s] = g & si.GEN_MASK
                assert table.declined(s) == f
            batches += 1
        elif r < 0.55:
            slot, key = rng.randrange(slots), rng.choice(keys)
            gens[slot] = rng.randrange(1 << 32)
            table.put(slot, key, gens[slot], declined=False)
            model.put(slot, key)
        elif r < 0.7:
            slot = rng.randrange(slots)
            table.drop(slot)
            model.drop(slot)
        elif r < 0.9:
            chosen = sorted(rng.sample(range(slots), rng.randrange(1, 12)))
            table.drop_many(np.array(chosen, dtype=np.int64))
            for s in chosen:
                model.drop(s)
        else:
            table.purge(0.0)
        assert len(table) == len(model.key_slot) and table.tombs < 16
        for k in keys:
            want = model.key_slot.get(k, -1)
            assert table.find(k) == want
            if want >= 0:
                assert table.get(k) == (want, si.ident(gens[want], k))
        for s in range(slots):
            assert table.holds(s) == (s in model.slot_key)
    assert batches
    table.purge(float("inf"))
    assert table.tombs == 0 and dict(table) == {k: table[k] for k in model.key_slot}
    _check_layout(table)


def _check_layout(table: ReadyTable) -> None:
    """Every live bucket is reachable from its key's home without an empty bucket between,
    and the slot -> bucket index is its exact inverse."""
    mask, slots_at, hashes_at = table._mask, table._slots, table._hashes
    live = np.nonzero(slots_at >= 0)[0].tolist()
    for i in live:
        j = int(hashes_at[i]) & mask
        while j != i:
            assert slots_at[j] >= 0, (i, j)
            j = (j + 1) & mask
        if slots_at[i] != table._tomb_slot:
            assert table._bucket[slots_at[i]] == i
    held = np.nonzero(table._bucket[:table._tomb_slot] >= 0)[0]
    assert sorted(slots_at[table._bucket[held]].tolist()) == held.tolist()


def _probe_len(table: ReadyTable, h: int) -> int:
    """Buckets a probe for ``h`` reads until an empty one or ``h``'s own (tombstones passed)."""
    i, n = h & table._mask, 1
    while table._slots[i] >= 0 and table._hashes[i] != h:
        i, n = (i + 1) & table._mask, n + 1
    return n


@pytest.mark.parametrize("rounds", (1, 2, 4))
@pytest.mark.parametrize("seed", range(4))
def test_absent_answers_finds_within_its_rounds_and_never_a_held_key_absent(
        seed: int, rounds: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``absent`` (lockstep probes for ``rounds`` buckets) among random puts, drops, batches of
    drops (tombstones, which a probe passes) and purges: True exactly for the keys no READY key
    has whose probe ends within its rounds; False for every held key, and for an absent one
    whose probe runs longer (the caller's per-key path decides)."""
    monkeypatch.setattr(ready_table, "_VECTOR_ROUNDS", rounds)
    rng = random.Random(seed)
    slots = 24  # 64 buckets, 80 keys: probe runs past ``rounds``
    model = _Model()
    table = ReadyTable(slots, model.slot_key.get)
    keys = [_key(i) for i in range(80)]
    long_absent = 0
    for _ in range(1500):
        r = rng.random()
        if r < 0.6:
            slot, key = rng.randrange(slots), rng.choice(keys)
            table.put(slot, key, 1, declined=False)
            model.put(slot, key)
        elif r < 0.85:
            chosen = sorted(rng.sample(range(slots), rng.randrange(1, 8)))
            table.drop_many(np.array(chosen, dtype=np.int64))
            for s in chosen:
                model.drop(s)
        else:
            table.purge(0.0)
        hashes = [hash(k) for k in keys]
        got = table.absent(np.array(hashes, dtype=np.int64)).tolist()
        for key, h, answer in zip(keys, hashes, got, strict=True):
            if key in model.key_slot:
                assert not answer, key
            elif _probe_len(table, h) <= rounds:
                assert answer, key
            else:
                assert not answer, key
                long_absent += 1
    assert long_absent, "no probe ran past the rounds"
    assert not len(table.absent(np.array([], dtype=np.int64)))


def test_absent_past_the_vector_rounds_answers_maybe_held() -> None:
    """Five keys of one home bucket (16 buckets): the run is longer than ``_VECTOR_ROUNDS``, so
    a key absent but homed there answers False, as do the held ones however deep; a hash homed
    at an empty bucket answers True, and a tombstone in the run is passed, not taken for the
    end."""
    table = ReadyTable(8, lambda slot: None)
    mask = table._mask
    same = [k for k in (_key(i) for i in range(5000)) if hash(k) & mask == 3][:5]
    assert len(same) == 5 and ready_table._VECTOR_ROUNDS < 4
    for slot, key in enumerate(same[:4]):
        table.put(slot, key, 1, declined=False)
    empty = next(h for h in range(1 << 20) if h & mask == 12)
    hashes = np.array([hash(k) for k in same] + [empty], dtype=np.int64)
    assert table.absent(hashes).tolist() == [False] * 5 + [True]
    assert table.find(same[4]) == -1  # absent indeed: past the rounds it cannot tell
    table.drop_many(np.array([0, 1], dtype=np.int64))  # tombstones at the run's start
    assert table.absent(hashes).tolist() == [False] * 5 + [True]
    assert table.find(same[2]) == 2 and table.find(same[0]) == -1
    table.purge(float("inf"))
    table.drop(2)
    # A run of one now (its last key, shifted back to the home bucket): the absent keys'
    # probes end at the next bucket, within the rounds.
    assert table._slots[3:5].tolist() == [3, -1]
    assert table.absent(hashes).tolist() == [True, True, True, False, True, True]
