"""The engine's read-only view of the daemon's shared index (``daemon/store/shared_index.py``).

``IndexView`` maps the index file read-only and keeps, for one namespace, a compact table
``key -> (slot, ident)`` of READY blocks (``ready_table.py``) plus the set of PENDING keys.
``refresh()`` applies what the daemon changed since the last call (one integer read when nothing
did), vectorized: the changed entries are read in three gathers (sequence words, entries,
sequence words again, with load-load fences between), torn ones retried, and other namespaces'
entries cost one array probe each; entries that only make a key of ours READY go to the table
as one batch (``view_rows.py``, ``ReadyTable.put_many``), and those that only make one PENDING
(another engine's claims) to the PENDING bookkeeping as one (``view_pending.py``). Answering a
key is then a table probe, with no message and no system call. The applied position is the
epoch the manager reports to the daemon (``Step.epoch``): the daemon reclaims a freed slot only
once no engine can act on its old bytes.

**A budget that never leaves a held key behind** (issue 24). Every refresh reads all ring
records up to the head ``H`` it read and classifies their slots' current entries, vectorized:
an entry that only *adds* a key of ours -- in a slot holding no READY key here and no PENDING
one, or READY over the PENDING one it holds -- may wait in ``view_backlog.Backlog`` (slot
numbers, re-read when applied, so a slot that changed again is applied as it is then);
everything else (removals, reassignments, moves out of a slot, flag changes, other
namespaces) is applied in this refresh, whatever the budget. So after any refresh:

1. *A READY answer is never stale.* A slot answered READY holds a key here, so its every
   record up to ``H`` was applied from an entry read after ``H`` (torn entries: below).
2. ``applied`` may therefore be ``H`` while additions wait. The daemon reclaims a slot
   retired at epoch ``F`` only once our reported epoch is ``>= F``; the slot lost a key we
   may hold READY, and that removal was applied before ``applied`` passed ``F`` (1). A
   waiting addition is nothing we act on: its key answers MISS (or stays PENDING) until it
   is applied, and a slot re-read later shows an entry at least as new as ``H``, which is
   what a reader ahead of its epoch already did. The Dekker pattern with the busy record is
   unchanged (the record, the fence, then ``H`` and the entries).
3. *The ring cannot lap us*: the backlog holds slots, not positions, and each refresh reads
   every record; a rescan only when ``cap`` records came between two refreshes.
4. *Own stores*: a slot waiting ``lags``; ``own_stores.settle`` leaves its key alone (its
   claim or commit may be what waits), and settles every other key as before.
5. *Moves*: a key READY in a new slot waits there, while its old slot's removal (a held slot)
   is applied: at worst a MISS for a few steps, never a READY answer from the old slot once
   its removal was read.

An entry read mid-write four times keeps the view's last consistent state and waits too: its
write's record lies at or after ``H`` (its ring record follows the entry), so the next
refresh reads it; one that followed a retirement we have read is a reuse of the slot, which
our busy record at an older epoch prevents (docs/architecture.md, "Invariants").

The mapping itself, and ``SlotGenerations`` (the worker's part: slots' ident words after a
copy), are ``index_map.py``'s; both names are imported from here too.
"""

from __future__ import annotations

import time
from itertools import compress
from pathlib import Path

import numpy as np
from kvoffload.connector import view_rows
from kvoffload.connector.index_map import ENTRY_DTYPE, IndexGone, Mapped, SlotGenerations
from kvoffload.connector.ready_table import ReadyTable
from kvoffload.connector.view_backlog import Backlog
from kvoffload.connector.view_few import REFRESH_FEW, FewEntries, ring_records
from kvoffload.connector.view_pending import PendingKeys
from kvoffload.daemon.store import fence
from kvoffload.daemon.store import shared_index as si

__all__ = ["IndexGone", "IndexView", "SlotGenerations"]  # the two from index_map too

_RETRIES = 4
# A refresh reads every ring record since the last one and applies at once everything that
# changes what the view holds; additions of keys it does not hold yet get this budget (past
# REFRESH_AT_LEAST of them), in chunks of REFRESH_CHUNK slots, a chunk only while it would end
# by the deadline as the last one took; the rest waits for the next steps. 0.5 ms: with the
# classification of a 10,000-record burst (~0.4 ms), the longest refresh measured ~0.7-1.2 ms
# on 2 loaded cores (issue 24). 256 slots: a chunk's numpy calls cost ~0.1 ms whatever its
# size, and its additions ~0.5 µs a key (a commit over a PENDING key ~1 µs: the dicts).
REFRESH_BUDGET_S = 0.0005
REFRESH_CHUNK = 256
# Additions applied in every refresh whatever the budget: a step's own few (another engine's
# commits of a request or two) never wait, so a loaded host's slow refresh does not turn them
# into misses; only a burst beyond this is spread over steps. ~0.2-0.35 ms for 256, as one
# batch (``_plain``), from the entries ``_take`` read when nothing older waits.
REFRESH_AT_LEAST = 256


class IndexView(Mapped, PendingKeys, FewEntries):
    """One namespace's blocks, as the daemon last published them."""

    def __init__(self, path: str | Path, namespace: int, daemon_id: str | None = None) -> None:
        super().__init__(path, daemon_id)
        self.namespace = namespace
        # READY keys in flat arrays, no object per key (``ready_table.py``: why, and why a
        # hash suffices); PENDING keys, few (stores in flight), in a set and two dicts, and
        # which slots hold one (``view_pending.py``).
        self.ready = ReadyTable(self.num_slots, self._key_at)
        self._init_pending(self.num_slots)
        self._mine = np.zeros(self.num_slots, dtype=bool)  # slots that held one of our keys
        # Slots whose entry the view may not show yet: additions waiting for a budget, and
        # entries read mid-write.
        self.backlog = Backlog(self.num_slots)
        self._owed = False  # backlog or tombstones left: a refresh has work without a change
        self.applied = 0  # ring position read and classified: the epoch this view reflects
        self.seen = 0  # the head the latest refresh read
        self.budget_s = REFRESH_BUDGET_S
        self.few = REFRESH_FEW  # ring records a refresh applies entry by entry (view_few.py)
        self.rescans = 0
        self.torn = 0  # entries read mid-write (kept for later: their ring record comes later)
        self._rescan()

    # -- reading entries ------------------------------------------------------------------

    def _read(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Entries of ``slots`` read under their sequence locks: (rows, consistent mask)."""
        table = self._table()
        raw = np.frombuffer(self.mm, dtype=np.uint8, count=self.num_slots * si.ENTRY_BYTES,
                            offset=si.HEADER_BYTES).reshape(self.num_slots, si.ENTRY_BYTES)
        seq = table["seq"][slots]
        fence.load_load()  # the sequence words before the fields ...
        # Whole entries as bytes (one memcpy of 64 B each: ~20x a structured gather).
        rows = np.take(raw, slots, axis=0).view(ENTRY_DTYPE).reshape(-1)
        fence.load_load()  # ... and the fields before the second read of the words
        again = table["seq"][slots]
        del table, raw
        return rows, (seq == again) & (seq & 1 == 0) & (rows["seq"] == seq)

    def _key_at(self, slot: int) -> bytes | None:
        """The key the table holds in ``slot`` now, read consistently (iteration only)."""
        _, rows, _ = self._consistent(np.array([slot], dtype=np.int64))
        if not len(rows) or rows["ns"][0] != self.namespace:
            return None
        return rows["key"][0].tobytes()[:int(rows["keylen"][0])]

    def _forget(self, slots: np.ndarray) -> None:
        """``slots`` (unique, ours before) hold none of our keys any more: vectorized, so a
        burst of evictions costs ~nothing per key (``ReadyTable.drop_many``)."""
        if not len(slots):
            return
        self._mine[slots] = False
        self.ready.drop_many(slots)
        self._forget_pending(slots)

    def _consistent(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slots, rows) read consistently, and the slots caught mid-write: each is read
        again a few times, then left (its ring record, after the head this refresh read,
        comes later)."""
        rows, ok = self._read(slots)
        for _ in range(_RETRIES):
            if ok.all():
                return slots, rows, slots[:0]
            torn = ~ok
            again, ok_again = self._read(slots[torn])
            rows[torn] = again
            ok[torn] = ok_again
        self.torn += int((~ok).sum())
        return slots[ok], rows[ok], slots[~ok]

    def _ours(self, rows: np.ndarray) -> np.ndarray:
        return (rows["ns"] == self.namespace) & (rows["state"] >= si.PENDING) \
            & (rows["state"] <= si.READY) & (rows["keylen"] > 0)

    def _apply(self, slots: np.ndarray) -> None:
        """Apply the current entries of ``slots`` (unique), whatever they add."""
        slots, rows, torn = self._consistent(slots)
        self.backlog.add(torn)
        self._apply_rows(slots, rows, self._ours(rows))

    def _apply_rows(self, slots: np.ndarray, rows: np.ndarray, ours: np.ndarray) -> None:
        """Ours set, the rest forgotten."""
        gone = slots[~ours]
        self._forget(gone[self._mine[gone]])  # other namespaces: one probe each
        mine = rows[ours]
        if not len(mine):
            return
        mine_slots = slots[ours]
        keys = view_rows.keys_of(mine)
        hashes = view_rows.hashes_of(keys)
        states = mine["state"]
        plain = self._plain(mine_slots, states, keys, hashes)
        if plain.any():  # at once (a burst's commits): no call per key
            self.ready.put_many(mine_slots[plain], hashes[plain], mine["ident"][plain],
                                mine["flags"][plain] & si.FLAG_NOT_WORTH != 0)
        # A burst's claims at once too (after the puts, which they commute with: what they
        # see is what the loop would).
        claims = states != si.READY
        if claims.any():  # no key twice (nor its hash), as for ``_plain``
            claims &= view_rows.alone(hashes)
        done = plain | self._claims(mine_slots, keys, hashes, claims)
        if done.any():
            rest = ~done
            mine, mine_slots = mine[rest], mine_slots[rest]
            keys = list(compress(keys, rest.tolist()))
        # The rest in one pass, in order (``_in_order``).
        self._in_order(mine_slots.tolist(), keys, mine["ident"].tolist(),
                       mine["state"].tolist(), mine["flags"].tolist())
        self._mine[slots[ours]] = True

    def _in_order(self, slots: list[int], keys: list[bytes], idents: list[int],
                  states: list[int], flags_of: list[int]) -> None:
        """Entries of ours applied one by one, in order, no call per entry but the table's:
        the reference every batched path must agree with. A key lives in one slot: READY here
        drops it from PENDING anywhere, and PENDING here drops it from READY anywhere."""
        ready, pending, pm = self.ready, self.pending, self._pm
        pending_slot, slot_pending = self._pending_slot, self._slot_pending
        put, drop, find, unpend = ready.put, ready.drop, ready.find, self._unpend
        ready_state, no_worth = si.READY, si.FLAG_NOT_WORTH
        for slot, key, ident, state, flags in zip(slots, keys, idents, states, flags_of,
                                                  strict=True):
            old = slot_pending.get(slot)
            if old is not None and old != key:
                if pending_slot.get(old) == slot:
                    unpend(old)
                else:
                    del slot_pending[slot]
                    pm[slot] = False
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
                pm[slot] = True
                pending_slot[key] = slot
                pending.add(key)

    def _plain(self, slots: np.ndarray, states: np.ndarray, keys: list[bytes],
               hashes: np.ndarray) -> np.ndarray:
        """Which entries only make their key READY in their slot: a key no other entry here
        has (nor its hash), pending nowhere, in a slot holding no PENDING key --
        or the commit of the PENDING key its slot holds (unpended here, ``_commits``). What
        they change is their own slot's and key's alone, so they commute with the other
        entries': the table puts them at once (``ReadyTable.put_many``), and the loop applies
        the rest in order."""
        plain = (states == si.READY) & view_rows.alone(hashes)
        if (self._slot_pending or self._pending_slot) and plain.any():
            self._commits(slots, keys, plain)
        return plain

    # -- what may wait --------------------------------------------------------------------

    def _take(self, slots: np.ndarray) -> int:
        """Apply the ring's changed ``slots`` (unique) now, except what only adds a key: an
        entry of ours in a slot that holds no READY key here and no PENDING one (or holds a
        PENDING one and is READY now) goes to the backlog. So nothing the view answers READY
        is ever left behind its entry: every removal, reassignment, move out of a slot and
        change of flags is applied in the step that reads it (the argument: module top).

        When nothing older waits, the first ``REFRESH_AT_LEAST`` additions -- what the drain
        would take first -- are applied from the entries read here, not read again. Returns
        how many additions that was."""
        slots, rows, torn = self._consistent(slots)
        self.backlog.add(torn)
        ours = self._ours(rows)
        wait = ours & ~self.ready.holding(slots) \
            & (~self._pmask[slots] | (rows["state"] == si.READY))
        added = 0
        if wait.any():
            if not self.backlog:
                later = np.flatnonzero(wait)[REFRESH_AT_LEAST:]
                added = int(np.count_nonzero(wait)) - len(later)
                wait = np.zeros_like(wait)
                wait[later] = True
            self.backlog.add(slots[wait])
            now = ~wait
            slots, rows, ours = slots[now], rows[now], ours[now]
        self._apply_rows(slots, rows, ours)
        return added

    def _drain(self, deadline: float, least: int) -> None:
        """Apply waiting slots' *current* entries, a chunk at a time while the next one would
        end by ``deadline`` as the last one took (``least`` of them whatever it is), at most
        those that waited when it started (one read mid-write goes back, to the end)."""
        todo, done, last = len(self.backlog), 0, 0.0
        while todo > 0 and self.backlog:
            if done >= least and time.perf_counter() + last >= deadline:
                break
            chunk = self.backlog.take(REFRESH_CHUNK)
            todo -= len(chunk)
            done += len(chunk)
            start = time.perf_counter()
            self._apply(chunk)
            last = time.perf_counter() - start

    def lags(self, slot: int) -> bool:
        """The view may not show ``slot``'s entry as of the head it read yet (it waits in the
        backlog): own stores are not settled against it (``own_stores.settle``)."""
        return self.backlog.lags(slot)

    def _rescan(self) -> None:
        """Read the whole table (at attach, or after falling a whole ring behind).

        Nothing is cleared first: every slot that is ours, was ours, or was being written
        during the scan is read consistently (``_apply``), so a key mid-rewrite keeps its last
        consistent state instead of vanishing for a step. Everything is applied (the attach
        thread waits for it; a lapped view has lost the ring's record of what changed)."""
        head = self.head()
        fence.load_load()  # the head before the entries it covers
        table = self._table()
        seq = table["seq"].copy()
        fence.load_load()
        maybe = (table["ns"] == self.namespace) & (table["state"] >= si.PENDING)
        fence.load_load()
        moving = (seq & 1 == 1) | (table["seq"] != seq)
        del table
        self.backlog.clear()  # what waited is read now, with everything else that is ours
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
        """The latest refresh applied everything up to the head it read (nothing waits)."""
        return self.applied == self.seen and not self.backlog

    def refresh(self) -> int:
        """Apply the daemon's changes since the last call: all of them but additions of keys,
        which get ``budget_s`` (past ``REFRESH_AT_LEAST``; the rest waits for the next calls).
        Returns how many ring records were read (the epoch moved by that much)."""
        head = self.head()
        self.seen = head
        start = self.applied
        if head == start and not self._owed:
            return 0
        cap = self.ring_capacity
        if head - start >= cap:
            self._rescan()
            return head - start
        fence.load_load()  # the head before the ring records and entries it covers
        deadline = time.perf_counter() + self.budget_s
        added = 0
        if head != start and head - start <= self.few and not self.backlog:
            few = sorted(set(ring_records(self.mm, self.ring_off, cap, start, head)))
            fence.load_load()
            if self.head() - start >= cap:  # overwritten while we read: as below
                self._rescan()
                return head - start
            if few and few[-1] >= self.num_slots:
                few = [s for s in few if s < self.num_slots]
            if len(few) <= REFRESH_AT_LEAST:
                added = self._take_few(few)
                self.applied = head
        if head != self.applied:
            ring = np.frombuffer(self.mm, dtype="<u4", count=cap, offset=self.ring_off)
            lo, hi = start % cap, head % cap
            slots = ring[lo:hi].copy() if lo < hi else np.concatenate((ring[lo:], ring[:hi]))
            del ring
            fence.load_load()
            # Overwritten while we read (the write at ``head`` may have stored its record
            # before its head): start over.
            if self.head() - start >= cap:
                self._rescan()
                return head - start
            # Each slot once: its current entry is what counts. Sorted by hand: np.unique
            # imports a module on first use (~20 ms, on the engine's step).
            slots = np.sort(slots)
            if len(slots) > 1:
                slots = slots[np.concatenate(([True], slots[1:] != slots[:-1]))]
            added = self._take(slots[slots < self.num_slots].astype(np.int64))
            self.applied = head
        self._drain(deadline, REFRESH_AT_LEAST - added)
        if self.ready.tombs:
            self.ready.purge(deadline)
        self._owed = bool(self.backlog or self.ready.tombs)
        return head - start
