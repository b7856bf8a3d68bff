"""Epoch-based reclamation: a freed slot is reused only once no engine can still act on it.

Engines answer vLLM from their view of the shared index (``daemon/store/shared_index.py``), which
trails the daemon by up to one step. A block evicted at epoch ``F`` may still be a HIT in an
engine whose view is at ``E < F``, and that engine's pin for it is already on its way. So a
READY slot that loses its key is *retired* at ``F``, not freed: it returns to the free list only
after every live reader has reported an epoch ``>= F`` (it then no longer has the key) and no
pin holds it. A pin that arrives for a retired slot whose generation still matches is honoured:
the bytes are intact until the slot is reused.

A reader's hold comes from two sources, combined per reader (``floor``):

* its ordered control messages: each ``Step`` carries the epoch of the view its pins were
  decided from, after those pins, so the daemon sees every pin before the epoch that releases
  its slot;
* its record in the readers file (``shared_index.py``): ``busy`` from its first index read of a
  scheduler step to the step's message, with the epoch it applied, and the count of messages
  sent. A record counts only when the daemon has processed every message it counts (else the
  last message's epoch holds); a record that is not busy holds nothing: between steps the
  manager has no decision in flight and re-reads the index before the next one. So an idle
  engine never holds freed slots back.

A reader holds slots for a short bound only (``hold_s``, default 0.25 s: a few scheduler
steps): loads are proved by the workers' post-copy check, so a reader that stays busy at an old
epoch -- frozen, stuck, or lying in its record -- is passed over once it has blocked the oldest
retired slot for that long; its retired slots are reclaimed, and its late loads fail cleanly and
recompute. One frozen engine never stalls every engine's stores.

**Revoked grants** (reserved or pending slots of a departed client) get a new generation at
once (its late commits are refused, its workers' pre-checks fail) and are *quarantined*: a
client whose workers hold its session file's lock (``session_file.py``) gets them back into the
free list only once ``writers_gone()`` -- no copy into them can still run; a client without
that lock (a non-vLLM client copying in its own process) waits one lease (``fence``).

**Ordering.** The reader marks its record busy, then (full fence) reads the index; the daemon
publishes a retirement, then (full fence, in ``floor``) reads the records. So either the daemon
sees the reader busy at an epoch before the retirement, or the reader's view already lacks the
key (Dekker's pattern; docs/architecture.md, "Memory ordering").
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from kvoffload.daemon.store import fence

HOLD_S = 0.25  # longest a reader's view may hold a retired slot back
QUARANTINE_CHECK_S = 0.02  # how often a quarantine's lock is tried (a system call each)


class Writers(Protocol):
    """Who may still write a quarantined slot (``session_file.SessionFile``)."""

    def writers_gone(self) -> bool: ...

    def read(self) -> tuple[int, int, int] | None: ...

    def close(self, *, remove: bool = True) -> None: ...


class Reader:
    __slots__ = ("record", "processed", "epoch", "held_at", "blocking_since")

    def __init__(self, record: Writers | None, epoch: int) -> None:
        self.record = record  # its session file (reader record), None for none
        self.processed = 0  # its messages the daemon has handled (Step count)
        self.epoch = epoch  # epoch of its last handled Step (or its registration)
        # The floor it showed last, and since when that floor first held a retired slot back
        # (kept until the floor moves, whether or not slots are waiting meanwhile).
        self.held_at: int | None = None
        self.blocking_since: float | None = None


class Reclaimer:
    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s
        self.readers: dict[bytes, Reader] = {}  # client identity -> its hold
        self._retired: deque[tuple[int, int]] = deque()  # (epoch, slot), epochs ascending
        self._fenced: list[tuple[float, int]] = []  # (reusable after, slot)
        self._quarantined: list[tuple[Writers, list[int]]] = []
        self._next_quarantine_check = 0.0
        self.held: set[int] = set()  # retired and past every reader, but still pinned
        self.passed_over = 0  # times a reader was passed over for holding too long

    def __len__(self) -> int:
        return len(self._retired) + len(self._fenced) + len(self.held) + self.quarantined

    @property
    def quarantined(self) -> int:
        return sum(len(slots) for _, slots in self._quarantined)

    def add_reader(self, identity: bytes, epoch: int, record: Writers | None = None) -> None:
        self.readers[identity] = Reader(record, epoch)

    def remove_reader(self, identity: bytes) -> Reader | None:
        return self.readers.pop(identity, None)

    def report(self, identity: bytes, epoch: int) -> None:
        """A reader's Step was handled: its pins are in, its view was at ``epoch``."""
        r = self.readers.get(identity)
        if r is not None:
            r.processed += 1
            r.epoch = max(r.epoch, epoch)

    @staticmethod
    def _floor_of(r: Reader) -> int | None:
        rec = r.record.read() if r.record is not None else None
        if rec is None:
            return r.epoch
        busy, epoch, sent = rec
        if sent > r.processed:  # decisions still queued on the socket: their view's epoch
            return r.epoch
        return epoch if busy else None

    def floor(self) -> int | None:
        """The oldest epoch some reader may still act on; None: nobody holds anything.

        A reader whose floor has not moved for ``hold_s`` since it first held a retired slot
        back is passed over: a step takes milliseconds, so an honest reader's floor moves (or
        it goes idle between steps) long before. The clock restarts only when its floor moves,
        so a frozen or lying reader is not granted a fresh bound with every new retirement."""
        fence.full()  # our retirements are visible before we read any record
        oldest = self._retired[0][0] if self._retired else None
        now = time.monotonic()
        low: int | None = None
        for r in self.readers.values():
            f = self._floor_of(r)
            if f != r.held_at:
                r.held_at, r.blocking_since = f, None
            if f is None:
                continue
            if oldest is not None and f < oldest:
                if r.blocking_since is None:
                    r.blocking_since = now
                elif now - r.blocking_since > self.hold_s:
                    self.passed_over += 1
                    continue  # its late loads fail their generation check and recompute
            if low is None or f < low:
                low = f
        return low

    def retire(self, slot: int, epoch: int) -> None:
        self._retired.append((epoch, slot))

    def fence(self, slot: int, seconds: float) -> None:
        self._fenced.append((time.monotonic() + seconds, slot))

    def quarantine(self, writers: Writers, slots: list[int]) -> None:
        """Revoked grants that ``writers`` may still be copying into: back once they are gone."""
        if not slots:
            return
        if self._quarantined and self._quarantined[-1][0] is writers:
            self._quarantined[-1][1].extend(slots)
        else:
            self._quarantined.append((writers, list(slots)))
        self._next_quarantine_check = 0.0

    def close_quarantine(self) -> None:
        """At shutdown: the daemon stops handing out slots, so nothing waits any more."""
        for writers, _ in self._quarantined:
            writers.close()
        self._quarantined = []

    def holds(self, writers: Writers) -> bool:
        return any(w is writers for w, _ in self._quarantined)

    def release_quarantine(self, force: bool = False) -> list[int]:
        """Quarantined slots whose writers are gone (checked at most every 20 ms)."""
        now = time.monotonic()
        if not self._quarantined or (not force and now < self._next_quarantine_check):
            return []
        self._next_quarantine_check = now + QUARANTINE_CHECK_S
        out: list[int] = []
        keep = []
        for writers, slots in self._quarantined:
            if writers.writers_gone():
                out.extend(slots)
                writers.close()
            else:
                keep.append((writers, slots))
        self._quarantined = keep
        return out

    def reclaim(self, pinned: Callable[[int], bool]) -> list[int]:
        """Slots that no reader and no pin can still reach, in retirement order."""
        out: list[int] = []
        floor = self.floor()
        while self._retired and (floor is None or self._retired[0][0] <= floor):
            _, slot = self._retired.popleft()
            if pinned(slot):
                self.held.add(slot)
            else:
                out.append(slot)
        out.extend(self.release_quarantine())
        if self._fenced:
            now = time.monotonic()
            keep = []
            for until, slot in self._fenced:
                (out.append(slot) if until <= now else keep.append((until, slot)))
            self._fenced = keep
        return out

    def unpinned(self, slot: int) -> bool:
        """The last pin of a held slot dropped: it may be freed now."""
        if slot in self.held:
            self.held.discard(slot)
            return True
        return False

    @property
    def backlog(self) -> int:
        """Retired slots waiting for readers (eviction stops adding to it past a bound)."""
        return len(self._retired)
