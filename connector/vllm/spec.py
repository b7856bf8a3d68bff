"""``KVOffloadSpec``: the out-of-tree offloading spec vLLM 0.33 loads into its connector.

It reads our ``kv_connector_extra_config`` keys (``settings.py``, docs/vllm.md), computes the
engine's ``Geometry`` and builds the scheduler-side manager and the worker-side worker. What
the spec API does not hand over (the ``KVCacheConfig``; a way to report failed loads) comes
from ``KVOffloadConnector`` through ``handover.py``, never from vLLM's frames or private state.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import vllm
from kvoffload.connector.session import IndexSession
from kvoffload.connector.vllm import handover
from kvoffload.connector.vllm.geometry import build_geometry
from kvoffload.connector.vllm.manager import DaemonOffloadingManager
from kvoffload.connector.vllm.session_metrics import metric_definitions
from kvoffload.connector.vllm.settings import (
    OFFLOAD_PROMPT_ONLY,
    _setting,
    check_keys,
    check_sync_loads,
    check_vllm_version,
    manager_settings,
)
from kvoffload.daemon.control.security import CurveClientKeys
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

log = logging.getLogger("kvoffload.connector.vllm")


class KVOffloadSpec(OffloadingSpec):
    """Loaded with ``spec_name="KVOffloadSpec"``, ``spec_module_path="kvoffload.connector.vllm"``
    (by ``KVOffloadConnector``, or by vLLM's stock ``OffloadingConnector``)."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        """Our metrics on vLLM's ``/metrics`` (``session_metrics.py``): vLLM's API server
        registers what this declares; ``KVOffloadConnector`` sends the values."""
        return metric_definitions()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        check_vllm_version(vllm.__version__)
        check_keys(self.extra_config)
        check_sync_loads(self.extra_config)
        self.endpoint = str(self.extra_config.get("kvoffload_control", "")) or os.environ.get(
            "KVOFFLOAD_CONTROL", "")
        if not self.endpoint:
            raise ValueError("kv_connector_extra_config needs 'kvoffload_control' (the daemon's "
                             "control endpoint, e.g. ipc:///run/kvoffload/control.sock)")
        if self.blocks_per_chunk != 1:
            raise ValueError("kvoffload stores one GPU block per key: blocks_per_chunk (or "
                             "block_size in kv_connector_extra_config) must be 1 block")
        self.settings = manager_settings(self.extra_config)
        if "offload_prompt_only" not in self.extra_config:  # vLLM's key, our default
            self.offload_prompt_only = OFFLOAD_PROMPT_ONLY
        self.handover = handover.CURRENT.get()
        box = self.handover
        if box is None:
            log.warning("kvoffload: loaded into vLLM's stock OffloadingConnector: a load whose "
                        "pool slots were reused fails its job and vLLM's offloading worker "
                        "asserts (the engine stops), and the namespace cannot include the model "
                        "config (quantization, revision, overrides, hash algorithm); use "
                        "kv_connector=KVOffloadConnector, "
                        "kv_connector_module_path=kvoffload.connector.vllm")
        self.geometry = build_geometry(config, box.kv_cache_config if box else None,
                                       box.vllm_config if box else None)
        self._manager: DaemonOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            s = self.settings
            session = IndexSession(
                self.endpoint, self.geometry, timeout_ms=s.timeout_ms, retry_ms=s.retry_ms,
                liveness_ms=s.liveness_ms, instance=self.config.engine_id,
                name=f"vllm scheduler {self.config.engine_id} pid {os.getpid()}",
                curve=CurveClientKeys.from_settings(self.extra_config),
                time_model=s.time_model, sync_ms=s.sync_ms,
                data_parallel_rank=self.config.parallel.data_parallel_index,
                io_sched_batch=s.io_sched_batch)
            self._manager = DaemonOffloadingManager(session, self.geometry, s)
            self._manager.attach()  # at start, not inside the first scheduler step
            if self.handover is not None:
                self.handover.manager = self._manager
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from kvoffload.connector.vllm.worker import DaemonOffloadingWorker

            par = self.config.parallel
            self._worker = DaemonOffloadingWorker(
                kv_caches, rank=par.rank, tp_world_size=max(1, par.world_size),
                cpu_async=_setting(self.extra_config, "kvoffload_copy_async", True, bool),
                reports_load_errors=self.handover is not None,
                # Map and pin the pool now, off the first step, when the operator names it.
                pool_path=str(self.extra_config.get("kvoffload_pool_path", "")) or None)
            if self.handover is not None:
                self.handover.worker = self._worker
        return self._worker
