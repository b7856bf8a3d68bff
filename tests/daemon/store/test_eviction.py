"""Eviction policies: ordering, pinned keys, ARC adaptation, models, memory."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvoffload.daemon.store.eviction import ARCPolicy, EvictionPolicy, LRUPolicy, make_policy
from kvoffload.daemon.store.eviction.base import KeyOrder


def k(i: int) -> bytes:
    return f"key-{i:06d}".encode() + i.to_bytes(4, "big")


def _not_in(banned: set[int]) -> Callable[[int], bool]:
    """``take``'s filter: anything but ``banned`` may go."""
    return lambda x: x not in banned


def anything(key: bytes) -> bool:
    return True


# --------------------------------------------------------------------------- factory


def test_factory() -> None:
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy(" ARC ", 10), ARCPolicy)
    assert make_policy("arc", 10).capacity == 10  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="'fifo'.*arc, lru"):
        make_policy("fifo")
    with pytest.raises(ValueError):
        ARCPolicy(0)


# --------------------------------------------------------------------------- KeyOrder


def test_key_order_matches_a_list_through_compactions() -> None:
    rng = random.Random(7)
    order: KeyOrder[int] = KeyOrder()
    model: list[int] = []
    for step in range(30_000):
        op = rng.random()
        key = rng.randrange(200)
        if op < 0.6:
            order.push(key)
            if key in model:
                model.remove(key)
            model.append(key)
        elif op < 0.8:
            assert order.discard(key) == (key in model)
            if key in model:
                model.remove(key)
        else:
            banned = set(rng.sample(range(200), 20))
            n = rng.randrange(4)
            got = order.take(n, _not_in(banned))
            want = [x for x in model if x not in banned][:n]
            assert got == want, step
            for x in want:
                model.remove(x)
        assert len(order) == len(model)
        if step % 997 == 0:
            assert list(order) == model
    # Repeated pushes of hot keys must not grow the queue without bound.
    for _ in range(10_000):
        order.push(1)
    assert order.queued <= len(order) * 2 + 64


def test_key_order_compacts_in_steps_and_keeps_its_order_meanwhile() -> None:
    """Compaction runs a few keys per push (no call rebuilds the whole queue); takes,
    restores and discards in the middle of one see exactly the list model."""
    rng = random.Random(3)
    order: KeyOrder[int] = KeyOrder()
    model: list[int] = list(range(2000))
    for key in model:
        order.push(key)
    while not order.compacting:  # hot keys pushed again and again: stale occurrences
        key = rng.randrange(50)
        order.push(key)
        model.remove(key)
        model.append(key)
    steps = 0
    while order.compacting:
        steps += 1
        op = rng.random()
        key = rng.randrange(2000)
        if op < 0.7:
            order.push(key)
            if key in model:
                model.remove(key)
            model.append(key)
        elif op < 0.85:
            assert order.discard(key) == (key in model)
            if key in model:
                model.remove(key)
        else:
            banned = set(rng.sample(range(2000), 200))
            got = order.take(2, _not_in(banned))
            want = [x for x in model if x not in banned][:2]
            assert got == want
            for x in want:
                model.remove(x)
        assert list(order) == model
    assert steps > 100  # it took many pushes, not one rebuild
    assert order.queued <= len(order) * 2 + 64


def test_key_order_restores_held_keys_when_the_callback_fails() -> None:
    order: KeyOrder[int] = KeyOrder()
    for i in range(5):
        order.push(i)

    def explode(key: int) -> bool:
        if key == 2:
            raise RuntimeError("boom")
        return False

    with pytest.raises(RuntimeError):
        order.take(3, explode)
    assert list(order) == [0, 1, 2, 3, 4]
    assert order.take(5, lambda key: True) == [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------- common behaviour


@pytest.fixture(params=["lru", "arc"])
def policy(request: pytest.FixtureRequest) -> EvictionPolicy:
    return make_policy(request.param, 100)


def test_oldest_first_and_access_refreshes(policy: EvictionPolicy) -> None:
    for i in range(4):
        policy.on_insert(k(i))
    policy.on_access(k(0))
    assert policy.victims(1, anything) == [k(1)]
    assert k(1) not in policy and len(policy) == 3
    # ARC: k(0) is in T2 now, k(2), k(3) in T1 above target 0: T1 goes first.
    assert policy.victims(3, anything) == [k(2), k(3), k(0)]
    assert len(policy) == 0 and policy.victims(1, anything) == []


def test_pinned_keys_are_skipped_but_keep_their_place(policy: EvictionPolicy) -> None:
    for i in range(5):
        policy.on_insert(k(i))
    pinned = {k(0), k(2)}
    assert policy.victims(2, lambda key: key not in pinned) == [k(1), k(3)]
    assert k(0) in policy and k(2) in policy
    # Once released, the oldest pinned key is again the first victim.
    assert policy.victims(1, anything) == [k(0)]
    assert policy.victims(5, lambda key: False) == []
    assert len(policy) == 2


def test_remove_and_unknown_keys(policy: EvictionPolicy) -> None:
    for i in range(3):
        policy.on_insert(k(i))
    policy.on_remove(k(1))
    policy.on_remove(k(99))  # unknown: ignored
    policy.on_access(k(98))  # not resident: ignored
    assert k(98) not in policy
    assert policy.victims(3, anything) == [k(0), k(2)]
    assert policy.victims(0, anything) == []


def test_insert_of_a_resident_key_is_an_access(policy: EvictionPolicy) -> None:
    for i in range(3):
        policy.on_insert(k(i))
    policy.on_insert(k(0))
    assert len(policy) == 3
    assert policy.victims(1, anything) == [k(1)]


# --------------------------------------------------------------------------- ARC


def _run_with_capacity(policy: EvictionPolicy, capacity: int, key: bytes) -> None:
    """What the daemon does: evict one when full, then commit the new entry."""
    if key in policy:
        policy.on_access(key)
        return
    if len(policy) >= capacity:
        assert len(policy.victims(1, anything)) == 1
    policy.on_insert(key)


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_scan_resistance(name: str) -> None:
    capacity = 100
    policy = make_policy(name, capacity)
    hot = [k(i) for i in range(50)]
    for _ in range(3):
        for key in hot:
            _run_with_capacity(policy, capacity, key)
    for i in range(1000, 1050):
        _run_with_capacity(policy, capacity, k(i))
    # A one-time scan twice the cache size.
    for i in range(10_000, 10_200):
        _run_with_capacity(policy, capacity, k(i))
    survivors = sum(key in policy for key in hot)
    if name == "arc":
        assert survivors == 50  # frequently used keys live in T2; the scan churns T1
    else:
        assert survivors == 0  # LRU flushes everything older than the scan


def test_ghost_hits_adapt_the_target() -> None:
    arc: ARCPolicy[bytes] = ARCPolicy(4)
    for i in range(4):
        arc.on_insert(k(i))
    assert arc.victims(2, anything) == [k(0), k(1)]
    assert arc.sizes() == (2, 0, 2, 0) and arc.target_t1 == 0
    arc.on_insert(k(0))  # B1 ghost hit: recency deserved more room
    assert arc.target_t1 == 1 and arc.is_frequent(k(0))
    assert arc.sizes() == (2, 1, 1, 0)
    arc.on_insert(k(1))  # second B1 hit: |B2| / |B1| < 1, so +1 again
    assert arc.target_t1 == 2 and arc.sizes() == (2, 2, 0, 0)
    # T1 (2) is not above p (2): the victim comes from T2, whose ghost lands in B2.
    assert arc.victims(1, anything) == [k(0)]
    assert arc.sizes() == (2, 1, 0, 1)
    arc.on_insert(k(0))  # B2 ghost hit: frequency deserved more room
    assert arc.target_t1 == 1 and arc.is_frequent(k(0))


def test_ghost_lists_stay_bounded() -> None:
    rng = random.Random(3)
    capacity = 50
    arc: ARCPolicy[bytes] = ARCPolicy(capacity)
    targets = set()
    for _ in range(20_000):
        key = k(rng.randrange(400) if rng.random() < 0.5 else rng.randrange(60))
        _run_with_capacity(arc, capacity, key)
        t1, t2, b1, b2 = arc.sizes()
        assert t1 + t2 <= capacity
        assert t1 + b1 <= capacity
        assert t1 + t2 + b1 + b2 <= 2 * capacity
        assert 0 <= arc.target_t1 <= capacity
        targets.add(arc.target_t1)
    assert b1 + b2 > 0 and len(targets) > 5  # it kept adapting


def test_auto_capacity_follows_the_resident_high_water_mark() -> None:
    arc: ARCPolicy[bytes] = ARCPolicy()
    for i in range(10):
        arc.on_insert(k(i))
    assert arc.capacity == 10
    arc.victims(10, anything)
    assert arc.sizes() == (0, 0, 10, 0)  # ghosts bounded by the learnt capacity
    arc.set_capacity(4)
    assert arc.sizes() == (0, 0, 4, 0)
    arc.clear()
    assert arc.sizes() == (0, 0, 0, 0) and arc.target_t1 == 0


# --------------------------------------------------------------------------- models


class RefLRU:
    def __init__(self, capacity: int | None) -> None:
        self.keys: list[bytes] = []

    def on_insert(self, key: bytes) -> None:
        if key in self.keys:
            self.keys.remove(key)
        self.keys.append(key)

    def on_access(self, key: bytes) -> None:
        if key in self.keys:
            self.on_insert(key)

    def on_remove(self, key: bytes) -> None:
        if key in self.keys:
            self.keys.remove(key)

    def victims(self, n: int, can: Callable[[bytes], bool]) -> list[bytes]:
        out = [key for key in self.keys if can(key)][: max(n, 0)]
        for key in out:
            self.keys.remove(key)
        return out

    def resident(self) -> set[bytes]:
        return set(self.keys)


class RefARC:
    """The textbook lists, written as plainly as possible."""

    def __init__(self, capacity: int | None) -> None:
        self.auto = capacity is None
        self.c = capacity or 0
        self.p = 0
        self.t1: list[bytes] = []
        self.t2: list[bytes] = []
        self.b1: list[bytes] = []
        self.b2: list[bytes] = []

    def on_insert(self, key: bytes) -> None:
        if key in self.t1 or key in self.t2:
            self.on_access(key)
            return
        if key in self.b1:
            self.p = min(self.c, self.p + max(1, len(self.b2) // len(self.b1)))
            self.b1.remove(key)
            self.t2.append(key)
        elif key in self.b2:
            self.p = max(0, self.p - max(1, len(self.b1) // len(self.b2)))
            self.b2.remove(key)
            self.t2.append(key)
        else:
            self.t1.append(key)
        if self.auto:
            self.c = max(self.c, len(self.t1) + len(self.t2))
        self.trim()

    def on_access(self, key: bytes) -> None:
        if key in self.t1:
            self.t1.remove(key)
            self.t2.append(key)
        elif key in self.t2:
            self.t2.remove(key)
            self.t2.append(key)

    def on_remove(self, key: bytes) -> None:
        for keys in (self.t1, self.t2, self.b1, self.b2):
            if key in keys:
                keys.remove(key)

    def victims(self, n: int, can: Callable[[bytes], bool]) -> list[bytes]:
        out: list[bytes] = []
        while len(out) < n:
            c1 = [key for key in self.t1 if can(key)]
            c2 = [key for key in self.t2 if can(key)]
            if c1 and (len(self.t1) > self.p or not c2):
                self.t1.remove(c1[0])
                self.b1.append(c1[0])
                out.append(c1[0])
            elif c2:
                self.t2.remove(c2[0])
                self.b2.append(c2[0])
                out.append(c2[0])
            else:
                break
        self.trim()
        return out

    def trim(self) -> None:
        while self.b1 and len(self.t1) + len(self.b1) > self.c:
            self.b1.pop(0)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.c:
            self.b2.pop(0)
        while self.b1 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.c:
            self.b1.pop(0)

    def resident(self) -> set[bytes]:
        return set(self.t1) | set(self.t2)


KEYS = st.sampled_from([k(i) for i in range(10)])


class PolicyMachine(RuleBasedStateMachine):
    """Random operation sequences against the reference models above."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: set[bytes] = set()
        self.real: EvictionPolicy | None = None
        self.ref: RefLRU | RefARC | None = None

    @precondition(lambda self: self.real is None)
    @rule(name=st.sampled_from(["lru", "arc"]), capacity=st.sampled_from([None, 3, 6]))
    def build(self, name: str, capacity: int | None) -> None:
        self.real = make_policy(name, capacity)
        self.ref = RefLRU(capacity) if name == "lru" else RefARC(capacity)

    @precondition(lambda self: self.real is not None)
    @rule(key=KEYS)
    def insert(self, key: bytes) -> None:
        self.real.on_insert(key)  # type: ignore[union-attr]
        self.ref.on_insert(key)  # type: ignore[union-attr]

    @precondition(lambda self: self.real is not None)
    @rule(key=KEYS)
    def access(self, key: bytes) -> None:
        self.real.on_access(key)  # type: ignore[union-attr]
        self.ref.on_access(key)  # type: ignore[union-attr]

    @precondition(lambda self: self.real is not None)
    @rule(key=KEYS)
    def remove(self, key: bytes) -> None:
        self.real.on_remove(key)  # type: ignore[union-attr]
        self.ref.on_remove(key)  # type: ignore[union-attr]

    @rule(key=KEYS)
    def toggle_pin(self, key: bytes) -> None:
        self.pinned ^= {key}

    @precondition(lambda self: self.real is not None)
    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        def can(key: bytes) -> bool:
            return key not in self.pinned

        got = self.real.victims(n, can)  # type: ignore[union-attr]
        assert got == self.ref.victims(n, can)  # type: ignore[union-attr]
        assert not set(got) & self.pinned

    @invariant()
    def same_state(self) -> None:
        if self.real is None or self.ref is None:
            return
        resident = self.ref.resident()
        assert len(self.real) == len(resident)
        assert {key for key in (k(i) for i in range(10)) if key in self.real} == resident
        if isinstance(self.ref, RefARC):
            arc = self.real
            assert isinstance(arc, ARCPolicy)
            ref = self.ref
            assert arc.sizes() == (len(ref.t1), len(ref.t2), len(ref.b1), len(ref.b2))
            assert arc.target_t1 == ref.p and arc.capacity == ref.c


PolicyMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestPolicyMachine = PolicyMachine.TestCase


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize(("name", "budget"), [("lru", 90), ("arc", 90)])
def test_resident_cost_per_key(name: str, budget: int) -> None:
    """Policy bytes per resident key (the key objects are the index's, not counted)."""
    keys = [k(i) for i in range(50_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        policy = make_policy(name, len(keys))
        for key in keys:
            policy.on_insert(key)
        per_key = (tracemalloc.get_traced_memory()[0] - before) / len(keys)
    finally:
        tracemalloc.stop()
    assert per_key < budget, f"{name}: {per_key:.0f} bytes per key"
