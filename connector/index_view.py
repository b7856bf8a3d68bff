"""The engine's read-only view of the daemon's shared index (``daemon/store/shared_index.py``).

``IndexView`` maps the index file read-only and keeps, for one namespace, a local dict
``key -> (slot, ident)`` of READY blocks plus the set of PENDING keys. ``refresh()`` applies what
the daemon changed since the last call (one integer read when nothing did), vectorized: the
changed entries are read in three gathers (sequence words, entries, sequence words again, with
load-load fences between), torn ones retried, and other namespaces' entries cost one array
probe each. Answering a key is then a dict lookup, with no message and no system call. The
applied position is the epoch the manager reports to the daemon (``Step.epoch``), which is what
lets the daemon reclaim a freed slot only once no engine can still act on its old contents.

``SlotGenerations`` is the worker's part: it reads slots' ident words (generation and key tag,
one aligned 8-byte load each) to prove, after a copy, that no slot was handed to another writer
while it was being read.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np
from kvoffload.connector.ready_table import ReadyTable
from kvoffload.daemon.store import fence
from kvoffload.daemon.store import shared_index as si

_ENTRY_DTYPE = np.dtype([("seq", "<u4"), ("ns", "<u2"), ("state", "u1"), ("flags", "u1"),
                         ("ident", "<u8"), ("keylen", "u1"), ("pad", "V7"), ("key", "V40")])
assert _ENTRY_DTYPE.itemsize == si.ENTRY_BYTES
_MASK = np.uint64(si.GEN_MASK)
_RETRIES = 4
_HALF = np.uint64(32)
# A refresh may apply ring records in chunks until ``budget_s`` is spent (the first chunk
# always; more when the ring would otherwise lap the view), spreading a burst of another
# engine's commits over steps. Off by default: a lagging view answers stale READY keys whose
# loads then fail their check and are recomputed (0 wrong bytes, but 4-6 failed loads per
# trace replay where there were none, issue 25's trace suite), and new keys read as misses.
# Applying keys READY-first within a budget is the design still owed (issue 24).
REFRESH_BUDGET_S = float("inf")
REFRESH_CHUNK = 128


class IndexGone(RuntimeError):
    """The index file is not (or no longer) the live daemon's."""


class _Mapped:
    def __init__(self, path: str | Path, daemon_id: str | None) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size < si.HEADER_BYTES:
                raise IndexGone(f"{path} is not a kvoffload index")
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, _flags, self.num_slots, self.ring_capacity, _head, _hb, did = \
            si.HEADER.unpack_from(self.mm, 0)
        if magic != si.MAGIC or version != si.VERSION:
            raise IndexGone(f"{path}: unknown index format")
        self.daemon_id = did.rstrip(b"\0").decode()
        if daemon_id is not None and self.daemon_id != daemon_id:
            raise IndexGone(f"{path} belongs to daemon {self.daemon_id}, not {daemon_id}")
        self.ring_off = si.HEADER_BYTES + self.num_slots * si.ENTRY_BYTES
        if size < self.ring_off + 4 * self.ring_capacity:
            raise IndexGone(f"{path} is truncated")

    def _table(self) -> np.ndarray:
        """The slot table as a structured array over the mapping (no copy): callers drop it
        before returning, since ``close()`` unmaps."""
        return np.frombuffer(self.mm, dtype=_ENTRY_DTYPE, count=self.num_slots,
                             offset=si.HEADER_BYTES)

    def superseded(self) -> bool:
        return bool(si.SEQ.unpack_from(self.mm, si.FLAGS_OFFSET)[0] & si.FLAG_SUPERSEDED)

    def head(self) -> int:
        return si.U64.unpack_from(self.mm, si.HEAD_OFFSET)[0]

    def heartbeat_ns(self) -> int:
        return si.U64.unpack_from(self.mm, si.HEARTBEAT_OFFSET)[0]

    def close(self) -> None:
        self.mm.close()


class SlotGenerations(_Mapped):
    """A worker's check that slots still belong to the writer (and key) it copied for."""

    def intact(self, slot: int, ident: int, *, key_bound: bool = True) -> bool:
        return bool(self.intact_mask(np.array([slot]), np.array([ident], dtype=np.uint64),
                                     key_bound=key_bound)[0])

    def intact_mask(self, slots: np.ndarray, idents: np.ndarray, *,
                    key_bound: bool = True) -> np.ndarray:
        """Which slots still hold ``idents``: the whole ident word (generation and key tag,
        ``key_bound``: loads) or its generation half (stores: the key may not be claimed yet).

        One aligned 8-byte load per slot (numpy's gather of an aligned u8 column): a torn
        (key, generation) pair cannot be read. The load-load fence first: the copy's reads of
        the pool are ordered before these (``fence.py``)."""
        fence.load_load()
        slots = np.asarray(slots, dtype=np.int64)
        ok = (slots >= 0) & (slots < self.num_slots)
        if self.superseded() or not ok.any():
            return np.zeros(len(slots), dtype=bool)
        table = self._table()
        current = table["ident"][np.where(ok, slots, 0)]
        del table  # no view may outlive the call: close() unmaps
        want = np.asarray(idents).astype(np.uint64, copy=False)
        if key_bound:
            # An ident without a key tag (a caller that knows only the generation: tests and
            # benches that drive the worker directly) checks the generation half.
            current = np.where(want >> _HALF != 0, current, current & _MASK)
        else:
            current, want = current & _MASK, want & _MASK
        return ok & (current == want)


class IndexView(_Mapped):
    """One namespace's blocks, as the daemon last published them."""

    def __init__(self, path: str | Path, namespace: int, daemon_id: str | None = None) -> None:
        super().__init__(path, daemon_id)
        self.namespace = namespace
        # READY keys in flat arrays, no object per key (``ready_table.py``: why, and why a
        # hash suffices); PENDING keys, few (stores in flight), in a set and two dicts.
        self.ready = ReadyTable(self.num_slots, self._key_at)
        self.pending: set[bytes] = set()
        self._pending_slot: dict[bytes, int] = {}
        self._slot_pending: dict[int, bytes] = {}
        self._mine = np.zeros(self.num_slots, dtype=bool)  # slots that held one of our keys
        self.applied = 0  # ring position applied: the epoch this view reflects
        self.seen = 0  # the head the latest refresh read: ``applied`` < ``seen`` while lagging
        self.budget_s = REFRESH_BUDGET_S
        self.rescans = 0
        self.torn = 0  # entries read mid-write (skipped: their ring record comes later)
        self._rescan()

    # -- reading entries ------------------------------------------------------------------

    def _read(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Entries of ``slots`` read under their sequence locks: (rows, consistent mask)."""
        table = self._table()
        seq = table["seq"][slots]
        fence.load_load()  # the sequence words before the fields ...
        rows = table[slots]
        fence.load_load()  # ... and the fields before the second read of the words
        again = table["seq"][slots]
        del table
        return rows, (seq == again) & (seq & 1 == 0) & (rows["seq"] == seq)

    def _key_at(self, slot: int) -> bytes | None:
        """The key the table holds in ``slot`` now, read consistently (iteration only)."""
        _, rows = self._consistent(np.array([slot], dtype=np.int64))
        if not len(rows) or rows["ns"][0] != self.namespace:
            return None
        return rows["key"][0].tobytes()[:int(rows["keylen"][0])]

    def _unpend(self, key: bytes) -> None:
        slot = self._pending_slot.pop(key, None)
        if slot is not None:
            self.pending.discard(key)
            if self._slot_pending.get(slot) == key:
                del self._slot_pending[slot]

    def _forget_slot(self, slot: int) -> None:
        self._mine[slot] = False
        self.ready.drop(slot)
        old = self._slot_pending.pop(slot, None)
        if old is not None and self._pending_slot.get(old) == slot:
            del self._pending_slot[old]
            self.pending.discard(old)

    def _consistent(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slots, rows) read consistently; an entry mid-write is read again a few times,
        then skipped (its ring record, after the head this refresh read, comes later)."""
        rows, ok = self._read(slots)
        for _ in range(_RETRIES):
            if ok.all():
                return slots, rows
            torn = ~ok
            again, ok_again = self._read(slots[torn])
            rows[torn] = again
            ok[torn] = ok_again
        self.torn += int((~ok).sum())
        return slots[ok], rows[ok]

    def _apply(self, slots: np.ndarray) -> None:
        """Apply the current entries of ``slots`` (unique): ours set, the rest forgotten."""
        slots, rows = self._consistent(slots)
        ours = (rows["ns"] == self.namespace) & (rows["state"] >= si.PENDING) \
            & (rows["state"] <= si.READY) & (rows["keylen"] > 0)
        gone = slots[~ours]
        for slot in gone[self._mine[gone]].tolist():  # other namespaces: one probe each
            self._forget_slot(slot)
        mine = rows[ours]
        if not len(mine):
            return
        width = mine.dtype["key"].itemsize
        raw = mine["key"].tobytes()
        mine_slots = slots[ours]
        # One pass, no call per entry but the table's (the cost of a burst in our own
        # namespace). A key lives in one slot: READY here drops it from PENDING anywhere, and
        # PENDING here drops it from READY anywhere.
        ready, pending = self.ready, self.pending
        pending_slot, slot_pending = self._pending_slot, self._slot_pending
        put, drop, find, unpend = ready.put, ready.drop, ready.find, self._unpend
        ready_state, no_worth = si.READY, si.FLAG_NOT_WORTH
        for i, (slot, ident, state, flags, n) in enumerate(zip(
                mine_slots.tolist(), mine["ident"].tolist(), mine["state"].tolist(),
                mine["flags"].tolist(), mine["keylen"].tolist(), strict=True)):
            key = raw[i * width:i * width + n]
            old = slot_pending.get(slot)
            if old is not None and old != key:
                if pending_slot.get(old) == slot:
                    unpend(old)
                else:
                    del slot_pending[slot]
            if state == ready_state:
                if key in pending_slot:
                    unpend(key)
                put(slot, key, ident, bool(flags & no_worth))
            else:
                drop(slot)
                elsewhere = find(key)
                if elsewhere >= 0:
                    drop(elsewhere)
                if pending_slot.get(key, slot) != slot:
                    unpend(key)
                slot_pending[slot] = key
                pending_slot[key] = slot
                pending.add(key)
        self._mine[mine_slots] = True

    def _rescan(self) -> None:
        """Read the whole table (at attach, or after falling a whole ring behind).

        Nothing is cleared first: every slot that is ours, was ours, or was being written
        during the scan is read consistently (``_apply``), so a key mid-rewrite keeps its last
        consistent state instead of vanishing for a step."""
        head = self.head()
        fence.load_load()  # the head before the entries it covers
        table = self._table()
        seq = table["seq"].copy()
        fence.load_load()
        maybe = (table["ns"] == self.namespace) & (table["state"] >= si.PENDING)
        fence.load_load()
        moving = (seq & 1 == 1) | (table["seq"] != seq)
        del table
        self._apply(np.nonzero(maybe | moving | self._mine)[0])
        self.applied = head
        self.rescans += 1
        self.refresh()

    def slot_of(self, key: bytes) -> int | None:
        """The slot a READY or PENDING key is in."""
        slot = self.ready.find(key)
        return slot if slot >= 0 else self._pending_slot.get(key)

    def declines(self, key: bytes) -> bool:
        """A READY tail the daemon declines to serve: its load cannot repay its bytes."""
        slot = self.ready.find(key)
        return slot >= 0 and self.ready.declined(slot)

    # -- the per-step call ----------------------------------------------------------------

    @property
    def caught_up(self) -> bool:
        """The latest refresh applied everything up to the head it read."""
        return self.applied == self.seen

    def refresh(self) -> int:
        """Apply the daemon's changes since the last call, ``budget_s`` worth of them (at least
        one chunk; more when the ring would otherwise overrun us); returns how many ring records
        were applied."""
        head = self.head()
        self.seen = head
        start = self.applied
        if head == start:
            return 0
        cap = self.ring_capacity
        if head - start > cap:
            self._rescan()
            return head - start
        fence.load_load()  # the head before the ring records and entries it covers
        deadline = time.perf_counter() + self.budget_s
        must = head - cap // 2  # records up to here are applied now: the ring never laps us
        pos = start
        ring = np.frombuffer(self.mm, dtype="<u4", count=cap, offset=self.ring_off)
        try:
            while pos < head:
                end = min(head, max(pos + REFRESH_CHUNK, must))
                self._apply_records(ring, pos, end)
                pos = end
                if pos >= must and time.perf_counter() >= deadline:
                    break
        finally:
            del ring
        fence.load_load()
        if self.head() - start > cap:  # overwritten while we read: start over
            self._rescan()
            return head - start
        self.applied = pos
        return pos - start

    def _apply_records(self, ring: np.ndarray, pos: int, end: int) -> None:
        cap = self.ring_capacity
        lo, hi = pos % cap, end % cap
        slots = ring[lo:hi].copy() if lo < hi else np.concatenate((ring[lo:], ring[:hi]))
        # Each slot once: its current entry is what counts. Sorted by hand: np.unique imports a
        # module on first use (~20 ms, on the engine's step).
        slots = np.sort(slots)
        if len(slots) > 1:
            slots = slots[np.concatenate(([True], slots[1:] != slots[:-1]))]
        self._apply(slots[slots < self.num_slots].astype(np.int64))
