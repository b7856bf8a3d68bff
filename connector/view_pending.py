"""The PENDING keys of an engine's ``IndexView``: stores in flight, the daemon's or another
engine's claims, in a set and two dicts (``key -> slot``, ``slot -> key``) plus a mask of the
slots holding one (for the refresh's vectorized split, ``index_view.py``).

A burst of another engine's claims in the view's own namespace is thousands of PENDING entries,
and then as many commits over them. Through the view's per-entry loop each cost ~1.2 µs (a
table drop and probe, four dict and set writes: ~0.3 ms for a step's 256, on 2 loaded cores);
the entries that change only their own slot and key (``_claims``, ``_commits``) are done here
in C loops (``map``, ``dict.update(zip(...))``) and one mask write, and the loop runs over the
rest, in order (``_claims``: ~65-80 µs for 256 claims at a million slots, one core).
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import eq

import numpy as np
from kvoffload.connector.ready_table import ReadyTable


class PendingKeys:
    """The view's PENDING bookkeeping (a mixin of ``IndexView``, which owns ``ready``)."""

    ready: ReadyTable

    def _init_pending(self, num_slots: int) -> None:
        self.pending: set[bytes] = set()
        self._pending_slot: dict[bytes, int] = {}
        self._slot_pending: dict[int, bytes] = {}
        self._pmask = np.zeros(num_slots, dtype=bool)
        self._pm = self._pmask.data  # element writes in the per-key pass (~25 ns each)

    def _unpend(self, key: bytes) -> None:
        slot = self._pending_slot.pop(key, None)
        if slot is not None:
            self.pending.discard(key)
            if self._slot_pending.get(slot) == key:
                del self._slot_pending[slot]
                self._pm[slot] = False

    def _forget_pending(self, slots: np.ndarray) -> None:
        """``slots`` (unique) hold no PENDING key of ours any more."""
        if not self._slot_pending:
            return
        held = slots[self._pmask[slots]]
        self._pmask[held] = False
        for slot in held.tolist():
            old = self._slot_pending.pop(slot, None)
            if old is not None and self._pending_slot.get(old) == slot:
                del self._pending_slot[old]
                self.pending.discard(old)

    def _commits(self, slots: np.ndarray, keys: list[bytes], plain: np.ndarray) -> None:
        """Of ``plain`` (READY entries whose hash no other entry here has), those in a slot
        holding a PENDING key must commit that key: each is unpended (``_unpend`` of all, in
        C loops); one that is no commit (another key's slot, or its key pending elsewhere)
        is put back as it was and leaves ``plain``. A READY entry in an unheld slot stays
        ``plain`` only if its key is pending nowhere."""
        pending_slot, slot_pending = self._pending_slot, self._slot_pending
        held = self._pmask[slots]
        if pending_slot:
            unheld = np.nonzero(plain & ~held)[0].tolist()
            plain[unheld] = [keys[i] not in pending_slot for i in unheld]
        at = np.nonzero(plain & held)[0]
        if not len(at):
            return
        ks = keys if len(at) == len(keys) else [keys[i] for i in at.tolist()]
        ss = slots[at].tolist()
        n, none = len(ss), repeat(None)
        was_slot = list(map(pending_slot.pop, ks, none))
        was_key = list(map(slot_pending.pop, ss, none))
        ok = np.fromiter(map(eq, was_slot, ss), dtype=np.bool_, count=n)
        ok &= np.fromiter(map(eq, was_key, ks), dtype=np.bool_, count=n)
        if not ok.all():
            for i in np.flatnonzero(~ok).tolist():
                slot, key = was_slot[i], was_key[i]
                if slot is not None:
                    pending_slot[ks[i]] = slot
                if key is not None:
                    slot_pending[ss[i]] = key
            plain[at[~ok]] = False
            at, ks = at[ok], list(compress(ks, ok))
        self.pending.difference_update(ks)
        self._pmask[slots[at]] = False

    def _claims(self, slots: np.ndarray, keys: list[bytes], hashes: np.ndarray,
                claims: np.ndarray) -> np.ndarray:
        """Which of ``claims`` (PENDING entries whose hash no other entry here has) only pend
        their key in their slot, pended here at once. For such an entry the loop's steps are
        no-ops but the last, so this is what it would leave: a slot holding no PENDING key
        (nothing to unpend there) and no READY one (nothing to drop there: this is checked
        after the refresh's puts, which the loop follows too), no READY key with its hash
        (the loop drops that one: ``find`` is by hash; a probe ``absent`` cannot finish within
        its rounds counts as one), and a key pending nowhere (the loop unpends it there). An
        entry batched changes its own slot's and key's bookkeeping alone, and no other entry
        here has its slot or hash: it commutes with the loop's."""
        if not claims.any():
            return claims
        at = np.flatnonzero(claims & ~self._pmask[slots] & ~self.ready.holding(slots))
        at = at[self.ready.absent(hashes[at])]
        ks = keys if len(at) == len(keys) else [keys[i] for i in at.tolist()]
        pending_slot = self._pending_slot
        if pending_slot and ks and not pending_slot.keys().isdisjoint(ks):
            free = np.fromiter(map(pending_slot.__contains__, ks), dtype=np.bool_,
                               count=len(ks))
            np.logical_not(free, out=free)
            at, ks = at[free], list(compress(ks, free))
        out = np.zeros(len(slots), dtype=np.bool_)
        if not len(at):
            return out
        out[at] = True
        held = slots[at]
        ss = held.tolist()
        self._slot_pending.update(zip(ss, ks, strict=True))
        pending_slot.update(zip(ks, ss, strict=True))
        self.pending.update(ks)
        self._pmask[held] = True
        return out
