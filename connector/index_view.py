"""The engine's read-only view of the daemon's shared index (``daemon/store/shared_index.py``).

``IndexView`` maps the index file read-only and keeps, for one namespace, a local dict
``key -> (slot, gen)`` of READY blocks plus the set of PENDING keys. ``refresh()`` applies what
the daemon changed since the last call (one integer read when nothing did); answering a key is
then a dict lookup, with no message and no system call. The applied position is the epoch the
manager reports to the daemon (``Step.epoch``), which is what lets the daemon reclaim a freed
slot only once no engine can still act on its old contents.

``SlotGenerations`` is the worker's part: it reads one slot's generation to prove, after a
copy, that the slot was not handed to another writer while it was being read.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
from kvoffload.daemon.store import shared_index as si

_ENTRY_DTYPE = np.dtype([("seq", "<u4"), ("gen", "<u4"), ("ns", "<u2"), ("state", "u1"),
                         ("flags", "u1"), ("keylen", "u1"), ("pad", "V3"), ("key", "V40")])
assert _ENTRY_DTYPE.itemsize == si.ENTRY_BYTES


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

    def superseded(self) -> bool:
        return bool(si.SEQ.unpack_from(self.mm, si.FLAGS_OFFSET)[0] & si.FLAG_SUPERSEDED)

    def head(self) -> int:
        return si.U64.unpack_from(self.mm, si.HEAD_OFFSET)[0]

    def heartbeat_ns(self) -> int:
        return si.U64.unpack_from(self.mm, si.HEARTBEAT_OFFSET)[0]

    def close(self) -> None:
        self.mm.close()


class SlotGenerations(_Mapped):
    """A worker's check that a slot still belongs to the writer generation it copied."""

    def intact(self, slot: int, gen: int) -> bool:
        if not 0 <= slot < self.num_slots or self.superseded():
            return False
        off = si.HEADER_BYTES + slot * si.ENTRY_BYTES + 4
        return si.SEQ.unpack_from(self.mm, off)[0] == gen & 0xFFFFFFFF

    def intact_mask(self, slots: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """``intact`` for many slots at once (a job's hundreds: ~0.5 us each one by one, on the
        engine's step): one aligned 4-byte read per slot, as ``intact``'s, through numpy."""
        slots = np.asarray(slots, dtype=np.int64)
        ok = (slots >= 0) & (slots < self.num_slots)
        if self.superseded() or not ok.any():
            return np.zeros(len(slots), dtype=bool)
        table = np.frombuffer(self.mm, dtype=_ENTRY_DTYPE, count=self.num_slots,
                              offset=si.HEADER_BYTES)
        current = table["gen"][np.where(ok, slots, 0)]
        del table  # no view may outlive the call: close() unmaps
        return ok & (current == (np.asarray(gens, dtype=np.int64) & 0xFFFFFFFF))


class IndexView(_Mapped):
    """One namespace's blocks, as the daemon last published them."""

    def __init__(self, path: str | Path, namespace: int, daemon_id: str | None = None) -> None:
        super().__init__(path, daemon_id)
        self.namespace = namespace
        self.ready: dict[bytes, tuple[int, int]] = {}  # key -> (slot, gen)
        self.pending: set[bytes] = set()
        self.not_worth: set[bytes] = set()  # ready tails the daemon declines to serve
        self._slot_key: dict[int, bytes] = {}
        self._key_slot: dict[bytes, int] = {}
        self.applied = 0  # ring position applied: the epoch this view reflects
        self.rescans = 0
        self._rescan()

    # -- reading entries ------------------------------------------------------------------

    def _entry(self, slot: int) -> tuple[int, int, int, int, bytes] | None:
        """(gen, ns, state, flags, key) of a slot, or None while the daemon is writing it."""
        off = si.HEADER_BYTES + slot * si.ENTRY_BYTES
        for _ in range(8):
            seq, gen, ns, state, flags, klen, key = si.ENTRY.unpack_from(self.mm, off)
            if seq & 1 or si.SEQ.unpack_from(self.mm, off)[0] != seq:
                continue
            return gen, ns, state, flags, key[:klen]
        return None  # a writer in the middle: its ring record comes after this one

    def _forget_slot(self, slot: int) -> None:
        old = self._slot_key.pop(slot, None)
        if old is not None and self._key_slot.get(old) == slot:
            del self._key_slot[old]
            self.ready.pop(old, None)
            self.pending.discard(old)
            self.not_worth.discard(old)

    def _set(self, slot: int, gen: int, state: int, flags: int, key: bytes) -> None:
        self._forget_slot(slot)
        if not key:
            return
        self._slot_key[slot] = key
        self._key_slot[key] = slot
        self.not_worth.discard(key)
        if state == si.READY:
            self.pending.discard(key)
            self.ready[key] = (slot, gen)
            if flags & si.FLAG_NOT_WORTH:
                self.not_worth.add(key)
        else:
            self.ready.pop(key, None)
            self.pending.add(key)

    def _apply(self, slot: int) -> None:
        entry = self._entry(slot)
        if entry is None:
            return
        gen, ns, state, flags, key = entry
        if ns != self.namespace or state not in (si.PENDING, si.READY):
            self._forget_slot(slot)
        else:
            self._set(slot, gen, state, flags, key)

    def _rescan(self) -> None:
        """Read the whole table (at attach, or after falling a whole ring behind)."""
        head = self.head()
        table = np.frombuffer(self.mm, dtype=_ENTRY_DTYPE, count=self.num_slots,
                              offset=si.HEADER_BYTES).copy()
        self.ready.clear()
        self.pending.clear()
        self.not_worth.clear()
        self._slot_key.clear()
        self._key_slot.clear()
        mine = np.nonzero((table["ns"] == self.namespace) & (table["state"] >= si.PENDING)
                          & (table["state"] <= si.READY) & (table["keylen"] > 0))[0]
        keys, gens = table["key"], table["gen"]
        for slot in mine.tolist():
            row = table[slot]
            self._set(slot, int(gens[slot]), int(row["state"]), int(row["flags"]),
                      bytes(keys[slot])[:int(row["keylen"])])
        # Rows torn by a concurrent write are rewritten by the ring records after ``head``.
        self.applied = head
        self.rescans += 1
        self.refresh()

    def slot_of(self, key: bytes) -> int | None:
        """The slot a READY or PENDING key is in."""
        return self._key_slot.get(key)

    # -- the per-step call ----------------------------------------------------------------

    def refresh(self) -> int:
        """Apply the daemon's changes since the last call; returns how many were applied."""
        head = self.head()
        start = self.applied
        if head == start:
            return 0
        cap = self.ring_capacity
        if head - start > cap:
            self._rescan()
            return head - start
        ring = np.frombuffer(self.mm, dtype="<u4", count=cap, offset=self.ring_off)
        lo, hi = start % cap, head % cap
        slots = ring[lo:hi] if lo < hi else np.concatenate((ring[lo:], ring[:hi]))
        seen: set[int] = set()
        for slot in reversed(slots.tolist()):  # newest first: each slot read once
            if slot not in seen:
                seen.add(slot)
                if slot < self.num_slots:
                    self._apply(slot)
        if self.head() - start > cap:  # overwritten while we read: start over
            self._rescan()
            return head - start
        self.applied = head
        return head - start
