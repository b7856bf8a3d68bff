"""The Promoter with the shared Mooncake tier last in line (see ``mooncake.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvoffload.daemon.base import KeyStatus
from kvoffload.daemon.ops.metrics import DaemonMetrics
from kvoffload.daemon.store.index import BlockIndex, Namespace
from kvoffload.daemon.tiers.base import Tier
from kvoffload.daemon.tiers.mooncake.tier import MooncakeTier
from kvoffload.daemon.tiers.promote import Promoter


class SharedPromoter(Promoter):
    """The Promoter with the shared tier last: a key no local tier holds is asked of the
    store (RETRY, parked lookups wait on the check), and pool blocks are pushed to it on
    commit or eviction (``mooncake_put``)."""

    def __init__(self, index: BlockIndex, local: list[Tier], shared: MooncakeTier,
                 metrics: DaemonMetrics, events: Any = None,
                 on_change: Callable[[], None] | None = None) -> None:
        super().__init__(index, [*local, shared], metrics, events, on_change)
        self.shared = shared
        shared.promote = self._fetch
        if shared.put_on == "commit":
            index.on_ready.append(shared.copy_slot)

    def _evicted(self, ns: Namespace, key: bytes, slot: int) -> None:
        if self.tiers[0] is not self.shared:
            super()._evicted(ns, key, slot)  # the disk tier takes it as before
        if self.shared.put_on == "evict":
            self.shared.copy_slot(ns, key, slot)

    def probe(self, ns: Namespace, key: bytes) -> KeyStatus:
        status = super().probe(ns, key)
        if status is KeyStatus.MISS and not self.shared.contains(ns, key):
            return self.shared.ask(ns, key)  # known present but no room: a MISS, no re-ask
        return status

    asks_remote = True  # a key no tier knows is asked of the store, on the loop

    def peek(self, ns: Namespace, key: bytes) -> KeyStatus:
        status = super().peek(ns, key)
        if status is KeyStatus.MISS and not self.shared.contains(ns, key):
            return self.shared.ask(ns, key)  # an existence check only: no slot is taken
        return status

    def _fetch(self, ns: Namespace, key: bytes) -> KeyStatus:
        """The store holds ``key``: promote it unless the pool got it meanwhile."""
        if self.index.status(ns, key) is not KeyStatus.MISS:
            return KeyStatus.HIT
        return super().probe(ns, key)

    def wait(self, ns: Namespace, key: bytes) -> asyncio.Future[bool] | None:
        return self.shared.wait(ns, key)
