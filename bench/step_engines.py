"""The two engines of the whole-step bench (``whole_step.py``) and of each busy pair
(``busy_engines.py``): one geometry, ours over a daemon and vLLM's ``CPUOffloadingSpec`` with
the same host blocks. A module of its own so that both import it and neither the other."""

from __future__ import annotations

from typing import Any

from kvoffload.bench.workload import PRESETS

CHUNK = 2048  # chunked prefill: tokens a step schedules at most
ROW = 8  # KV bytes per token: the fake model's bytes stay small, every one still checked


def geometry(kind: str) -> tuple[Any, int, int]:
    """(Shape, GPU blocks per group, host blocks) of ``hybrid`` (qwen3.6-27b-tp1: 784-token
    blocks, 16-token hashes, 1 attention + 3 Mamba align groups) or ``attention`` (16-token
    blocks). The GPU holds little more than the requests in flight, so other traffic evicts
    between a conversation's turns and some prefixes come back from the offload; the host
    memory is four times the GPU's."""
    from kvoffload.bench.vllm_engine import Shape

    if kind == "hybrid":
        p = PRESETS["qwen3.6-27b-tp1"]
        shape = Shape(block=p.block_tokens, unit=p.tokens_per_hash, mamba_groups=p.mamba_groups,
                      row=ROW, max_model_len=16_384)
        return shape, 200, 800
    if kind == "attention":
        return Shape(block=16, unit=16, mamba_groups=0, row=ROW, max_model_len=16_384), 2500, 10000
    raise ValueError(f"geometry is 'hybrid' or 'attention', not {kind!r}")


def engines(kind: str, control: str, extra: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """(ours, vLLM's) ``MiniEngine`` of geometry ``kind``: ours on the daemon at ``control``,
    vLLM's ``CPUOffloadingSpec`` with the same number of host blocks. The caller shuts both."""
    from kvoffload.bench.vllm_engine import MiniEngine

    shape, gpu_blocks, host_blocks = geometry(kind)
    ours = MiniEngine({"spec_name": "KVOffloadSpec",
                       "spec_module_path": "kvoffload.connector.vllm",
                       "kvoffload_control": control, "kvoffload_copy_async": False,
                       **(extra or {})},
                      connector="KVOffloadConnector",
                      connector_module="kvoffload.connector.vllm", num_blocks=gpu_blocks,
                      shape=shape, max_batched_tokens=CHUNK)
    # vLLM's CPU spec holds one group block per chunk, padded to 4 KiB: the same count.
    chunk = -(-shape.page // 4096) * 4096
    try:
        theirs = MiniEngine({"spec_name": "CPUOffloadingSpec",
                             "cpu_bytes_to_use": host_blocks * (1 + shape.mamba_groups) * chunk},
                            real_worker=False, num_blocks=gpu_blocks, shape=shape,
                            max_batched_tokens=CHUNK)
    except BaseException:
        ours.shutdown()
        raise
    return ours, theirs
