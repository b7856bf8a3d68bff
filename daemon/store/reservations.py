"""Store reservations: slots granted to one engine ahead of its stores, and its claims.

A mixin of ``index.BlockIndex`` (split out to keep each module readable). An engine answers
vLLM's ``prepare_store`` at once from slots the daemon granted it a step earlier: empty slots
(evicted ahead, ``keep_free``), or with ``earmark_reservations`` READY blocks evicted only
when claimed (``earmarks.py``).
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from kvoffload.daemon.store.reclaim import Reclaimer, Writers
from kvoffload.daemon.store.slot_arrays import MIN_FREE
from kvoffload.daemon.store.slot_states import Listener, Namespace, SlotState

if TYPE_CHECKING:
    from kvoffload.daemon.store.eviction import EvictionPolicy
    from kvoffload.daemon.store.pool import Pool


class ReservationTable:
    # Set by BlockIndex and SlotTable (declared here for the methods below).
    pool: Pool
    policy: EvictionPolicy[int]
    reclaimer: Reclaimer
    namespaces: list[Namespace]
    on_evict: list[Listener]
    state: bytearray
    gen: array[int]
    ns_of: array[int]
    slot_key: list[bytes | None]
    reserved_by: dict[int, object]
    earmarks: dict[int, object]
    earmark_reservations: bool
    has_tiers: bool
    free_target: int
    max_retired: int

    if TYPE_CHECKING:  # provided by BlockIndex, SlotTable and EarmarkTable
        def publish(self, slot: int) -> None: ...
        def _forget(self, slot: int) -> tuple[Namespace, bytes, int]: ...
        def _alloc(self, evicted: list[tuple[Namespace, bytes, int]],
                   evict: bool = True) -> int | None: ...
        def _held_for_previous(self) -> bool: ...
        def _evictable(self, slot: int) -> bool: ...
        def _earmark(self, holder: object, n: int) -> list[tuple[int, int]]: ...
        def _occupy(self, ns: Namespace, key: bytes, slot: int, state: SlotState,
                    end_token: int, tail: bool, owner: int = 0) -> None: ...
        def _revoke(self, slot: int, fence_s: float, writers: Writers | None) -> bool: ...
        def release_earmark(self, slot: int) -> bool: ...
        def claim_earmark(self, ns: Namespace, key: bytes, slot: int, gen: int,
                          end_token: int, tail: bool, holder: object, owner: int,
                          stamp: float) -> bool | None: ...

    def keep_free(self) -> int:
        """Evict ahead, so a store, a reservation or a promotion finds a slot at once: with
        engines reading the index an evicted slot is reusable only a moment later (retired),
        so waiting until the pool is full would refuse the very request that evicted."""
        if not self.reclaimer.readers:
            return 0  # nobody reads in place: evicting on demand frees a slot at once
        # Reservations are empty slots ahead of stores too (issue 24: 10 free on top of 20
        # reserved of 167 served what vLLM serves with 137); MIN_FREE stay free or retiring
        # whatever is reserved (test_stuck_readers). Not counted with a tier below: promotions
        # need free slots (counting starved them: issue 25's below-memory run).
        # Earmarks count as reserved: their stores need no empty slot.
        reserved = 0 if self.has_tiers else len(self.reserved_by) + len(self.earmarks)
        evicted = 0
        while self._short_of_empty(reserved) and self.reclaimer.backlog < self.max_retired:
            victims = self.policy.victims(1, self._evictable)
            if not victims:
                break
            victim = victims[0]
            key = self.slot_key[victim]
            if key is not None:
                for listener in self.on_evict:
                    listener(self.namespaces[self.ns_of[victim]], key, victim)
            self._forget(victim)
            evicted += 1
        return evicted

    def _short_of_empty(self, reserved: int) -> bool:
        empty = self.pool.free_slots + self.reclaimer.backlog
        return empty < MIN_FREE or empty + reserved < self.free_target

    def reserve(self, holder: object, n: int) -> tuple[list[tuple[int, int]],
                                                       list[tuple[Namespace, bytes, int]]]:
        """Up to ``n`` empty slots for one engine's stores, as (slot, generation) pairs.

        Evicts as needed; an evicted slot that readers may still see is retired, so it comes
        back in a later reservation, not this one. With ``earmark_reservations``, a full pool
        grants READY blocks instead, evicted only when claimed (``earmarks.py``).
        """
        granted: list[tuple[int, int]] = []
        evicted: list[tuple[Namespace, bytes, int]] = []
        earmark = self.earmark_reservations
        for _ in range(n):
            if earmark and self.pool.free_slots <= MIN_FREE:
                break  # MIN_FREE stay free for clients without a reservation, promotions
            slot = self._alloc(evicted, evict=not earmark)
            if slot is None:
                break
            self.state[slot] = SlotState.RESERVED
            self.reserved_by[slot] = holder
            granted.append((slot, self.gen[slot]))
            self.publish(slot)  # readers see the generation move
        if earmark and len(granted) < n and not self._held_for_previous():
            granted += self._earmark(holder, n - len(granted))
        return granted, evicted

    def claim(self, ns: Namespace, key: bytes, slot: int, gen: int, end_token: int,
              tail: bool, holder: object, owner: int = 0, stamp: float = 0.0) -> bool | None:
        """Put ``key`` into a slot ``holder`` reserved: True, False (key exists: the slot stays
        reserved), None (not this holder's slot or generation: refused). An earmarked slot:
        ``claim_earmark``."""
        if slot in self.earmarks:
            return self.claim_earmark(ns, key, slot, gen, end_token, tail, holder, owner, stamp)
        if not 0 <= slot < len(self.state) or self.state[slot] != SlotState.RESERVED \
                or self.reserved_by.get(slot) is not holder or self.gen[slot] != gen:
            return None
        if key in ns.keys:
            return False
        del self.reserved_by[slot]
        self._occupy(ns, key, slot, SlotState.PENDING, end_token, tail, owner)
        return True

    def unreserve(self, slot: int, fence_s: float = 0.0,
                  writers: Writers | None = None) -> None:
        """Give back a reserved slot; ``fence_s`` / ``writers``: its writer may still be
        writing it (``_revoke``; an earmark is burnt)."""
        if self.release_earmark(slot):
            return
        if self.state[slot] != SlotState.RESERVED:
            return
        self.reserved_by.pop(slot, None)
        if not self._revoke(slot, fence_s, writers):
            self.state[slot] = SlotState.FREE
            self.pool.free(slot)
