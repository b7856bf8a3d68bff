"""The index's small types: slot states, namespaces, the answer of ``prepare``, listeners.

Split from ``index.py`` (which re-exports them: import them from ``kvoffload.daemon.store.index``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from kvoffload.daemon.base import Geometry
from kvoffload.daemon.lookup.cost import TailCost
from kvoffload.daemon.store import shared_index as si


class SlotState(enum.IntEnum):
    FREE = 0
    PENDING = 1
    READY = 2
    RESERVED = 3  # handed to one engine's store reservation, no key yet
    RETIRED = 4  # lost its key; reused once no reader can still act on it (reclaim.py)


# What readers of the shared index see for each state (no key: nothing to act on).
_SHARED_STATE = {SlotState.PENDING: si.PENDING, SlotState.READY: si.READY}


@dataclass(slots=True)
class Namespace:
    """One engine geometry; every engine and rank registering the same one shares it."""

    id: int
    geometry: Geometry
    keys: dict[bytes, int]
    cost: TailCost | None = None  # set when an engine registers its time model


@dataclass(slots=True, frozen=True)
class Prepared:
    slot: int | None  # None: not granted (exists, or no room)
    exists: bool
    evicted: list[tuple[Namespace, bytes, int]]  # (namespace, key, end_token) of evictions


# Called with (namespace, key, slot) when a key becomes readable or is dropped.
Listener = Callable[[Namespace, bytes, int], None]
