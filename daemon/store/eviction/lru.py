"""Least recently used."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import ClassVar

from kvoffload.daemon.store.eviction.base import EvictionPolicy, K, KeyOrder


class LRUPolicy(EvictionPolicy[K]):
    """Evicts the key whose last insert or access is oldest."""

    name: ClassVar[str] = "lru"

    def __init__(self, capacity: int | None = None,
                 identity: Callable[[K], Hashable] | None = None) -> None:
        # LRU needs neither (no ghosts); accepted so every policy is built the same way.
        self._order: KeyOrder[K] = KeyOrder()

    def on_insert(self, key: K) -> None:
        self._order.push(key)

    def on_access(self, key: K) -> None:
        if key in self._order:
            self._order.push(key)

    def on_remove(self, key: K) -> None:
        self._order.discard(key)

    def victims(self, n: int, can_evict: Callable[[K], bool]) -> list[K]:
        return self._order.take(n, can_evict) if n > 0 else []

    def clear(self) -> None:
        """Forget every key (a cache reset)."""
        self._order.clear()

    def order(self) -> Iterator[K]:
        """Resident keys, next victim first (a snapshot)."""
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
