"""kvoffload.daemon.store.eviction: eviction policies, chosen by name."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from kvoffload.daemon.store.eviction.arc import ARCPolicy
from kvoffload.daemon.store.eviction.base import EvictionPolicy
from kvoffload.daemon.store.eviction.lru import LRUPolicy

_POLICIES: dict[str, Callable[[int | None, Callable[[Any], Hashable] | None],
                            EvictionPolicy[Any]]] = {
    LRUPolicy.name: LRUPolicy,
    ARCPolicy.name: ARCPolicy,
}


def policy_names() -> tuple[str, ...]:
    return tuple(sorted(_POLICIES))


def make_policy(name: str, capacity: int | None = None,
                identity: Callable[[Any], Hashable] | None = None) -> EvictionPolicy[Any]:
    """The policy called ``name`` (case-insensitive). ``capacity`` is the pool size in slots:
    ARC bounds its ghost lists and adaptation by it (None: the most keys ever resident);
    LRU ignores it. ``identity``: what ARC's ghosts remember of a key (see arc.py); LRU
    ignores it."""
    try:
        factory = _POLICIES[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; valid: {', '.join(policy_names())}"
        ) from None
    return factory(capacity, identity)


__all__ = ["ARCPolicy", "EvictionPolicy", "LRUPolicy", "make_policy", "policy_names"]
