"""One TP rank of an engine, in its own process: vLLM 0.33's WORKER-role OffloadingConnector
with our spec loaded, over CPU KV tensors, storing and loading its page of every pool slot.

Run by tests/connector/transfer/test_multiproc.py through ``multiprocessing`` (spawn). What each rank
reports is computed from vLLM's own per-layer views, never from our layout code.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

SENTINEL = 0x5A
LAYERS = ("attn.0", "attn.1")
STATES = ("mamba.0", "mamba.1")


def _views(rank: int, world: int, extra: dict[str, Any]) -> tuple[Any, dict[str, Any], Any]:
    """vLLM's WORKER connector for ``rank`` of ``world`` and its layers' 4-D KV views."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch
    from kvoffload.bench.vllm_baseline import StubModelConfig
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        MambaSpec,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout


    vc = VllmConfig(
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector",
                                            kv_role="kv_both", kv_connector_extra_config=extra),
        cache_config=CacheConfig(block_size=16, mamba_cache_mode="align", prefix_match_unit=4),
    )
    vc.model_config = StubModelConfig(4096, kv_heads=2 * world)  # type: ignore[assignment]
    vc.cache_config.kv_cache_layout = "LBHNC"
    vc.parallel_config.tensor_parallel_size = world
    vc.parallel_config.world_size = world
    vc.parallel_config.rank = rank
    att = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    mamba = MambaSpec(block_size=16, shapes=((3, 16), (4, 8)), dtypes=(torch.float16,) * 2,
                      page_size_padded=att.page_size_bytes, mamba_cache_mode="align")
    groups = [KVCacheGroupSpec(list(LAYERS), att), KVCacheGroupSpec(list(STATES), mamba)]
    cfg = get_kv_cache_config_from_groups(vc, groups, 64 * 2 * att.page_size_bytes)
    gen = torch.Generator().manual_seed(1000 + rank)  # every rank holds different KV
    buf = torch.randint(-128, 128, (cfg.kv_cache_tensors[0].size,), dtype=torch.int8,
                        generator=gen)
    views: dict[str, Any] = {}
    for kt in cfg.kv_cache_tensors:
        spec = next(g.kv_cache_spec for g in cfg.kv_cache_groups if kt.layers[0] in g.layer_names)
        views.update(zip(kt.layers, create_kv_cache_views(buf, spec, cfg.num_blocks,
                                                          KVCacheLayout.LBHNC, kt), strict=True))
    conn = OffloadingConnector(vc, KVConnectorRole.WORKER, cfg)
    conn.register_kv_caches(views)
    return conn, views, buf


def _block(views: dict[str, Any], layers: tuple[str, ...], b: int) -> bytes:
    """What a slot page must hold for block ``b``: the layers' bytes, in layer order."""
    return b"".join(views[n][b].contiguous().view(-1).numpy().view("int8").tobytes()
                    for n in layers)


def rank_main(rank: int, world: int, pool: dict[str, Any], barrier: Any, out: Any) -> None:
    try:
        out.put((rank, _run(rank, world, pool, barrier)))
    except BaseException as exc:  # the parent reports it; a child traceback would be lost
        barrier.abort()
        out.put((rank, f"error: {exc!r}"))


def _run(rank: int, world: int, pool: dict[str, Any], barrier: Any) -> dict[str, Any]:
    from kvoffload.connector.vllm.load_spec import PoolInfo, PoolSlotsSpec
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    extra = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.connector.vllm",
             "kvoffload_control": "ipc:///nonexistent/kvoffload.sock",  # workers never call it
             "kvoffload_pool_path": pool["path"]}
    conn, views, buf = _views(rank, world, extra)
    worker = conn.connector_worker.worker
    mapped_early = worker._task is not None  # kvoffload_pool_path reached the worker
    assert (worker.rank, worker.tp_world_size) == (rank, world), (worker.rank, worker.tp_world_size)
    info = PoolInfo(pool["daemon_id"], pool["path"], pool["bytes"], pool["slot_bytes"],
                    pool["slot_bytes"] // world, pool["index_path"])
    half = pool["slots"] // 2
    # Slots [0, half): attention blocks 1.., slots [half, 2 * half): Mamba states 30..
    attn, state = list(range(1, 1 + half)), list(range(30, 30 + half))
    slots = list(range(2 * half))
    worker.submit_store(1, GPULoadStoreSpec(attn + state, [half, half], [0, 0]),
                        PoolSlotsSpec(slots, info))
    worker.wait({1})
    stored = worker.get_finished()
    expected = {s: _block(views, LAYERS, b) for s, b in zip(slots[:half], attn, strict=True)}
    expected.update({s: _block(views, STATES, b) for s, b in zip(slots[half:], state,
                                                                   strict=True)})
    barrier.wait(60)  # every rank's page of every slot is written
    # Scribble over the whole KV cache, then load every slot back into other blocks.
    buf.fill_(0)
    attn2, state2 = [b + 10 for b in attn], [b + 10 for b in state]
    worker.submit_load(2, PoolSlotsSpec(slots, info),
                       GPULoadStoreSpec(attn2 + state2, [half, half], [0, 0]))
    worker.wait({2})
    loaded = worker.get_finished()
    restored = all(_block(views, LAYERS, b2) == expected[s]
                   for s, b2 in zip(slots[:half], attn2, strict=True)) and all(
        _block(views, STATES, b2) == expected[s] for s, b2 in zip(slots[half:], state2,
                                                                  strict=True))
    worker.shutdown()
    return {"stored": [(r.job_id, r.success) for r in stored],
            "loaded": [(r.job_id, r.success) for r in loaded],
            "restored": restored,
            "pages": {s: (len(b), hashlib.sha256(b).hexdigest()) for s, b in expected.items()},
            "mapped_early": mapped_early}
