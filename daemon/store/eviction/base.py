"""The eviction-policy contract the daemon's index drives, and a compact ordered key set.

A policy only orders keys; it never owns entries. The index tells it what became resident
(``on_insert``), what was used (``on_access``) and what left for other reasons
(``on_remove``), and asks it for ``victims`` when the pool needs free slots. Keys the index
cannot evict right now (pinned by a load, still being written) are skipped by ``victims``
without losing their place, so they compete normally once released.

Memory: the daemon budgets 256 bytes of index metadata per stored block, policy included.
An ``OrderedDict`` costs about 105 bytes per key (a linked-list node per key on top of the
dict); :class:`KeyOrder` below costs about 60 by keeping a plain dict of small counters and a
deque with lazy deletion. A policy is generic in its key type: the daemon's index passes slot
numbers (small ints, shared by CPython), the unit tests pass bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import ClassVar, Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(ABC, Generic[K]):
    """Orders resident keys for eviction."""

    name: ClassVar[str]

    @abstractmethod
    def on_insert(self, key: K) -> None:
        """A newly committed (ready) entry. Inserting a resident key counts as an access."""

    @abstractmethod
    def on_access(self, key: K) -> None:
        """A hit, touch or load of a resident entry (once per use); ignored if not resident."""

    @abstractmethod
    def on_remove(self, key: K) -> None:
        """The entry left outside ``victims`` (dropped, reset); ignored for unknown keys."""

    @abstractmethod
    def victims(self, n: int, can_evict: Callable[[K], bool]) -> list[K]:
        """Up to ``n`` resident keys to evict, best victim first.

        Keys ``can_evict`` rejects stay resident where they are. The returned keys are no
        longer resident for the policy; the caller must evict them.
        """

    @abstractmethod
    def __len__(self) -> int:
        """Resident keys tracked."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident for the policy."""


class KeyOrder(Generic[K]):
    """An ordered set, oldest first, with O(1) amortized push-to-newest and discard.

    Keys sit in push order, a key once per push; only its last occurrence is its position,
    earlier ones are stale and dropped when they reach the front (or by compaction).
    ``_state[key] = 2 * occurrences + live``: small ints, which CPython shares, so a key costs
    one dict entry plus one deque slot. A discarded key keeps its entry (not live) until its
    occurrences are gone, which is how stale occurrences are told apart from the position of
    a key pushed again later.

    Compaction is incremental, so no single call stalls the daemon's loop (a full rebuild
    took ~120 ms at 1M keys): once stale occurrences reach half the live keys, the queue so
    far becomes ``_old``, new pushes go to a fresh ``_queue``, and every push moves up to
    ``STEP`` keys from ``_old`` to ``_done``, dropping the stale ones. The order is always
    ``_done``, ``_old``, ``_queue``. When ``_old`` is empty the (short) fresh queue is
    appended to ``_done``: at most 1/STEP of the keys compacted.
    """

    __slots__ = ("_state", "_queue", "_old", "_done", "_live")

    STEP = 8  # keys compacted per push while a compaction runs

    def __init__(self) -> None:
        self._state: dict[K, int] = {}
        self._queue: deque[K] = deque()  # newest pushes (everything when not compacting)
        self._old: deque[K] = deque()  # being compacted
        self._done: deque[K] = deque()  # compacted, oldest
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def __contains__(self, key: object) -> bool:
        return self._state.get(key, 0) & 1 == 1  # type: ignore[arg-type]

    @property
    def queued(self) -> int:
        """Occurrences held, stale ones included (memory, for tests)."""
        return len(self._done) + len(self._old) + len(self._queue)

    @property
    def compacting(self) -> bool:
        return bool(self._old or self._done)

    def _segments(self) -> tuple[deque[K], ...]:
        return (self._done, self._old, self._queue) if self.compacting else (self._queue,)

    def __iter__(self) -> Iterator[K]:
        """Live keys oldest first (a snapshot; O(n) extra memory, for tests and dumps)."""
        seen: set[K] = set()
        newest_first: list[K] = []
        state = self._state
        for segment in reversed(self._segments()):
            for key in reversed(segment):
                if key not in seen:
                    seen.add(key)
                    if state[key] & 1:
                        newest_first.append(key)
        return reversed(newest_first)

    def push(self, key: K) -> None:
        """Add ``key`` as the newest, or move it there."""
        st = self._state.get(key, 0)
        if not st & 1:
            self._live += 1
        self._state[key] = (st | 1) + 2
        self._queue.append(key)
        if self.compacting:
            self._step(self.STEP)
        # Stale occurrences cost memory: compact once they reach half the live keys.
        elif len(self._queue) > self._live + (self._live >> 1) + 64:
            self._old, self._queue = self._queue, deque()
            self._step(self.STEP)

    def discard(self, key: K) -> bool:
        """Remove ``key``; False if it was not there."""
        st = self._state.get(key, 0)
        if not st & 1:
            return False
        self._state[key] = st - 1
        self._live -= 1
        return True

    def pop_evictable(self, can_evict: Callable[[K], bool], held: list[K]) -> K | None:
        """Remove and return the oldest key ``can_evict`` accepts, None if there is none.

        Rejected keys are taken out of the queue into ``held``: the caller MUST pass ``held``
        to :meth:`restore` (in a ``finally``), which puts them back where they were. Until
        then a scan can continue past them without looking at them again.
        """
        state = self._state
        for queue in self._segments():
            while queue:
                key = queue.popleft()
                st = state[key] - 2
                if st >= 2:  # a later occurrence is its real position
                    state[key] = st
                    continue
                if not st & 1:  # discarded, and this was its last occurrence
                    del state[key]
                    continue
                # Held before asking, so a failing can_evict cannot lose the key.
                state[key] = st  # live, no occurrence until restored
                held.append(key)
                if can_evict(key):
                    held.pop()
                    del state[key]
                    self._live -= 1
                    return key
        return None

    def restore(self, held: list[K]) -> None:
        """Put keys rejected by :meth:`pop_evictable` back at the front, in order."""
        queue = self._segments()[0]
        state = self._state
        for key in reversed(held):
            queue.appendleft(key)
            state[key] += 2
        held.clear()

    def take(self, n: int, can_evict: Callable[[K], bool]) -> list[K]:
        """Remove and return up to ``n`` oldest keys ``can_evict`` accepts."""
        out: list[K] = []
        held: list[K] = []
        try:
            while len(out) < n:
                key = self.pop_evictable(can_evict, held)
                if key is None:
                    break
                out.append(key)
        finally:
            self.restore(held)
        return out

    def pop_oldest(self) -> K | None:
        """Remove and return the oldest key, None if empty."""
        taken = self.take(1, _always)
        return taken[0] if taken else None

    def clear(self) -> None:
        self._state.clear()
        self._queue.clear()
        self._old.clear()
        self._done.clear()
        self._live = 0

    def _step(self, n: int) -> None:
        """Compact up to ``n`` occurrences of ``_old`` into ``_done``."""
        old, done, state = self._old, self._done, self._state
        for _ in range(n):
            if not old:
                break
            key = old.popleft()
            st = state[key] - 2
            if st >= 2:  # stale: a later occurrence holds its position
                state[key] = st
            elif st & 1:  # live, and this is its position
                state[key] = st + 2
                done.append(key)
            else:  # discarded, and this was its last occurrence
                del state[key]
        if not old and done:  # finished: the fresh pushes follow the compacted keys
            done.extend(self._queue)
            self._queue, self._done = done, deque()


def _always(key: object) -> bool:
    return True
