"""What this daemon knows of the store's contents, without asking it.

The pool does not know what the shared store holds, and asking costs a round trip in a thread,
so answers are remembered: a key present (ours to read back, or seen in an existence check)
until a read of it fails; a key absent for ``ABSENT_TTL`` seconds, so a miss costs one check
per key and not one per lookup. Both are bounded LRU maps.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

ABSENT_TTL = 2.0  # seconds a key the store lacked answers MISS without asking again
CACHE_MAX = 1 << 20  # entries of each answer map

StoreKey = tuple[bytes, bytes]  # (namespace hash, offload key)


class StoreAnswers:
    def __init__(self, on_count: Callable[[int], None]) -> None:
        self._present: OrderedDict[StoreKey, None] = OrderedDict()
        self._absent: OrderedDict[StoreKey, float] = OrderedDict()
        self._on_count = on_count  # told the number of present keys when it changes

    def __len__(self) -> int:
        return len(self._present)

    def present(self, k: StoreKey) -> bool:
        return k in self._present

    def known_absent(self, k: StoreKey) -> bool:
        """True while a recent check said the store lacks ``k``; forgets expired answers."""
        until = self._absent.get(k)
        if until is None:
            return False
        if until > time.monotonic():
            return True
        del self._absent[k]
        return False

    def mark_present(self, k: StoreKey) -> None:
        self._absent.pop(k, None)
        self._present[k] = None
        self._present.move_to_end(k)
        if len(self._present) > CACHE_MAX:
            self._present.popitem(last=False)
        self._on_count(len(self._present))

    def mark_absent(self, k: StoreKey) -> None:
        self.forget(k)
        self._absent[k] = time.monotonic() + ABSENT_TTL
        self._absent.move_to_end(k)
        if len(self._absent) > CACHE_MAX:
            self._absent.popitem(last=False)

    def forget(self, k: StoreKey) -> bool:
        """Drop a present answer (a failed put or read); True when there was one."""
        if self._present.pop(k, 1) is None:
            self._on_count(len(self._present))
            return True
        return False
