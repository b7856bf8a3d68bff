"""Key -> slot index over the pool, with per-slot state, pins and futures for pending keys.

Layout, chosen for memory: per namespace one ``dict[key, slot]``; everything else lives in
arrays indexed by slot (state, pins, namespace, token end, tail flag) plus one list mapping a
slot back to its key. The eviction policy tracks slot numbers, not keys, so blocks of every
namespace compete for the same pool. Per stored block this costs the key's bytes object, one
dict entry, a few array cells and the policy's entry (measured in tests/test_index.py).

A key is PENDING from ``prepare`` until ``commit`` or ``abort``; callers that want to know how
it ends ``wait`` on a future that resolves True (readable) or False (gone). Nothing polls.
"""

from __future__ import annotations

import asyncio
import enum
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvoffload.daemon.cost import TailCost
from kvoffload.daemon.policies import EvictionPolicy, make_policy
from kvoffload.daemon.pool import Pool
from kvoffload.daemon.types import Geometry, KeyStatus


class SlotState(enum.IntEnum):
    FREE = 0
    PENDING = 1
    READY = 2


@dataclass(slots=True)
class Namespace:
    """One engine geometry; every engine and rank registering the same one shares it."""

    id: int
    geometry: Geometry
    keys: dict[bytes, int]
    cost: TailCost | None = None  # set when an engine registers its time model


@dataclass(slots=True, frozen=True)
class Prepared:
    slot: int | None  # None: not granted (exists, or no room)
    exists: bool
    evicted: list[tuple[Namespace, bytes, int]]  # (namespace, key, end_token) of evictions


# Called with (namespace, key, slot) when a key becomes readable or is dropped.
Listener = Callable[[Namespace, bytes, int], None]


class BlockIndex:
    def __init__(self, pool: Pool, policy: str = "lru") -> None:
        self.pool = pool
        self.policy_name = policy
        self.policy: EvictionPolicy = make_policy(policy)
        self.namespaces: list[Namespace] = []
        self._by_name: dict[str, Namespace] = {}
        self._waiters: dict[int, list[asyncio.Future[bool]]] = {}
        self.on_ready: list[Listener] = []
        self.on_drop: list[Listener] = []
        self.on_abort: list[Listener] = []
        # Called only for capacity evictions (not reset/drop), before on_drop and while the
        # slot still holds the block's bytes: a lower tier (daemon/tiers) copies them out.
        self.on_evict: list[Listener] = []
        self._size(0)

    def _size(self, n: int) -> None:
        self.state = bytearray(n)
        self.pins = array("I", bytes(4 * n))
        self.ns_of = array("H", bytes(2 * n))
        self.end_token = array("I", bytes(4 * n))
        self.tail = bytearray(n)
        self.slot_key: list[bytes | None] = [None] * n
        # Kept on every transition so gauges and stats cost O(1), not a scan of the pool.
        self.n_ready = self.n_pending = self.n_pinned = 0

    def configure(self, slot_bytes: int) -> None:
        self.pool.configure(slot_bytes)
        self._size(self.pool.num_slots)
        # ARC sizes its ghost lists by the number of slots, known only now.
        self.policy = make_policy(self.policy_name, self.pool.num_slots)

    # -- namespaces -------------------------------------------------------------------

    @property
    def names(self) -> set[str]:
        return set(self._by_name)

    def namespace(self, geometry: Geometry) -> Namespace:
        """The namespace of ``geometry``; ValueError when its name holds another geometry."""
        ns = self._by_name.get(geometry.namespace)
        if ns is None:
            ns = Namespace(len(self.namespaces), geometry, {})
            self.namespaces.append(ns)
            self._by_name[geometry.namespace] = ns
        elif ns.geometry != geometry:
            raise ValueError(
                f"namespace {geometry.namespace!r} is registered with another geometry "
                f"({ns.geometry!r}); include what differs (dtype, TP layout, ...) in the name")
        return ns

    # -- reads ------------------------------------------------------------------------

    def status(self, ns: Namespace, key: bytes) -> KeyStatus:
        slot = ns.keys.get(key)
        if slot is None:
            return KeyStatus.MISS
        return KeyStatus.HIT if self.state[slot] == SlotState.READY else KeyStatus.HIT_PENDING

    def ready_slot(self, ns: Namespace, key: bytes) -> int | None:
        slot = ns.keys.get(key)
        return slot if slot is not None and self.state[slot] == SlotState.READY else None

    def count(self, state: SlotState) -> int:
        return {SlotState.READY: self.n_ready, SlotState.PENDING: self.n_pending}.get(
            state, self.pool.free_slots)

    def __len__(self) -> int:
        return sum(len(ns.keys) for ns in self.namespaces)

    # -- store lifecycle --------------------------------------------------------------

    def _evictable(self, slot: int) -> bool:
        return self.state[slot] == SlotState.READY and self.pins[slot] == 0

    def prepare(self, ns: Namespace, key: bytes, end_token: int, tail: bool) -> Prepared:
        """Reserve a slot for ``key`` (PENDING); evict one unpinned READY block if full."""
        if key in ns.keys:
            return Prepared(None, True, [])
        evicted: list[tuple[Namespace, bytes, int]] = []
        slot = self.pool.alloc()
        if slot is None:
            for victim in self.policy.victims(1, self._evictable):
                victim_key = self.slot_key[victim]
                if victim_key is not None:
                    for listener in self.on_evict:
                        listener(self.namespaces[self.ns_of[victim]], victim_key, victim)
                evicted.append(self._forget(victim))
            slot = self.pool.alloc()
            if slot is None:
                return Prepared(None, False, evicted)
        self._occupy(ns, key, slot, SlotState.PENDING, end_token, tail)
        return Prepared(slot, False, evicted)

    def _occupy(self, ns: Namespace, key: bytes, slot: int, state: SlotState, end_token: int,
                tail: bool) -> None:
        """Record ``key`` in ``slot`` (every per-slot array, the counters, the namespace)."""
        ns.keys[key] = slot
        self.state[slot] = state
        if state == SlotState.PENDING:
            self.n_pending += 1
        else:
            self.n_ready += 1
        self.ns_of[slot] = ns.id
        self.end_token[slot] = end_token
        self.tail[slot] = tail
        self.slot_key[slot] = key

    def commit(self, ns: Namespace, key: bytes) -> bool:
        slot = ns.keys.get(key)
        if slot is None or self.state[slot] != SlotState.PENDING:
            return False
        self.state[slot] = SlotState.READY
        self.n_pending -= 1
        self.n_ready += 1
        self.policy.on_insert(slot)
        self._resolve(slot, True)
        for listener in self.on_ready:
            listener(ns, key, slot)
        return True

    def restore(self, ns: Namespace, key: bytes, slot: int, end_token: int, tail: bool) -> None:
        """Re-admit a READY block recovered at start (validated; the caller claims its slot).

        No listeners run: the journal already holds it and nothing was published this run.
        """
        self._occupy(ns, key, slot, SlotState.READY, end_token, tail)
        self.policy.on_insert(slot)

    def abort(self, ns: Namespace, key: bytes) -> bool:
        slot = ns.keys.get(key)
        if slot is None or self.state[slot] != SlotState.PENDING:
            return False
        for listener in self.on_abort:
            listener(ns, key, slot)
        self._release_slot(ns, key, slot)
        self._resolve(slot, False)
        return True

    def wait(self, ns: Namespace, key: bytes) -> asyncio.Future[bool] | None:
        """A future resolving when a PENDING key commits (True) or aborts (False)."""
        slot = ns.keys.get(key)
        if slot is None or self.state[slot] != SlotState.PENDING:
            return None
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(slot, []).append(fut)
        return fut

    def _resolve(self, slot: int, ok: bool) -> None:
        for fut in self._waiters.pop(slot, ()):
            if not fut.done():
                fut.set_result(ok)

    def cancel_waiters(self) -> None:
        for slot in list(self._waiters):
            self._resolve(slot, False)

    # -- pins, access, removal --------------------------------------------------------

    def pin(self, slot: int) -> None:
        if not self.pins[slot]:
            self.n_pinned += 1
        self.pins[slot] += 1

    def unpin(self, slot: int) -> None:
        if self.pins[slot]:
            self.pins[slot] -= 1
            if not self.pins[slot]:
                self.n_pinned -= 1

    def touch(self, slot: int) -> None:
        if self.state[slot] == SlotState.READY:
            self.policy.on_access(slot)

    def _release_slot(self, ns: Namespace, key: bytes, slot: int) -> None:
        del ns.keys[key]
        if self.state[slot] == SlotState.READY:
            self.n_ready -= 1
        elif self.state[slot] == SlotState.PENDING:
            self.n_pending -= 1
        if self.pins[slot]:
            self.n_pinned -= 1
        self.state[slot] = SlotState.FREE
        self.pins[slot] = 0
        self.slot_key[slot] = None
        self.pool.free(slot)

    def _forget(self, slot: int) -> tuple[Namespace, bytes, int]:
        """Drop a READY slot the policy already forgot; tell listeners."""
        ns = self.namespaces[self.ns_of[slot]]
        key = self.slot_key[slot]
        assert key is not None
        end = self.end_token[slot]
        for listener in self.on_drop:
            listener(ns, key, slot)
        self._release_slot(ns, key, slot)
        return ns, key, end

    def drop(self, ns: Namespace, key: bytes) -> bool:
        """Remove one READY, unpinned key (reset, corruption)."""
        slot = ns.keys.get(key)
        if slot is None or not self._evictable(slot):
            return False
        self.policy.on_remove(slot)
        self._forget(slot)
        return True

    def reset(self, ns: Namespace) -> int:
        return sum(self.drop(ns, key) for key in list(ns.keys))

    def slots_of(self, ns: Namespace) -> Iterator[tuple[bytes, int]]:
        return iter(ns.keys.items())
