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

A reader whose lease ends stops holding anything; a stalled one holds retired slots for at most
its lease, and a worker of it that copies later fails its generation check instead of reading
another block's bytes. Slots taken from a departed writer (reserved or pending at its lease
end) wait one more lease (``fence``) before reuse: its workers may still be writing them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class Reader:
    __slots__ = ("record", "processed", "epoch")

    def __init__(self, record: int, epoch: int) -> None:
        self.record = record  # its record in the readers file, -1 for none
        self.processed = 0  # its messages the daemon has handled (Step count)
        self.epoch = epoch  # epoch of its last handled Step (or its registration)


# (busy, epoch, messages sent) of a record, or None when unreadable.
RecordReader = Callable[[int], "tuple[int, int, int] | None"]


class Reclaimer:
    def __init__(self) -> None:
        self.readers: dict[bytes, Reader] = {}  # client identity -> its hold
        self.read_record: RecordReader = lambda record: None
        self._retired: deque[tuple[int, int]] = deque()  # (epoch, slot), epochs ascending
        self._fenced: list[tuple[float, int]] = []  # (reusable after, slot)
        self.held: set[int] = set()  # retired and past every reader, but still pinned

    def __len__(self) -> int:
        return len(self._retired) + len(self._fenced) + len(self.held)

    def add_reader(self, identity: bytes, epoch: int, record: int = -1) -> None:
        self.readers[identity] = Reader(record, epoch)

    def remove_reader(self, identity: bytes) -> Reader | None:
        return self.readers.pop(identity, None)

    def report(self, identity: bytes, epoch: int) -> None:
        """A reader's Step was handled: its pins are in, its view was at ``epoch``."""
        r = self.readers.get(identity)
        if r is not None:
            r.processed += 1
            r.epoch = max(r.epoch, epoch)

    def _floor_of(self, r: Reader) -> int | None:
        rec = self.read_record(r.record) if r.record >= 0 else None
        if rec is None:
            return r.epoch
        busy, epoch, sent = rec
        if sent > r.processed:  # decisions still queued on the socket: their view's epoch
            return r.epoch
        return epoch if busy else None

    def floor(self) -> int | None:
        """The oldest epoch some reader may still act on; None: nobody holds anything."""
        floors = [f for f in map(self._floor_of, self.readers.values()) if f is not None]
        return min(floors, default=None)

    def retire(self, slot: int, epoch: int) -> None:
        self._retired.append((epoch, slot))

    def fence(self, slot: int, seconds: float) -> None:
        self._fenced.append((time.monotonic() + seconds, slot))

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
