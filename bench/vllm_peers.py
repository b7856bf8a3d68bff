"""vLLM 0.33's per-engine CPU offloading in each configuration a user can pick, sized in blocks.

The multi-engine suites (sharing, trace, restart) compare one daemon for every engine against
each engine running vLLM's own ``CPUOffloadingSpec``; the peer's best is the best of:

* store policy ``chunk`` (vLLM's default ``CHUNK_LEVEL``: chunks a request loaded are not
  offered again) or ``request`` (``REQUEST_LEVEL``, every chunk offered: a few-line
  out-of-tree subclass, below, as vLLM's own tiering specs do);
* eviction ``lru`` (its default) or ``arc`` (``eviction_policy``).

Memory is compared in **blocks**: vLLM pads each chunk to a 4 KiB page (``SharedOffloadRegion``
alignment), which at this suite's 512-byte pages would give it 8x fewer blocks than the same
bytes give our pool; at real sizes (MiBs per block) the padding is negligible, so equal block
counts are what equal bytes mean there. ``offload_engine`` checks vLLM's manager got exactly
the chunks asked for.
"""

from __future__ import annotations

import functools
from typing import Any

# vLLM chunk bytes on this engine geometry: the 4 KiB alignment (asserted in offload_engine).
CHUNK_BYTES = 4096
POLICIES = ("chunk", "request")
EVICTIONS = ("lru", "arc")
CONFIGS = tuple(f"{p}-{e}" for p in POLICIES for e in EVICTIONS)
REQUEST_SPEC = "RequestLevelCPUOffloadingSpec"
TIERING_SPEC = "TieringOffloadingSpec"  # vLLM's own, registered in its OffloadingSpecFactory


@functools.cache
def _request_level_spec() -> type:
    from vllm.v1.kv_offload.base import OffloadPolicy, RequestOffloadingContext
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    class RequestLevelCPUOffloadingSpec(CPUOffloadingSpec):
        """vLLM's CPU offloading with ``REQUEST_LEVEL`` store policy."""

        def get_manager(self) -> Any:
            manager: Any = super().get_manager()
            if not getattr(manager, "_request_level", False):
                original = manager.on_new_request

                def on_new_request(ctx: Any) -> Any:
                    original(ctx)  # its per-request bookkeeping
                    return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)

                manager.on_new_request = on_new_request
                manager._request_level = True
            return manager

    return RequestLevelCPUOffloadingSpec


def __getattr__(name: str) -> Any:
    # vLLM's OffloadingSpecFactory does getattr(module, spec_name): build the class only then.
    if name == REQUEST_SPEC:
        return _request_level_spec()
    raise AttributeError(name)


def offload_engine(chunks: int, config: str = "chunk-lru", *,
                   tiers: list[dict[str, Any]] | None = None, chunk_bytes: int = CHUNK_BYTES,
                   **engine: Any) -> Any:
    """A ``MiniEngine`` on vLLM's own CPU offloading with ``chunks`` blocks of host memory in
    configuration ``config`` (``POLICY-EVICTION``); ``engine``: gpu_blocks, shape, extras.
    ``chunk_bytes``: one of vLLM's chunks on this engine's geometry (a page padded to 4 KiB).

    ``tiers``: vLLM's ``TieringOffloadingSpec`` instead, the same CPU cache as its primary
    tier and these ``secondary_tiers`` below it (e.g. ``{"type": "fs", "root_dir": D}``).
    Its store policy is the tiers' to choose (the fs tier asks for chunk level), so only
    ``chunk-*`` configurations exist there."""
    from kvoffload.bench.vllm_engine import vllm_cpu_engine

    policy, eviction = config.split("-")
    if policy not in POLICIES or eviction not in EVICTIONS:
        raise ValueError(f"unknown vLLM offload configuration {config!r}: one of {CONFIGS}")
    extra: dict[str, Any] = {"eviction_policy": eviction}
    if tiers is not None:
        if policy != "chunk":
            raise ValueError(f"{config}: vLLM's tiering spec takes its store policy from "
                             "its tiers (chunk level for fs)")
        extra.update(spec_name=TIERING_SPEC, secondary_tiers=tiers)
    elif policy == "request":
        extra.update(spec_name=REQUEST_SPEC, spec_module_path="kvoffload.bench.vllm_peers")
    e = vllm_cpu_engine(chunks * chunk_bytes, **extra, **engine)
    manager = e.connector.connector_scheduler.manager
    got = (manager.primary_tier if tiers is not None else manager)._num_chunks
    if got != chunks:
        e.shutdown()
        raise AssertionError(f"vLLM's manager has {got} chunks, {chunks} asked for "
                             f"(its chunk is no longer {chunk_bytes} B here)")
    return e


def pool_slots(engine: Any) -> int:
    """Slots of the daemon pool an engine with our plugin attached to."""
    reg = engine.connector.connector_scheduler.manager.session.reg
    return int(reg.num_slots)
