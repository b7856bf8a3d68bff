"""vLLM 0.33's own scheduler-side offloading, built on a CPU-only machine for baselines.

What is real: vLLM's ``OffloadingConnector`` in the SCHEDULER role, its
``OffloadingConnectorScheduler`` (lookup, load keys, store policy incl. the ``CHUNK_LEVEL``
gap of shared/spec/partial-tail.md, partial-tail stores from copy-on-write hand-offs) and its
``CPUOffloadingManager`` (LRU). What is not: the core scheduler, the GPU block pool and the
workers (``bench/vllm_chat.py``'s ``VllmChatEngine`` plays them for the what-if).

The setup follows shared/spec/vllm-on-cpu.md (``VLLM_TARGET_DEVICE=cpu``, a stub model config,
hand-built KV-cache groups), like tests/vllm_harness.py, which bench code must not import.
vLLM is imported lazily: this module imports on a machine without vLLM, and
:func:`vllm_import_error` says why the baseline cannot run.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

from kvoffload.daemon.base import Geometry, GroupKind

SPEC_NAME = "BaselineCPUOffloadingSpec"


def mark_not_run(out: dict[str, Any]) -> bool:
    """True (and the reason in ``out``) when vLLM 0.33 is missing: a suite that compares
    against vLLM's own code never reports a ratio without it."""
    reason = vllm_import_error()
    if reason is None:
        return False
    out["reason"] = out["not_run"] = f"vLLM baseline not run: {reason}"
    return True


@functools.cache
def vllm_import_error() -> str | None:
    """None when vLLM 0.33 imports here, else why not (shown as the reason a suite did not run)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: F401
            OffloadingConnector,
        )
    except Exception as exc:  # any import failure means "no usable vLLM"
        return f"vLLM cannot be imported: {type(exc).__name__}: {exc}"
    version = getattr(vllm, "__version__", "?")
    if not version.startswith("0.33"):
        return f"the baselines pin vLLM 0.33 semantics, found vLLM {version}"
    return None


@functools.cache
def _spec_class() -> type:
    """vLLM's own ``CPUOffloadingManager`` behind a spec sized in chunks, not bytes.

    vLLM's ``CPUOffloadingSpec`` derives its chunk count from GPU tensor sizes, which a
    CPU-only scheduler does not have; giving the manager the daemon's slot count keeps the
    pool the same for both (one chunk or slot holds one group block of one key)."""
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    class BaselineCPUOffloadingSpec(OffloadingSpec):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self._manager = CPUOffloadingManager(
                num_chunks=int(self.extra_config["num_chunks"]),
                cache_policy=self.extra_config.get("eviction_policy", "lru"))

        def get_manager(self) -> Any:
            return self._manager

        def get_worker(self, kv_caches: Any) -> Any:
            raise NotImplementedError("scheduler-side baseline: no worker")

    return BaselineCPUOffloadingSpec


def __getattr__(name: str) -> Any:
    # vLLM's OffloadingSpecFactory does getattr(module, spec_name): build the class only then.
    if name == SPEC_NAME:
        return _spec_class()
    raise AttributeError(name)


class StubModelConfig:
    """What the offloading config code reads from ``ModelConfig`` (which would need a model).
    ``kv_heads``: the model's KV heads (a TP world of N splits them, one page per rank)."""

    model = "kvoffload-bench-stub"
    use_mla = False

    def __init__(self, max_model_len: int, kv_heads: int = 1) -> None:
        import torch

        self.dtype = torch.float16
        self.max_model_len = max_model_len
        self.kv_heads = kv_heads

    def get_total_num_kv_heads(self) -> int:
        return self.kv_heads


def kv_cache_config(geometry: Geometry, num_blocks: int = 1 << 16, head_size: int = 8) -> Any:
    """vLLM KV-cache groups mirroring ``geometry`` (attention + Mamba align); tiny pages."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    specs: list[Any] = []
    for g in geometry.groups:
        if g.kind is GroupKind.FULL_ATTENTION:
            specs.append(FullAttentionSpec(block_size=g.tokens_per_block, num_kv_heads=1,
                                           head_size=head_size, dtype=torch.float16))
        elif g.kind is GroupKind.MAMBA:
            specs.append(MambaSpec(block_size=g.tokens_per_block, shapes=((4,),),
                                   dtypes=(torch.float16,),
                                   mamba_cache_mode="align" if g.mamba_align else "none"))
        else:
            raise ValueError(f"baseline supports attention and Mamba groups, not {g.kind}")
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s)
                                          for i, s in enumerate(specs)])


def build_connector(geometry: Geometry, num_chunks: int, *, offload_prompt_only: bool = True,
                    max_model_len: int = 1 << 20, extra: dict[str, Any] | None = None,
                    connector_cls: Any = None, head_size: int = 8) -> Any:
    """vLLM's SCHEDULER-role ``OffloadingConnector`` over its own CPU manager of ``num_chunks``.

    ``offload_prompt_only`` is vLLM 0.33's default (True): decode tokens are never stored.
    ``extra`` (a whole ``kv_connector_extra_config``) and ``connector_cls`` load another spec
    the same way, ours for instance, in front of the very same scheduler code."""
    reason = vllm_import_error()
    if reason is not None:
        raise RuntimeError(reason)
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    block = geometry.groups[0].tokens_per_block
    cache = CacheConfig(block_size=block, enable_prefix_caching=True,
                        prefix_match_unit=geometry.tokens_per_hash, mamba_cache_mode="align")
    transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config=extra or {
                                    "spec_name": SPEC_NAME,
                                    "spec_module_path": "kvoffload.bench.vllm_baseline",
                                    "num_chunks": num_chunks,
                                    "offload_prompt_only": offload_prompt_only})
    config = VllmConfig(cache_config=cache, kv_transfer_config=transfer)
    config.model_config = StubModelConfig(max_model_len)  # type: ignore[assignment]
    cls = connector_cls or OffloadingConnector
    return cls(config, KVConnectorRole.SCHEDULER, kv_cache_config(geometry, head_size=head_size))


def end_step(connector: Any) -> Any:
    """Close a scheduler step with nothing scheduled (vLLM's ``build_connector_meta``)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    out = SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={}, total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[])
    return connector.build_connector_meta(out)


@functools.cache
def _block_hasher(tokens_per_hash: int) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(tokens_per_hash, sha256)


def make_request(token_ids: Sequence[int], request_id: str, tokens_per_hash: int,
                 max_tokens: int = 16, *, kv_transfer_params: dict[str, Any] | None = None,
                 cache_salt: str | None = None) -> Any:
    """A real vLLM ``Request`` hashed by vLLM's own block hasher."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    req = Request(request_id, list(token_ids), SamplingParams(max_tokens=max(1, max_tokens)),
                  None, cache_salt=cache_salt, block_hasher=_block_hasher(tokens_per_hash))
    req.kv_transfer_params = kv_transfer_params
    return req


def build_vllm_config(extra_config: Mapping[str, Any], block_size: int = 16,
                      prefix_match_unit: int | None = 4, *, enable_prefix_caching: bool = True,
                      mamba_cache_mode: str = "align", max_model_len: int = 8192) -> Any:
    """A ``VllmConfig`` whose KV transfer config loads the spec named in ``extra_config``."""
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig

    cache = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                        prefix_match_unit=prefix_match_unit,
                        mamba_cache_mode=mamba_cache_mode)  # type: ignore[arg-type]
    transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config=dict(extra_config))
    config = VllmConfig(cache_config=cache, kv_transfer_config=transfer)
    config.model_config = StubModelConfig(max_model_len)  # type: ignore[assignment]
    return config


def store_keys(connector: Any, keys: Sequence[bytes]) -> None:
    """Put keys straight into vLLM's CPU manager as stored and ready (benchmark setup)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        _create_req_context,
    )

    manager = connector.connector_scheduler.manager
    ctx = _create_req_context(make_request([0], "setup", 1))
    out = manager.prepare_store(list(keys), ctx)
    assert out is not None, "the CPU manager has no room for the setup keys"
    manager.complete_store(list(keys), ctx)


# ------------------------------------------------------------------------------- chat driver
