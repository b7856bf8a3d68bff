"""Publisher of our lookup events: the KV publisher's framing and replay, its own schema."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from .publisher import EventPublisher
from .schema import LookupEvent, LookupEventBatch

__all__ = ["LookupEventPublisher"]


class LookupEventPublisher(EventPublisher):
    """Publisher of our lookup events: same framing, own endpoint (never the router stream)."""

    def __init__(self, endpoint: str, *args: Any, stream: str = "lookup", **kwargs: Any) -> None:
        super().__init__(endpoint, *args, stream=stream, **kwargs)

    def _wrap(self, item: Any) -> Any:
        if isinstance(item, LookupEventBatch):
            return item
        events = [item] if isinstance(item, LookupEvent) else list(item)
        return LookupEventBatch(ts=time.time(), events=events)

    def publish(  # type: ignore[override]
        self, item: LookupEventBatch | LookupEvent | Iterable[LookupEvent]
    ) -> bool:
        return super().publish(item)  # type: ignore[arg-type]
