"""Prometheus metrics of the in-engine connector, each defined once here.

prometheus_client is optional at import time: the copier must also run on a bare GPU box that
has only torch (scripts/gpu_check.sh). Without it the metrics are no-ops.
"""

from __future__ import annotations

import threading
from typing import Any

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
except ImportError:  # pragma: no cover - exercised only on a box without prometheus_client
    REGISTRY = None  # type: ignore[assignment]
    CollectorRegistry = Any  # type: ignore[assignment,misc]
    Counter = Gauge = None  # type: ignore[assignment,misc]


class _Noop:
    """Stands in for a metric when prometheus_client is missing."""

    def labels(self, *args: Any, **kwargs: Any) -> _Noop:
        return self

    def inc(self, amount: float = 1) -> None:
        return None

    def dec(self, amount: float = 1) -> None:
        return None

    def set(self, value: float) -> None:
        return None


class ConnectorMetrics:
    """The connector's metrics, registered in one registry."""

    def __init__(self, registry: Any = None) -> None:
        reg = registry if registry is not None else REGISTRY
        if Gauge is None or Counter is None:
            noop = _Noop()
            self.pool_mapped_bytes: Any = noop
            self.pool_pinned_bytes: Any = noop
            self.copy_jobs: Any = noop
            self.copy_bytes: Any = noop
            self.worker_pin_seconds: Any = noop
            return
        self.pool_mapped_bytes = Gauge(
            "kvoffload_connector_pool_mapped_bytes",
            "Bytes of the shared pool file mapped into this engine process.",
            registry=reg,
        )
        self.pool_pinned_bytes = Gauge(
            "kvoffload_connector_pool_pinned_bytes",
            "Bytes of the mapped pool registered as pinned host memory (0 without CUDA).",
            registry=reg,
        )
        self.copy_jobs = Counter(
            "kvoffload_connector_copy_jobs",
            "Block copy jobs finished, by direction (store, load) and result (ok, failed).",
            ["direction", "result"],
            registry=reg,
        )
        self.worker_pin_seconds = Gauge(
            "kvoffload_worker_pin_seconds",
            "Seconds the last pool mapping of this process took to map, pre-fault and pin "
            "(done at worker creation, off the step path).",
            registry=reg,
        )
        self.copy_bytes = Counter(
            "kvoffload_connector_copy_bytes",
            "Bytes moved by successful block copy jobs, by direction (store, load).",
            ["direction"],
            registry=reg,
        )


_lock = threading.Lock()
_by_registry: dict[int, tuple[Any, ConnectorMetrics]] = {}


def get_metrics(registry: Any = None) -> ConnectorMetrics:
    """The metrics bound to ``registry`` (default: the global one), created once per registry.

    prometheus_client refuses to register a name twice in one registry, and several pool
    mappings or copiers live in one process (tests, TP ranks in one process), so they share.
    """
    with _lock:
        key = id(registry)
        entry = _by_registry.get(key)
        if entry is None or entry[0] is not registry:
            entry = (registry, ConnectorMetrics(registry))
            _by_registry[key] = entry
        return entry[1]
