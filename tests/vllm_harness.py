"""Drive vLLM 0.33's real scheduler-side ``OffloadingConnector`` on a CPU-only machine.

Reusable by any test that needs vLLM's own scheduler logic (lookups, loads, stores) in front
of an offloading spec of ours. Everything imports vLLM lazily, so a test module can import
this file on a machine without vLLM and skip cleanly:

    from tests.vllm_harness import require_vllm, build_scheduler_connector, make_request

    def test_something():
        require_vllm()  # pytest.skip with the import error when vLLM is missing
        conn = build_scheduler_connector(
            {"spec_name": "MySpec", "spec_module_path": "my_module"},
            kv_cache_config=hybrid_kv_cache_config(),
        )
        req = make_request(list(range(30)), hash_block_size=tokens_per_hash(conn))
        conn.on_new_request(req)
        hit, is_async = conn.get_num_new_matched_tokens(req, 0)

The setup follows shared/spec/vllm-on-cpu.md: ``VLLM_TARGET_DEVICE=cpu``, a stub model config
(vLLM's ``ModelConfig`` would download a model), and hand-built ``KVCacheConfig`` groups.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

if TYPE_CHECKING:
    from kvoffload.connector.vllm.manager import DaemonOffloadingManager
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.kv_offload.base import OffloadingManager
    from vllm.v1.request import Request


# One check for the whole project: the benchmarks' baseline loader owns it.
from kvoffload.bench.vllm_baseline import vllm_import_error  # noqa: E402


def require_vllm() -> None:
    """Skip the calling test unless vLLM 0.33 is importable."""
    reason = vllm_import_error()
    if reason is not None:
        pytest.skip(reason)


# --------------------------------------------------------------------------- KV cache specs


def full_attention_spec(block_size: int = 16) -> FullAttentionSpec:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
    )


def sliding_window_spec(block_size: int = 16, sliding_window: int = 40) -> SlidingWindowSpec:
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
        sliding_window=sliding_window,
    )


def mamba_spec(block_size: int = 16, mode: str = "align") -> MambaSpec:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=block_size, shapes=((4,),), dtypes=(torch.float16,), mamba_cache_mode=mode
    )


def make_kv_cache_config(specs: Sequence[KVCacheSpec], num_blocks: int = 1024) -> KVCacheConfig:
    """One KV-cache group per spec, in order (group i = layer ``layer{i}``)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)],
    )


def hybrid_kv_cache_config(block_size: int = 16, num_blocks: int = 1024) -> KVCacheConfig:
    """Group 0 full attention, group 1 Mamba in align mode: the partial-tail setup."""
    return make_kv_cache_config(
        [full_attention_spec(block_size), mamba_spec(block_size)], num_blocks
    )


def attention_kv_cache_config(block_size: int = 16, num_blocks: int = 1024) -> KVCacheConfig:
    """A single full-attention group (vLLM then hashes per block)."""
    return make_kv_cache_config([full_attention_spec(block_size)], num_blocks)


# --------------------------------------------------------------------------- configs


# One stub model config and one config builder for tests and benchmarks alike.
from kvoffload.bench.vllm_baseline import build_vllm_config as _build_vllm_config  # noqa: E402


def build_vllm_config(extra_config: Mapping[str, Any], block_size: int = 16,
                      prefix_match_unit: int | None = 4, **kwargs: Any) -> VllmConfig:
    """A ``VllmConfig`` whose KV transfer config loads our spec into ``OffloadingConnector``."""
    require_vllm()
    return _build_vllm_config(extra_config, block_size, prefix_match_unit, **kwargs)


def build_scheduler_connector(
    extra_config: Mapping[str, Any],
    kv_cache_config: KVCacheConfig | None = None,
    block_size: int = 16,
    prefix_match_unit: int | None = 4,
    *,
    enable_prefix_caching: bool = True,
    max_model_len: int = 8192,
    connector_class: Any = None,
) -> OffloadingConnector:
    """vLLM's SCHEDULER-role ``OffloadingConnector`` with the spec named in ``extra_config``
    (``spec_name`` + ``spec_module_path``; the module must be importable by that name).

    ``kv_cache_config`` defaults to :func:`hybrid_kv_cache_config`. ``prefix_match_unit`` is
    vLLM's ``tokens_per_hash``; vLLM rejects any value but ``None`` or ``block_size`` when
    there is a single KV-cache group. The spec instance is reachable as
    ``conn.scheduler.manager`` (the manager it built).
    """
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    if kv_cache_config is None:
        kv_cache_config = hybrid_kv_cache_config(block_size)
    vllm_config = build_vllm_config(
        extra_config,
        block_size,
        prefix_match_unit,
        enable_prefix_caching=enable_prefix_caching,
        max_model_len=max_model_len,
    )
    cls = connector_class or OffloadingConnector
    return cls(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


M = TypeVar("M", bound="OffloadingManager")


def manager_of(connector: OffloadingConnector, cls: type[M]) -> M:
    """The manager the spec built behind vLLM's connector, checked to be a ``cls`` (vLLM types
    it as any ``OffloadingManager``; the tests read the attributes of the one they built)."""
    manager = connector.scheduler.manager
    assert isinstance(manager, cls), type(manager)
    return manager


def daemon_manager(connector: OffloadingConnector) -> DaemonOffloadingManager:
    """Our manager behind a connector built with our spec (see :func:`manager_of`)."""
    from kvoffload.connector.vllm.manager import DaemonOffloadingManager

    return manager_of(connector, DaemonOffloadingManager)


def tokens_per_hash(connector: OffloadingConnector) -> int:
    """The hash unit the connector resolved (hash requests with this)."""
    return connector.scheduler.config.tokens_per_hash


# --------------------------------------------------------------------------- requests


def make_request(
    token_ids: Sequence[int],
    request_id: str | None = None,
    *,
    hash_block_size: int = 4,
    max_tokens: int = 16,
    kv_transfer_params: dict[str, Any] | None = None,
    cache_salt: str | None = None,
) -> Request:
    """A real ``Request`` whose ``block_hashes`` come from vLLM's own block hasher (sha256,
    one hash per ``hash_block_size`` tokens)."""
    require_vllm()
    from kvoffload.bench.vllm_baseline import make_request as _make_request

    return _make_request(token_ids, request_id or f"req-{uuid.uuid4().hex[:12]}",
                         hash_block_size, max_tokens, kv_transfer_params=kv_transfer_params,
                         cache_salt=cache_salt)


# --------------------------------------------------------------------------- allocation


def new_kv_cache_manager(
    kv_cache_config: KVCacheConfig, block_size: int = 16, hash_block_size: int = 4
) -> KVCacheManager:
    """vLLM's GPU-side block manager for ``kv_cache_config`` (prefix caching on)."""
    require_vllm()
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    return KVCacheManager(
        kv_cache_config,
        max_model_len=8192,
        scheduler_block_size=block_size,
        hash_block_size=hash_block_size,
    )


def blocks_for_load(
    manager: KVCacheManager, request: Request, num_local_tokens: int, num_external_tokens: int
) -> KVCacheBlocks:
    """The blocks the core scheduler hands ``update_state_after_alloc`` for an async load.

    With no local prefix this is vLLM's real allocation (``allocate_slots`` with zero new
    tokens, as the scheduler does for a request that waits for its load). With a local
    prefix, faking real GPU prefix-cache hits would need whole prior requests, so the blocks
    are built to the same rule the managers apply: every block below a group's skipped
    tokens (``get_num_skipped_tokens``: the sliding window, or all but Mamba's last state) is
    the null block, the local prefix is cached blocks, the rest fresh blocks.
    Free the request afterwards with ``manager.free(request)``.
    """
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    if num_local_tokens == 0:
        allocated = manager.allocate_slots(
            request, 0, num_external_computed_tokens=num_external_tokens, delay_cache_blocks=True
        )
        assert allocated is not None, "KV cache too small for the test request"
        return manager.get_blocks(request.request_id)

    total = num_local_tokens + num_external_tokens
    next_id = 1
    groups: list[list[Any]] = []
    null = KVCacheBlock(block_id=0, is_null=True)
    for single in manager.coordinator.single_type_managers:
        block_size = single.block_size
        skipped = single.get_num_skipped_tokens(total) // block_size
        local_blocks = -(-num_local_tokens // block_size)
        blocks: list[Any] = []
        for i in range(-(-total // block_size)):
            if i < skipped:
                blocks.append(null)
                continue
            block = KVCacheBlock(block_id=next_id)
            next_id += 1
            if i < local_blocks:
                block._block_hash = b"local-prefix"  # type: ignore[assignment]
            blocks.append(block)
        groups.append(blocks)
    return KVCacheBlocks(tuple(groups))
