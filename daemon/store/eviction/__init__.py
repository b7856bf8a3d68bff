"""kvoffload.daemon.store.eviction: eviction policies, chosen by name."""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.daemon.store.eviction.arc import ARCPolicy
from kvoffload.daemon.store.eviction.base import EvictionPolicy
from kvoffload.daemon.store.eviction.lru import LRUPolicy

_POLICIES: dict[str, Callable[[int | None], EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    ARCPolicy.name: ARCPolicy,
}


def policy_names() -> tuple[str, ...]:
    return tuple(sorted(_POLICIES))


def make_policy(name: str, capacity: int | None = None) -> EvictionPolicy:
    """The policy called ``name`` (case-insensitive). ``capacity`` is the pool size in slots:
    ARC bounds its ghost lists and adaptation by it (None: the most keys ever resident);
    LRU ignores it."""
    try:
        factory = _POLICIES[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; valid: {', '.join(policy_names())}"
        ) from None
    return factory(capacity)


__all__ = ["ARCPolicy", "EvictionPolicy", "LRUPolicy", "make_policy", "policy_names"]
