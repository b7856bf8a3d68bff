"""Least recently used."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import ClassVar

from kvoffload.daemon.store.eviction.base import EvictionPolicy, KeyOrder


class LRUPolicy(EvictionPolicy):
    """Evicts the key whose last insert or access is oldest."""

    name: ClassVar[str] = "lru"

    def __init__(self, capacity: int | None = None) -> None:
        # LRU needs no capacity; accepted so every policy is built the same way.
        self._order: KeyOrder[bytes] = KeyOrder()

    def on_insert(self, key: bytes) -> None:
        self._order.push(key)

    def on_access(self, key: bytes) -> None:
        if key in self._order:
            self._order.push(key)

    def on_remove(self, key: bytes) -> None:
        self._order.discard(key)

    def victims(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        return self._order.take(n, can_evict) if n > 0 else []

    def clear(self) -> None:
        """Forget every key (a cache reset)."""
        self._order.clear()

    def order(self) -> Iterator[bytes]:
        """Resident keys, next victim first (a snapshot)."""
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
