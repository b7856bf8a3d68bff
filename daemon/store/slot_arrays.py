"""The per-slot arrays of ``BlockIndex`` and their mirror in the shared index.

A mixin of ``index.BlockIndex`` (split out to keep each module readable): sizing the arrays
once the pool's slot count is known, owner ids of engine instances, and ``publish``, which
writes one slot's entry into the shared index that engines read in place.
"""

from __future__ import annotations

from array import array

from kvoffload.daemon.store import shared_index as si
from kvoffload.daemon.store.slot_states import _SHARED_STATE, Namespace, SlotState

MIN_FREE = 2  # slots kept free for clients without a reservation and promotions


class SlotTable:
    # Set by BlockIndex.__init__ (declared here for the methods below).
    namespaces: list[Namespace]
    owners: dict[str, int]
    shared: si.SharedIndexWriter | None

    def _size(self, n: int) -> None:
        self.state = bytearray(n)
        self.pins = array("I", bytes(4 * n))
        self.ns_of = array("H", bytes(2 * n))
        self.end_token = array("I", bytes(4 * n))
        self.tail = bytearray(n)
        self.slot_key: list[bytes | None] = [None] * n
        self.gen = array("I", bytes(4 * n))  # grows whenever the slot goes to a new writer
        self.owner = array("H", bytes(2 * n))  # who stored the block (reset of one engine's)
        self.reserved_by: dict[int, object] = {}  # RESERVED slot -> holder (a client)
        self.max_retired = max(64, n // 8)
        # Slots kept empty ahead of stores: free, retiring or in engines' reservations (these
        # only without a tier below, and MIN_FREE of them free or retiring: index.keep_free).
        self.free_target = max(MIN_FREE, min(256, n // 16))
        # Kept on every transition so gauges and stats cost O(1), not a scan of the pool.
        self.n_ready = self.n_pending = self.n_pinned = 0

    def owner_id(self, instance: str) -> int:
        if not instance:
            return 0
        oid = self.owners.get(instance)
        if oid is None:
            oid = self.owners[instance] = len(self.owners) + 1 if len(self.owners) < 65534 else 0
        return oid

    def publish(self, slot: int) -> None:
        """Mirror one slot into the shared index (after every change of it)."""
        if self.shared is None:
            return
        state = _SHARED_STATE.get(SlotState(self.state[slot]), si.FREE)
        key = self.slot_key[slot] if state != si.FREE else None
        ns = self.namespaces[self.ns_of[slot]] if key is not None else None
        flags = 0
        if ns is not None and self.tail[slot]:
            flags |= si.FLAG_TAIL
            if ns.cost is not None and not ns.cost.admit_tail(self.end_token[slot]):
                flags |= si.FLAG_NOT_WORTH
        self.shared.write(slot, self.gen[slot], ns.id if ns is not None else 0, state, flags,
                          key)

    def republish(self, ns: Namespace) -> None:
        """A namespace's time model changed: its tails' not-worth flags follow."""
        for slot in ns.keys.values():
            if self.tail[slot]:
                self.publish(slot)
