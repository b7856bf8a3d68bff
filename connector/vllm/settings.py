"""Our ``kv_connector_extra_config`` keys, parsed once, and the vLLM versions we are tested on.

Every key is documented in docs/vllm.md. A bad value stops the engine's start with one line that
names the key; so does a vLLM version this plugin was not tested with (the scheduler's calling
pattern is the contract, and it changes between releases), unless the operator overrides it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TESTED_VLLM = ("0.33.0",)
ALLOW_UNTESTED_ENV = "KVOFFLOAD_ALLOW_UNTESTED_VLLM"

_BOOL_TRUE = ("1", "true", "yes", "on")

# vLLM's ``offload_prompt_only`` when the operator does not set it (KVOffloadSpec applies it).
# Measured on hybrid_chat through vLLM (BENCHMARKS.md, docs/vllm.md): see the numbers there.
OFFLOAD_PROMPT_ONLY = True


class UntestedVllm(RuntimeError):
    pass


def check_vllm_version(version: str) -> None:
    if version in TESTED_VLLM or os.environ.get(ALLOW_UNTESTED_ENV, "") in _BOOL_TRUE:
        return
    raise UntestedVllm(f"kvoffload is tested with vLLM {', '.join(TESTED_VLLM)}, not {version}; "
                       f"set {ALLOW_UNTESTED_ENV}=1 to load it anyway")


@dataclass(frozen=True)
class ManagerSettings:
    timeout_ms: int = 500
    retry_ms: int = 1000
    liveness_ms: int = 2000
    sync_ms: int = 2  # longest wait at a step's start for this engine's own writes' replies
    policy: str = "request"  # vLLM offload policy: "request" (REQUEST_LEVEL) or "chunk"
    reset_scope: str = "own"  # what a connector cache reset drops in the daemon
    reserve: int = 64  # empty slots kept at hand so prepare_store never waits
    find_ttl_steps: int = 64  # a key no tier holds is asked again after this many steps
    time_model: tuple[float, float] | None = None
    io_sched_batch: bool = False  # the session's I/O thread in SCHED_BATCH (client.py: why)


def _setting(extra: Mapping[str, Any], key: str, default: Any, kind: type) -> Any:
    raw = extra.get(key, default)
    try:
        if kind is bool:
            return raw if isinstance(raw, bool) else str(raw).lower() in _BOOL_TRUE
        return kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be {kind.__name__}, "
                         f"got {raw!r}") from None


def _time_model(extra: Mapping[str, Any]) -> tuple[float, float] | None:
    """Cost-aware tails: both rates, or neither (off)."""
    prefill = _setting(extra, "kvoffload_prefill_tokens_per_s", 0.0, float)
    copy = _setting(extra, "kvoffload_copy_bytes_per_s", 0.0, float)
    if (prefill > 0) != (copy > 0) or prefill < 0 or copy < 0:
        raise ValueError("kvoffload_prefill_tokens_per_s and kvoffload_copy_bytes_per_s are "
                         "set together, both positive")
    return (prefill, copy) if prefill else None


def manager_settings(extra: Mapping[str, Any]) -> ManagerSettings:
    policy = str(extra.get("kvoffload_offload_policy", "request"))
    if policy not in ("request", "chunk"):
        raise ValueError("kv_connector_extra_config['kvoffload_offload_policy'] must be "
                         "'request' or 'chunk'")
    reset = extra.get("kvoffload_reset_daemon", "own")
    # Older configs said true/false: true meant the namespace, false nothing.
    scope = {True: "namespace", False: "none", "true": "namespace", "false": "none"}.get(
        reset if isinstance(reset, bool) else str(reset).lower(), str(reset))
    if scope not in ("own", "namespace", "none"):
        raise ValueError("kv_connector_extra_config['kvoffload_reset_daemon'] must be 'own', "
                         "'namespace' or 'none'")
    settings = ManagerSettings(
        timeout_ms=_setting(extra, "kvoffload_timeout_ms", 500, int),
        retry_ms=_setting(extra, "kvoffload_retry_ms", 1000, int),
        liveness_ms=_setting(extra, "kvoffload_liveness_ms", 2000, int),
        sync_ms=_setting(extra, "kvoffload_sync_ms", 2, int),
        policy=policy, reset_scope=scope,
        reserve=_setting(extra, "kvoffload_store_reserve", 64, int),
        find_ttl_steps=_setting(extra, "kvoffload_find_ttl_steps", 64, int),
        time_model=_time_model(extra),
        io_sched_batch=_setting(extra, "kvoffload_io_sched_batch", False, bool))
    for key, value in (("kvoffload_retry_ms", settings.retry_ms),
                       ("kvoffload_sync_ms", settings.sync_ms)):
        if value < 0:
            raise ValueError(f"kv_connector_extra_config[{key!r}] must be >= 0")
    for key, value in (("kvoffload_timeout_ms", settings.timeout_ms),
                       ("kvoffload_liveness_ms", settings.liveness_ms),
                       ("kvoffload_store_reserve", settings.reserve)):
        if value <= 0:
            raise ValueError(f"kv_connector_extra_config[{key!r}] must be positive")
    return settings
