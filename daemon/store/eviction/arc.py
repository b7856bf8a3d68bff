"""Adaptive Replacement Cache (Megiddo and Modha, FAST 2003), driven by the daemon's index.

ARC keeps two resident lists, T1 (used once since it arrived) and T2 (used again), two
ghost lists of recently evicted keys, B1 and B2, and an adaptive target size ``p`` for T1:
re-inserting a key evicted from T1 (a B1 ghost hit) means T1 was too small, one evicted from
T2 (a B2 ghost hit) means T2 was. A one-time scan only passes through T1, so keys used
repeatedly (T2) survive it, where plain LRU loses them.

The daemon, not the policy, decides when to evict (when the pool needs slots), so the paper's
REPLACE step runs inside ``victims``, and its ghost bounds are kept after every change:
|T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c, c = the pool's capacity in slots.
Ghosts are kept as 30-bit fingerprints of the block (``hash(identity(key))``, an int of 32
bytes), not as keys: the index has dropped an evicted key's bytes (about 72 bytes). A collision
only makes one insert look like a ghost hit (odds about |B| / 2**30), which nudges ``p`` once.
``identity`` matters because the daemon's index passes slot numbers as keys: a slot is reused
by the next block at once, so a ghost of the slot itself would make nearly every insert into a
full pool a ghost hit (straight to T2), and a scan would flush the frequent keys as in LRU.
The index passes the block's (namespace, key bytes) as its identity; by default it is the key.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import ClassVar

from kvoffload.daemon.store.eviction.base import EvictionPolicy, K, KeyOrder

_FINGERPRINT_MASK = (1 << 30) - 1  # ints below 2**30 are CPython's smallest (one digit)


class ARCPolicy(EvictionPolicy[K]):
    """Adaptive replacement over a pool of ``capacity`` slots."""

    name: ClassVar[str] = "arc"

    def __init__(self, capacity: int | None = None,
                 identity: Callable[[K], Hashable] | None = None) -> None:
        """``capacity``: pool slots. None: follow the most keys ever resident at once (the
        pool's size once it has filled), for callers that do not know it up front.
        ``identity``: what a ghost remembers of a resident key, asked while it is resident
        (module docstring); None: the key itself."""
        if capacity is not None and capacity <= 0:
            raise ValueError(f"ARC needs a positive capacity, got {capacity}")
        self._auto_capacity = capacity is None
        self.capacity = capacity or 0
        self._p = 0  # target size of T1
        self._identity = identity
        self._t1: KeyOrder[K] = KeyOrder()
        self._t2: KeyOrder[K] = KeyOrder()
        self._b1: KeyOrder[int] = KeyOrder()
        self._b2: KeyOrder[int] = KeyOrder()

    def _fingerprint(self, key: K) -> int:
        ident = key if self._identity is None else self._identity(key)
        return hash(ident) & _FINGERPRINT_MASK

    @property
    def target_t1(self) -> int:
        """ARC's adaptive target size ``p`` of the recency list T1."""
        return self._p

    def sizes(self) -> tuple[int, int, int, int]:
        """(|T1|, |T2|, |B1|, |B2|), for metrics and tests."""
        return len(self._t1), len(self._t2), len(self._b1), len(self._b2)

    def is_frequent(self, key: K) -> bool:
        """Whether ``key`` is in T2 (used again since it arrived)."""
        return key in self._t2

    def on_insert(self, key: K) -> None:
        if key in self._t1 or key in self._t2:
            self.on_access(key)
            return
        ghost = self._fingerprint(key)
        b1, b2 = self._b1, self._b2
        if ghost in b1:
            # Evicted from T1 and wanted again: T1 deserves more room.
            self._p = min(self.capacity, self._p + max(1, len(b2) // len(b1)))
            b1.discard(ghost)
            self._t2.push(key)
        elif ghost in b2:
            # Evicted from T2 and wanted again: T2 deserves more room.
            self._p = max(0, self._p - max(1, len(b1) // len(b2)))
            b2.discard(ghost)
            self._t2.push(key)
        else:
            self._t1.push(key)
        if self._auto_capacity and len(self) > self.capacity:
            self.capacity = len(self)
        self._trim_ghosts()

    def on_access(self, key: K) -> None:
        if self._t1.discard(key):
            self._t2.push(key)  # second use: frequent
        elif key in self._t2:
            self._t2.push(key)

    def on_remove(self, key: K) -> None:
        # Gone for a reason that says nothing about its value (dropped, reset): no ghost.
        if not self._t1.discard(key) and not self._t2.discard(key):
            ghost = self._fingerprint(key)
            if not self._b1.discard(ghost):
                self._b2.discard(ghost)

    def victims(self, n: int, can_evict: Callable[[K], bool]) -> list[K]:
        chosen: list[K] = []
        t1, t2 = self._t1, self._t2
        held1: list[K] = []
        held2: list[K] = []
        done1 = done2 = False
        try:
            while len(chosen) < n and not (done1 and done2):
                # The paper's REPLACE: take from T1 while it is above its target (pinned keys
                # count, they are resident); fall back to the other list when one has no
                # evictable key left.
                if not done1 and (len(t1) > self._p or done2):
                    key = t1.pop_evictable(can_evict, held1)
                    if key is None:
                        done1 = True
                        continue
                    self._b1.push(self._fingerprint(key))
                else:
                    key = t2.pop_evictable(can_evict, held2)
                    if key is None:
                        done2 = True
                        continue
                    self._b2.push(self._fingerprint(key))
                chosen.append(key)
        finally:
            t1.restore(held1)
            t2.restore(held2)
        self._trim_ghosts()
        return chosen

    def _trim_ghosts(self) -> None:
        c = self.capacity
        b1, b2 = self._b1, self._b2
        t1_len = len(self._t1)
        while len(b1) and t1_len + len(b1) > c:
            b1.pop_oldest()
        excess = t1_len + len(self._t2) + len(b1) + len(b2) - 2 * c
        while excess > 0 and len(b2):
            b2.pop_oldest()
            excess -= 1
        while excess > 0 and len(b1):
            b1.pop_oldest()
            excess -= 1

    def set_capacity(self, capacity: int) -> None:
        """The pool was resized: adopt the new slot count (and stop following residents)."""
        if capacity <= 0:
            raise ValueError(f"ARC needs a positive capacity, got {capacity}")
        self._auto_capacity = False
        self.capacity = capacity
        self._p = min(self._p, capacity)
        self._trim_ghosts()

    def clear(self) -> None:
        """Forget everything, ghosts and adaptation included (a cache reset)."""
        self._p = 0
        for keys in (self._t1, self._t2, self._b1, self._b2):
            keys.clear()

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2
