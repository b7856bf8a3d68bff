"""Key -> slot index over the pool, with per-slot state, pins and futures for pending keys.

Layout, chosen for memory: per namespace one ``dict[key, slot]``; everything else lives in
arrays indexed by slot (state, pins, namespace, token end, tail flag) plus one list mapping a
slot back to its key. The eviction policy tracks slot numbers, not keys, so blocks of every
namespace compete for the same pool. Per stored block this costs the key's bytes object, one
dict entry, a few array cells and the policy's entry (measured in tests/daemon/store/test_index.py).

A key is PENDING from ``prepare`` (or ``claim`` of a reserved slot) until ``commit`` or
``abort``; callers that want to know how it ends ``wait`` on a future that resolves True
(readable) or False (gone). Nothing polls.

Every transition is mirrored into the shared index (``shared_index.py``) that engines read in
place. A slot's generation grows each time it is handed to a writer; a READY slot that loses
its key while engines read the index is retired, not freed (``reclaim.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from kvoffload.daemon.base import Geometry, KeyStatus
from kvoffload.daemon.store import shared_index as si
from kvoffload.daemon.store.earmarks import EarmarkTable
from kvoffload.daemon.store.eviction import EvictionPolicy, make_policy
from kvoffload.daemon.store.pool import Pool
from kvoffload.daemon.store.reclaim import Reclaimer, Writers
from kvoffload.daemon.store.reservations import ReservationTable
from kvoffload.daemon.store.session_file import PreviousSessions
from kvoffload.daemon.store.slot_arrays import SlotTable
from kvoffload.daemon.store.slot_states import (  # noqa: F401 - re-exported: callers use index.X
    _SHARED_STATE,
    Listener,
    Namespace,
    Prepared,
    SlotState,
)


class BlockIndex(SlotTable, ReservationTable, EarmarkTable):
    def __init__(self, pool: Pool, policy: str = "lru") -> None:
        self.pool = pool
        self.policy_name = policy
        self.policy: EvictionPolicy[int] = make_policy(policy, identity=self._block_identity)
        self.namespaces: list[Namespace] = []
        self._by_name: dict[str, Namespace] = {}
        self._waiters: dict[int, list[asyncio.Future[bool]]] = {}
        self.on_ready: list[Listener] = []
        self.on_drop: list[Listener] = []
        self.on_abort: list[Listener] = []
        # Called only for capacity evictions (not reset/drop), before on_drop and while the
        # slot still holds the block's bytes: a lower tier (daemon/tiers) copies them out.
        self.on_evict: list[Listener] = []
        self.shared: si.SharedIndexWriter | None = None
        self._share: tuple[str, str] | None = None
        self.reclaimer = Reclaimer()
        self.owners: dict[str, int] = {}  # engine instance -> owner id (0: nobody known)
        self.previous: PreviousSessions | None = None  # a previous daemon's engine sessions
        # A lower tier promotes into the pool (set by tiers/promote.py): keep_free then does
        # not count engines' reservations, as promotions need slots that are free.
        self.has_tiers = False
        self._hold_for_previous = False
        self._init_earmarks()
        self._size(0)

    def share(self, path: str, daemon_id: str) -> None:
        """Publish the index at ``path`` once the pool is configured (see ``configure``)."""
        self._share = (path, daemon_id)

    def configure(self, slot_bytes: int) -> None:
        self.pool.configure(slot_bytes)
        self._size(self.pool.num_slots)
        # ARC sizes its ghost lists by the number of slots, known only now.
        self.policy = make_policy(self.policy_name, self.pool.num_slots,
                                  identity=self._block_identity)
        if self._share is not None:
            self.previous = PreviousSessions(self._share[0])
            # A pool file reused in place (a warm restart): an engine of the previous daemon
            # may still be copying into a slot it was granted there. No slot that was not
            # committed is handed out until every such writer is gone (its lock is free).
            self._hold_for_previous = bool(self.previous) and not self.pool.created
            self.shared = si.SharedIndexWriter(self._share[0], self.pool.num_slots,
                                               self._share[1])

    @property
    def epoch(self) -> int:
        """Position of the shared index's change ring: what readers report back."""
        return self.shared.head if self.shared is not None else 0

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

    def _block_identity(self, slot: int) -> tuple[int, bytes | None]:
        """What ARC's ghosts remember of a resident slot: its block, not the slot number, which
        the next block reuses at once (eviction/arc.py)."""
        return self.ns_of[slot], self.slot_key[slot]

    def _evictable(self, slot: int) -> bool:
        return self.state[slot] == SlotState.READY and self.pins[slot] == 0 \
            and slot not in self.earmarks

    def _held_for_previous(self) -> bool:
        if self._hold_for_previous and self.previous is not None and not self.previous.gone():
            return True  # a previous daemon's writer may still copy into any free slot
        self._hold_for_previous = False
        return False

    def _alloc(self, evicted: list[tuple[Namespace, bytes, int]],
               evict: bool = True) -> int | None:
        """A free slot, reclaiming retired ones, else evicting one unpinned READY block."""
        if self._held_for_previous():
            return None
        slot = self.pool.alloc()
        if slot is None:
            self.reclaim()
            slot = self.pool.alloc()
        # Evicted slots that readers may still see are retired, not reusable at once: stop
        # evicting while enough of them wait, or a lagging reader would empty the pool.
        if slot is None and evict and self.reclaimer.backlog < self.max_retired:
            for victim in self.policy.victims(1, self._evictable):
                victim_key = self.slot_key[victim]
                if victim_key is not None:
                    for listener in self.on_evict:
                        listener(self.namespaces[self.ns_of[victim]], victim_key, victim)
                evicted.append(self._forget(victim))
            slot = self.pool.alloc()
        if slot is not None:
            self._bump(slot)  # a new writer: old readers' copies of it now fail their check
        return slot

    def _bump(self, slot: int) -> None:
        self.gen[slot] = (self.gen[slot] + 1) & si.GEN_MASK

    def _revoke(self, slot: int, fence_s: float, writers: Writers | None) -> bool:
        """A grant taken back while its writer may still copy into it: a new generation at
        once (its late commits are refused, its workers' pre-checks fail), then held back --
        quarantined until ``writers`` are gone, else fenced for ``fence_s``. False: no hold."""
        if writers is None and fence_s <= 0:
            return False
        self._bump(slot)
        self.state[slot] = SlotState.RETIRED
        self.publish(slot)
        if writers is not None:
            self.reclaimer.quarantine(writers, [slot])
        else:
            self.reclaimer.fence(slot, fence_s)
        return True

    def prepare(self, ns: Namespace, key: bytes, end_token: int, tail: bool,
                owner: int = 0) -> Prepared:
        """Reserve a slot for ``key`` (PENDING); evict one unpinned READY block if full."""
        if key in ns.keys:
            return Prepared(None, True, [])
        evicted: list[tuple[Namespace, bytes, int]] = []
        slot = self._alloc(evicted)
        if slot is None:
            return Prepared(None, False, evicted)
        self._occupy(ns, key, slot, SlotState.PENDING, end_token, tail, owner)
        return Prepared(slot, False, evicted)

    def _occupy(self, ns: Namespace, key: bytes, slot: int, state: SlotState, end_token: int,
                tail: bool, owner: int = 0) -> None:
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
        self.owner[slot] = owner
        self.publish(slot)

    def commit(self, ns: Namespace, key: bytes) -> bool:
        slot = ns.keys.get(key)
        if slot is None or self.state[slot] != SlotState.PENDING:
            return False
        self.state[slot] = SlotState.READY
        self.n_pending -= 1
        self.n_ready += 1
        self.policy.on_insert(slot)
        self.publish(slot)
        self._resolve(slot, True)
        for listener in self.on_ready:
            listener(ns, key, slot)
        return True

    def restore(self, ns: Namespace, key: bytes, slot: int, end_token: int, tail: bool) -> None:
        """Re-admit a READY block recovered at start (validated; the caller claims its slot).

        No listeners run: the journal already holds it and nothing was published this run.
        """
        self._bump(slot)
        self._occupy(ns, key, slot, SlotState.READY, end_token, tail)
        self.policy.on_insert(slot)

    def abort(self, ns: Namespace, key: bytes, fence_s: float = 0.0,
              writers: Writers | None = None) -> bool:
        slot = ns.keys.get(key)
        if slot is None or self.state[slot] != SlotState.PENDING:
            return False
        if self.cancel_handover(slot):  # not handed over yet: nobody wrote it
            return True
        for listener in self.on_abort:
            listener(ns, key, slot)
        # Nobody loads a PENDING block, so only a writer that may still be at work delays reuse.
        self._release_slot(ns, key, slot, fence_s=fence_s, writers=writers)
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
        if slot in self.earmarks:  # a load of it: not evicted while in use
            self.withdraw(slot)

    def pin_generation(self, slot: int, gen: int) -> bool:
        """Pin a slot an engine saw READY at generation ``gen``: also a retired one, whose
        bytes are intact until reclaimed. False when the slot went to another writer."""
        if not 0 <= slot < len(self.state) or self.gen[slot] != gen:
            return False
        if self.state[slot] not in (SlotState.READY, SlotState.RETIRED):
            return False
        self.pin(slot)
        return True

    def unpin(self, slot: int) -> None:
        if self.pins[slot]:
            self.pins[slot] -= 1
            if not self.pins[slot]:
                self.n_pinned -= 1
                self._unpinned(slot)
                if self.state[slot] == SlotState.RETIRED and self.reclaimer.unpinned(slot):
                    self._free(slot)

    def touch(self, slot: int) -> None:
        if slot in self.earmarks:  # reused: kept, as vLLM's LRU keeps what it just used
            self.withdraw(slot)
        if self.state[slot] == SlotState.READY:
            self.policy.on_access(slot)

    def _free(self, slot: int) -> None:
        if slot in self.handovers:  # reclaimed: the claimed earmark goes to its writer
            self._finish_handover(slot)
            return
        self.state[slot] = SlotState.FREE
        self.pool.free(slot)

    def reclaim(self) -> int:
        """Free every retired slot no reader and no pin can reach any more."""
        freed = self.reclaimer.reclaim(lambda s: self.pins[s] > 0)
        for slot in freed:
            self._free(slot)
        return len(freed)

    def _release_slot(self, ns: Namespace, key: bytes, slot: int, fence_s: float = 0.0,
                      writers: Writers | None = None) -> None:
        del ns.keys[key]
        was_ready = self.state[slot] == SlotState.READY
        if was_ready:
            self.n_ready -= 1
        elif self.state[slot] == SlotState.PENDING:
            self.n_pending -= 1
        self.slot_key[slot] = None
        # Readers may hold this slot as a HIT until they apply the change published now.
        retire = was_ready and bool(self.reclaimer.readers)
        if retire:
            self.state[slot] = SlotState.RETIRED
            self.publish(slot)
            self.reclaimer.retire(slot, self.epoch)
            return  # pins (and their count) stay until the loads that hold them complete
        if self.pins[slot]:
            self.n_pinned -= 1
        self.pins[slot] = 0
        if not self._revoke(slot, fence_s, writers):
            self.state[slot] = SlotState.FREE
            self.publish(slot)
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

    def reset(self, ns: Namespace, owner: int | None = None) -> int:
        """Drop a namespace's ready, unpinned blocks (only ``owner``'s, when given)."""
        keys = [k for k, s in ns.keys.items() if owner is None or self.owner[s] == owner]
        return sum(self.drop(ns, key) for key in keys)

    def slots_of(self, ns: Namespace) -> Iterator[tuple[bytes, int]]:
        return iter(ns.keys.items())
