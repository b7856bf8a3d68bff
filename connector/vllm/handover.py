"""What ``KVOffloadConnector`` hands our spec explicitly (no vLLM import here).

vLLM builds the spec inside its connector's constructor, from an ``OffloadingConfig`` that has
no ``KVCacheConfig``, no model or cache config (what the namespace must cover: quantization,
revision, overrides, the prefix-hash algorithm) and no way back to the connector.
``KVOffloadConnector`` sets a ``Handover`` in a context variable around that constructor; the
spec takes it in its own constructor and later fills in the manager and worker it builds, so
the connector can reach them without reading vLLM's attributes or stack frames. With vLLM's stock
``OffloadingConnector`` there is no hand-over, and the spec works from the config alone.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any


@dataclass
class Handover:
    kv_cache_config: Any  # vLLM's KVCacheConfig of this engine
    vllm_config: Any = None  # vLLM's VllmConfig of this engine (geometry.model_identity)
    manager: Any = None  # our DaemonOffloadingManager (scheduler role)
    worker: Any = None  # our DaemonOffloadingWorker (worker role)


CURRENT: contextvars.ContextVar[Handover | None] = contextvars.ContextVar(
    "kvoffload_handover", default=None)
