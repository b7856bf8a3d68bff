"""The daemon's shared index file (``daemon/store/shared_index.py``), mapped read-only.

``Mapped`` checks the file is the live daemon's (magic, version, daemon id, size) and reads its
header words; its slot table is a structured array over the mapping (``ENTRY_DTYPE``).
``IndexView`` (``index_view.py``) is the scheduler's part. ``SlotGenerations`` is the worker's
part: it reads slots' ident words (generation and key tag, one aligned 8-byte load each) to
prove, after a copy, that no slot was handed to another writer while it was being read, and
(``waiting_mask``) which earmarked store slots the daemon has not handed over yet.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
from kvoffload.daemon.store import fence
from kvoffload.daemon.store import shared_index as si

ENTRY_DTYPE = np.dtype([("seq", "<u4"), ("ns", "<u2"), ("state", "u1"), ("flags", "u1"),
                        ("ident", "<u8"), ("keylen", "u1"), ("pad", "V7"), ("key", "V40")])
assert ENTRY_DTYPE.itemsize == si.ENTRY_BYTES
_MASK = np.uint64(si.GEN_MASK)
_HALF = np.uint64(32)


class IndexGone(RuntimeError):
    """The index file is not (or no longer) the live daemon's."""


class Mapped:
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
        return np.frombuffer(self.mm, dtype=ENTRY_DTYPE, count=self.num_slots,
                             offset=si.HEADER_BYTES)

    def superseded(self) -> bool:
        return bool(si.SEQ.unpack_from(self.mm, si.FLAGS_OFFSET)[0] & si.FLAG_SUPERSEDED)

    def head(self) -> int:
        return si.U64.unpack_from(self.mm, si.HEAD_OFFSET)[0]

    def heartbeat_ns(self) -> int:
        return si.U64.unpack_from(self.mm, si.HEARTBEAT_OFFSET)[0]

    def close(self) -> None:
        self.mm.close()


class SlotGenerations(Mapped):
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
        read = self._idents(slots)
        if read is None:
            return np.zeros(len(slots), dtype=bool)
        ok, current = read
        want = np.asarray(idents).astype(np.uint64, copy=False)
        if key_bound:
            # An ident without a key tag (a caller that knows only the generation: tests and
            # benches that drive the worker directly) checks the generation half.
            current = np.where(want >> _HALF != 0, current, current & _MASK)
        else:
            current, want = current & _MASK, want & _MASK
        return ok & (current == want)

    def waiting_mask(self, slots: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """Which store slots granted at ``gens`` are earmarked and not handed over yet: their
        generation is still exactly the one before the grant's (``(gen - 1) & GEN_MASK``).
        All False when the index is superseded (nothing there is waited for any more).

        The generation half of one aligned 8-byte load per slot, after the load-load fence,
        as in ``intact_mask``. Only a hint for when to try: what the worker writes is decided
        by ``intact_mask`` under the writers' lock."""
        read = self._idents(slots)
        if read is None:
            return np.zeros(len(slots), dtype=bool)
        ok, current = read
        want = (np.asarray(gens).astype(np.uint64, copy=False) - np.uint64(1)) & _MASK
        return ok & ((current & _MASK) == want)

    def _idents(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(in range, ident words) of ``slots`` (0 where out of range); None when the index is
        superseded or no slot is in range. The load-load fence comes first."""
        fence.load_load()
        slots = np.asarray(slots, dtype=np.int64)
        ok = (slots >= 0) & (slots < self.num_slots)
        if self.superseded() or not ok.any():
            return None
        table = self._table()
        current = table["ident"][np.where(ok, slots, 0)]
        del table  # no view may outlive the call: close() unmaps
        return ok, current
