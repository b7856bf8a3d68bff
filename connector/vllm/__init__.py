"""kvoffload's vLLM plugin: the only modules that import vLLM.

Load it with ``kv_connector="KVOffloadConnector"``, ``kv_connector_module_path=
"kvoffload.connector.vllm"`` and ``kv_connector_extra_config`` ``{"spec_name": "KVOffloadSpec",
"spec_module_path": "kvoffload.connector.vllm", "kvoffload_control": "<daemon endpoint>"}``
(docs/vllm.md; vLLM's stock ``OffloadingConnector`` loads the same spec, with fewer
guarantees). Names are resolved lazily, so importing this package does not import vLLM.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "KVOffloadSpec": "kvoffload.connector.vllm.spec",
    "KVOffloadConnector": "kvoffload.connector.vllm.connector",
    "DaemonOffloadingManager": "kvoffload.connector.vllm.manager",
    "DaemonOffloadingWorker": "kvoffload.connector.vllm.worker",
    "PoolSlotsSpec": "kvoffload.connector.vllm.load_spec",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
