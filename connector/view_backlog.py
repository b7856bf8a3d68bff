"""The slots an engine's ``IndexView`` has not applied yet: additions waiting for a budget.

A refresh reads every ring record since the last one and applies every change to what the view
already holds in the same step; only entries that would *add* a key (and entries read
mid-write) may wait here (``index_view.py``: why that is safe). Slot numbers, not ring
positions: a waiting slot's entry is read again when its turn comes, so a slot that changed
meanwhile is applied as it is then, and the ring may move on (nothing here can be lapped).
Each slot waits once (``lags``), first in, first out, in the chunks it arrived in.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class Backlog:
    def __init__(self, num_slots: int) -> None:
        self._chunks: deque[np.ndarray] = deque()
        self._lagging = np.zeros(num_slots, dtype=bool)
        self.waiting = 0  # slots waiting

    def __len__(self) -> int:
        return self.waiting

    def lags(self, slot: int) -> bool:
        return bool(self._lagging[slot])

    def add(self, slots: np.ndarray) -> None:
        """``slots`` (unique) wait; those already waiting keep their place."""
        if not len(slots):
            return
        new = slots[~self._lagging[slots]]
        if len(new):
            self._lagging[new] = True
            self._chunks.append(new)
            self.waiting += len(new)

    def take(self, most: int) -> np.ndarray:
        """The oldest waiting slots, ``most`` of them or all (unique); they wait no more.
        Across the chunks they arrived in: a step's one guaranteed chunk is a whole one."""
        parts: list[np.ndarray] = []
        left = most
        while left > 0 and self._chunks:
            first = self._chunks[0]
            parts.append(first[:left])
            if len(first) > left:
                self._chunks[0] = first[left:]
            else:
                self._chunks.popleft()
            left -= len(parts[-1])
        chunk = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self._lagging[chunk] = False
        self.waiting -= len(chunk)
        return chunk

    def clear(self) -> None:
        self._chunks.clear()
        self._lagging[:] = False
        self.waiting = 0
