"""``KVOffloadSpec``: the out-of-tree offloading spec vLLM 0.33 loads into ``OffloadingConnector``.

It reads our ``kv_connector_extra_config`` keys (``docs/vllm.md``), computes the engine's
``Geometry`` and builds the scheduler-side manager and the worker-side worker. Two facts the
spec API does not hand over are taken from vLLM's own objects, in one documented place
(``_from_callers``): the ``KVCacheConfig`` (which groups are Mamba, sliding window, ...) and,
on the scheduler, the ``OffloadingConnectorScheduler`` whose per-request state (block hashes,
token ids, locally computed tokens) lets the manager batch a request's lookups into one daemon
round trip. ``KVOffloadConnector`` (connector.py) hands both over explicitly instead.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from kvoffload.connector.client import DaemonClient
from kvoffload.connector.vllm.manager import DaemonOffloadingManager, ManagerSettings
from kvoffload.daemon.security import CurveClientKeys
from kvoffload.daemon.types import Geometry, GroupKind, GroupSpec
from vllm.v1.kv_offload.base import (  # type: ignore[import-untyped]
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # type: ignore[import-untyped]

log = logging.getLogger("kvoffload.connector.vllm")

# Set by KVOffloadConnector around vLLM's constructor: the KVCacheConfig of this engine.
KV_CACHE_CONFIG: contextvars.ContextVar[Any] = contextvars.ContextVar("kvoffload_kv_cache_config",
                                                                      default=None)

_BOOL_TRUE = ("1", "true", "yes", "on")


def _setting(extra: Mapping[str, Any], key: str, default: Any, kind: type) -> Any:
    raw = extra.get(key, default)
    try:
        if kind is bool:
            return raw if isinstance(raw, bool) else str(raw).lower() in _BOOL_TRUE
        return kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be {kind.__name__}, "
                         f"got {raw!r}") from None


def manager_settings(extra: Mapping[str, Any]) -> ManagerSettings:
    policy = str(extra.get("kvoffload_offload_policy", "request"))
    if policy not in ("request", "chunk"):
        raise ValueError("kvoffload_offload_policy must be 'request' or 'chunk'")
    return ManagerSettings(
        timeout_ms=_setting(extra, "kvoffload_timeout_ms", 500, int),
        retry_ms=_setting(extra, "kvoffload_retry_ms", 1000, int),
        wait_ms=_setting(extra, "kvoffload_lookup_wait_ms", 5000, int),
        prefetch=_setting(extra, "kvoffload_prefetch", True, bool),
        prefetch_max=_setting(extra, "kvoffload_prefetch_max", 16, int),
        policy=policy,
        reset_daemon=_setting(extra, "kvoffload_reset_daemon", True, bool),
        known_keys=_setting(extra, "kvoffload_known_keys", 1 << 16, int),
        time_model=_time_model(extra),
    )


def _time_model(extra: Mapping[str, Any]) -> tuple[float, float] | None:
    """Cost-aware tails: both rates, or neither (off)."""
    prefill = _setting(extra, "kvoffload_prefill_tokens_per_s", 0.0, float)
    copy = _setting(extra, "kvoffload_copy_bytes_per_s", 0.0, float)
    if (prefill > 0) != (copy > 0) or prefill < 0 or copy < 0:
        raise ValueError("kvoffload_prefill_tokens_per_s and kvoffload_copy_bytes_per_s are "
                         "set together, both positive")
    return (prefill, copy) if prefill else None


def _from_callers(name: str, predicate: Any, depth: int = 6) -> Any:
    """The local ``name`` of the nearest calling frame where it satisfies ``predicate``.

    vLLM 0.33 builds the spec inside ``OffloadingConnector.__init__(..., kv_cache_config)`` and
    asks for the manager inside ``OffloadingConnectorScheduler.__init__(self, ...)``; reading
    those locals is the only way a spec loaded into the stock connector can see them. Tests pin
    this against the installed vLLM; a miss degrades (see callers), it never breaks loading.
    """
    frame: Any = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        value = frame.f_locals.get(name)
        if value is not None and predicate(value):
            return value
        frame = frame.f_back
    return None


def _is_kv_cache_config(obj: Any) -> bool:
    return type(obj).__name__ == "KVCacheConfig" and hasattr(obj, "kv_cache_groups")


def _is_offloading_scheduler(obj: Any) -> bool:
    # Matched by class name: its _req_status is only assigned after get_manager() returns.
    return type(obj).__name__ == "OffloadingConnectorScheduler"


def _group_spec(group: Any, kv_cache_config: Any, config: OffloadingConfig) -> GroupSpec:
    tokens = group.tokens_per_block
    if kv_cache_config is None:
        # Only the window size is known: None is full attention; vLLM gives Mamba a window of
        # one chunk, which a one-chunk sliding window shares; assume the (common) Mamba.
        window = group.sliding_window_size_in_chunks
        nbytes = config.worker_kv_bytes_per_block
        if window is None:
            return GroupSpec(GroupKind.FULL_ATTENTION, tokens, nbytes)
        if window == 1:
            return GroupSpec(GroupKind.MAMBA, tokens, nbytes,
                             mamba_align=tokens > config.cache.tokens_per_hash)
        return GroupSpec(GroupKind.SLIDING_WINDOW, tokens, nbytes,
                         sliding_window_tokens=window * tokens * config.cache.blocks_per_chunk)
    from vllm.v1.kv_cache_interface import (  # type: ignore[import-untyped]
        ChunkedLocalAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
        iter_layer_specs,
    )

    kv_group = kv_cache_config.kv_cache_groups[group.group_id]
    spec = kv_group.kv_cache_spec
    # vLLM's per-block bytes (what its own CPU tier sizes chunks by) covers every group's
    # pages, packed layouts included; the group's own padded pages only when it is unknown.
    nbytes = config.worker_kv_bytes_per_block or (
        spec.page_size_bytes if isinstance(spec, UniformTypeKVCacheSpecs)
        else spec.page_size_bytes * len(kv_group.layer_names))
    layer = next(iter(iter_layer_specs(spec)))
    if isinstance(layer, MambaSpec):
        return GroupSpec(GroupKind.MAMBA, tokens, nbytes,
                         mamba_align=layer.mamba_cache_mode == "align")
    if isinstance(layer, SlidingWindowSpec):
        return GroupSpec(GroupKind.SLIDING_WINDOW, tokens, nbytes,
                         sliding_window_tokens=layer.sliding_window)
    if isinstance(layer, ChunkedLocalAttentionSpec):
        return GroupSpec(GroupKind.SLIDING_WINDOW, tokens, nbytes,
                         sliding_window_tokens=layer.attention_chunk_size)
    return GroupSpec(GroupKind.FULL_ATTENTION, tokens, nbytes)


def build_geometry(config: OffloadingConfig, kv_cache_config: Any = None) -> Geometry:
    """The daemon-side description of this engine; equal engines get equal namespaces."""
    groups = tuple(_group_spec(g, kv_cache_config, config) for g in config.groups)
    par = config.parallel
    extra = str(config.extra_config.get("kvoffload_namespace", ""))
    # Everything that changes the bytes behind a key, beyond the group shapes themselves.
    identity = repr((config.model.name, config.model.dtype, par.world_size, par.tp_size,
                     par.pp_size, par.pcp_size, par.dcp_size, config.kv_cache_layout,
                     config.canonical_layout, config.replicated_layout,
                     config.cache.tokens_per_hash, [g.layer_names for g in config.groups],
                     groups, extra))
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    name = (f"{config.model.name}|{config.model.dtype}|tp{par.tp_size}pp{par.pp_size}"
            f"{'|' + extra if extra else ''}|{digest}")
    if len(name) > 512:
        name = name[-512:]
    return Geometry(namespace=name, groups=groups, tokens_per_hash=config.cache.tokens_per_hash,
                    tp_world_size=max(1, par.world_size),
                    blocks_per_chunk=config.cache.blocks_per_chunk)


class KVOffloadSpec(OffloadingSpec):  # type: ignore[misc]
    """Loaded with ``spec_name="KVOffloadSpec"``, ``spec_module_path="kvoffload.connector.vllm"``."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.endpoint = str(self.extra_config.get("kvoffload_control", "")) or os.environ.get(
            "KVOFFLOAD_CONTROL", "")
        if not self.endpoint:
            raise ValueError("kv_connector_extra_config needs 'kvoffload_control' (the daemon's "
                             "control endpoint, e.g. ipc:///run/kvoffload/control.sock)")
        if self.blocks_per_chunk != 1:
            raise ValueError("kvoffload stores one GPU block per key: blocks_per_chunk (or "
                             "block_size in kv_connector_extra_config) must be 1 block")
        self.settings = manager_settings(self.extra_config)
        self.kv_cache_config = KV_CACHE_CONFIG.get() or _from_callers(
            "kv_cache_config", _is_kv_cache_config)
        if self.kv_cache_config is None:
            log.warning("kvoffload: KVCacheConfig not found; group kinds are inferred from "
                        "window sizes (use kv_connector=KVOffloadConnector to pass it)")
        self.geometry = build_geometry(config, self.kv_cache_config)
        ids = [g.group_id for g in config.groups]
        if ids != list(range(len(ids))):
            log.warning("kvoffload: offloaded KV-cache groups %s are not 0..n-1; their keys "
                        "will not match the daemon's and every lookup misses", ids)
        self._manager: DaemonOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            s = self.settings
            from kvoffload.connector.vllm.connector import DaemonLink, DaemonWaiter

            # CURVE keys from kv_connector_extra_config, else the KVOFFLOAD_CURVE_* environment.
            curve = CurveClientKeys.from_settings(self.extra_config)
            client = DaemonClient(self.endpoint, timeout_ms=s.timeout_ms,
                                  name=f"vllm scheduler {self.config.engine_id} pid {os.getpid()}",
                                  time_model=s.time_model, curve=curve)
            link = DaemonLink(client, self.geometry, s.timeout_ms, s.retry_ms)
            waiter = None
            if s.wait_ms > 0:
                waiter = DaemonWaiter(self.endpoint, self.geometry, s.wait_ms, s.timeout_ms,
                                      curve=curve)
            self._manager = DaemonOffloadingManager(
                link, self.geometry, s, waiter=waiter,
                group_ids=[g.group_id for g in self.config.groups])
            scheduler = _from_callers("self", _is_offloading_scheduler)
            if scheduler is not None:
                self.bind_scheduler(scheduler)
            elif KV_CACHE_CONFIG.get() is None:  # KVOffloadConnector binds it right after
                log.warning("kvoffload: vLLM's scheduler state not found; lookups fall back to "
                            "per-key probes (one step of delay per hit)")
            self._manager.connect()
        return self._manager

    def bind_scheduler(self, scheduler: Any) -> None:
        """Let the manager read per-request state from vLLM's offloading scheduler."""
        from kvoffload.connector.vllm.connector import SchedulerRequests

        assert self._manager is not None
        self._manager.requests = SchedulerRequests(scheduler, self.settings.prefetch_max)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from kvoffload.connector.vllm.worker import DaemonOffloadingWorker

            par = self.config.parallel
            self._worker = DaemonOffloadingWorker(
                kv_caches, rank=par.rank, tp_world_size=max(1, par.world_size),
                cpu_async=_setting(self.extra_config, "kvoffload_copy_async", True, bool))
        return self._worker
