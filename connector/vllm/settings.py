"""Our ``kv_connector_extra_config`` keys, parsed once, and the vLLM versions we are tested on.

Every key is documented in docs/vllm.md (``KNOWN_KEYS``; a test checks the table against it). A
bad value, an unknown ``kvoffload_*`` key (a typo would otherwise be a silent default) or a vLLM
setting the plugin cannot serve safely stops the engine's start with one line that names the
key; so does a vLLM version this plugin was not tested with (the scheduler's calling pattern is
the contract, and it changes between releases), unless the operator overrides it.
"""

from __future__ import annotations

import difflib
import logging
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


# Every kvoffload_* key the plugin reads (settings.py, spec.py, geometry.py, and the CURVE keys
# daemon/control/security.py reads); a key read anywhere else must be added here.
KNOWN_KEYS = frozenset({
    "kvoffload_control", "kvoffload_timeout_ms", "kvoffload_retry_ms", "kvoffload_liveness_ms",
    "kvoffload_sync_ms", "kvoffload_io_sched_batch", "kvoffload_store_reserve",
    "kvoffload_find_ttl_steps", "kvoffload_offload_policy", "kvoffload_reset_daemon",
    "kvoffload_namespace", "kvoffload_prefill_tokens_per_s", "kvoffload_copy_bytes_per_s",
    "kvoffload_curve_client_key", "kvoffload_curve_server_public_key", "kvoffload_pool_path",
    "kvoffload_copy_async", "kvoffload_pending_wait_ms",
})
# Keys earlier versions read (the per-lookup round trips before the shared index): still in
# operators' configs and older docs, so they are ignored with a warning rather than refused.
RETIRED_KEYS = frozenset({"kvoffload_lookup_wait_ms", "kvoffload_prefetch",
                          "kvoffload_prefetch_max"})

log = logging.getLogger("kvoffload.connector.vllm")


class UntestedVllm(RuntimeError):
    pass


class SettingError(ValueError):
    """A setting the plugin refuses at engine start (one line, naming the setting)."""


def check_vllm_version(version: str) -> None:
    if version in TESTED_VLLM or os.environ.get(ALLOW_UNTESTED_ENV, "") in _BOOL_TRUE:
        return
    raise UntestedVllm(f"kvoffload is tested with vLLM {', '.join(TESTED_VLLM)}, not {version}; "
                       f"set {ALLOW_UNTESTED_ENV}=1 to load it anyway")


def check_keys(extra: Mapping[str, Any]) -> None:
    """Refuse an unknown ``kvoffload_*`` key, naming the closest known one."""
    for key in extra:
        if not str(key).lower().startswith("kvoffload") or key in KNOWN_KEYS:
            continue
        if key in RETIRED_KEYS:
            log.warning("kvoffload: kv_connector_extra_config[%r] is no longer read; ignored", key)
            continue
        close = difflib.get_close_matches(str(key), sorted(KNOWN_KEYS), n=1, cutoff=0.0)
        raise SettingError(f"kv_connector_extra_config[{key!r}] is not a kvoffload setting; "
                           f"did you mean {close[0]!r}? (docs/vllm.md lists them)")


def check_sync_loads(extra: Mapping[str, Any]) -> None:
    """Refuse vLLM's sync (expedited) loads: nothing can check them before they are used.

    vLLM 0.33 starts and waits a sync load inside ``start_load_kv``, before the forward that
    reads it; the generation check after the copy runs in ``get_finished``, after the forward;
    and a sync load reported failed trips the offloading worker's ``assert success``. Until the
    worker proves expedited loads inside ``wait`` (before the forward), a nonzero budget would
    let a forward read a slot that went to another writer.
    """
    raw = extra.get("sync_load_budget_bytes", 0)
    try:
        budget = int(raw)
    except (TypeError, ValueError):
        raise SettingError(f"kv_connector_extra_config['sync_load_budget_bytes'] must be an "
                           f"integer, got {raw!r}") from None
    if budget:
        raise SettingError(
            f"kv_connector_extra_config['sync_load_budget_bytes']={budget} is refused by "
            "kvoffload: vLLM's forward reads a sync load before the plugin can check that its "
            "pool slots were not reused, and a failed one stops the engine; remove it (async "
            "loads are checked)")


@dataclass(frozen=True)
class ManagerSettings:
    timeout_ms: int = 500
    retry_ms: int = 1000
    liveness_ms: int = 2000
    sync_ms: int = 2  # longest wait at a step's start for this engine's own writes' replies
    policy: str = "request"  # vLLM offload policy: "request" (REQUEST_LEVEL) or "chunk"
    reset_scope: str = "own"  # what a connector cache reset drops in the daemon
    # Empty slots kept at hand so prepare_store never waits (the floor); None: a share of the
    # pool (reservation.auto_floor).
    reserve: int | None = None
    find_ttl_steps: int = 64  # a key no tier holds is asked again after this many steps
    # Longest a request is deferred on a key another engine is storing or a tier is finding:
    # a few steps of a busy engine, well under the lease a frozen writer holds its keys for.
    pending_wait_ms: int = 250
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


def _reserve(extra: Mapping[str, Any]) -> int | None:
    """``kvoffload_store_reserve``: a number of slots, or "auto" (the default)."""
    raw = extra.get("kvoffload_store_reserve", "auto")
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        return None
    value: int = _setting(extra, "kvoffload_store_reserve", raw, int)
    if value <= 0:  # 0 is not "auto": a reservation of nothing would defer every store
        raise ValueError("kv_connector_extra_config['kvoffload_store_reserve'] must be "
                         "positive or 'auto'")
    return value


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
        reserve=_reserve(extra),
        find_ttl_steps=_setting(extra, "kvoffload_find_ttl_steps", 64, int),
        pending_wait_ms=_setting(extra, "kvoffload_pending_wait_ms", 250, int),
        time_model=_time_model(extra),
        io_sched_batch=_setting(extra, "kvoffload_io_sched_batch", False, bool))
    for key, value in (("kvoffload_retry_ms", settings.retry_ms),
                       ("kvoffload_sync_ms", settings.sync_ms),
                       ("kvoffload_pending_wait_ms", settings.pending_wait_ms)):
        if value < 0:
            raise ValueError(f"kv_connector_extra_config[{key!r}] must be >= 0")
    for key, value in (("kvoffload_timeout_ms", settings.timeout_ms),
                       ("kvoffload_liveness_ms", settings.liveness_ms)):
        if value <= 0:
            raise ValueError(f"kv_connector_extra_config[{key!r}] must be positive")
    return settings
