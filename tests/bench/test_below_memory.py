"""The trace suite's below-memory variant (bench/suites/below_memory.py) at a tiny size: every
variant's accounting, real tiers written on both sides, the baseline the best vLLM variant.
No timing."""

from __future__ import annotations

import os

import pytest
from kvoffload.bench.vllm_baseline import vllm_import_error

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(vllm_import_error() is not None,
                                 reason=str(vllm_import_error()))]
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def test_below_memory_tiers_on_both_sides() -> None:
    from kvoffload.bench.suites.below_memory import run_below_memory

    r = run_below_memory(True, n_windows=1, window=20, gpu_blocks=176, routing="round_robin",
                         configs=("chunk-lru",), tiers=("pool", "disk"))
    assert r["host_blocks_total"] == 4 * 44 and r["host_blocks_per_engine_vllm"] == 44
    row = r["windows"][0]
    variants = {k: v for k, v in row.items() if k.startswith(("ours_", "vllm_"))
                and isinstance(v, dict)}
    assert set(variants) == {"ours_pool", "ours_disk", "vllm_cpu-chunk-lru",
                             "vllm_fs-shared-lru", "vllm_fs-own-lru"}
    prompts = {v["prompt_tokens"] for v in variants.values()}
    assert len(prompts) == 1
    for name, v in variants.items():
        assert v["gpu_tokens"] + v["offload_hit_tokens"] + v["recomputed_tokens"] == v[
            "prompt_tokens"], name
        assert v["unaccounted_tokens"] == 0 and v["failed_loads"] == 0, name
        assert row["hits"][name] == round(v["offload_hit_tokens"] / v["prompt_tokens"], 4)
    for t in ("pool", "disk"):
        assert variants[f"ours_{t}"]["verify_failures"] == 0
    # The window's blocks overflow the pool: evicted blocks went to our disk tier, and every
    # chunk vLLM stored was cascaded to its fs tier (write-through), in both layouts.
    assert row["working_set_blocks"] > r["host_blocks_total"]
    assert variants["ours_disk"]["tiers"].get("disk_write", 0) > 0
    assert not variants["ours_pool"]["tiers"]  # no tier, no tier counters
    for layout in ("shared", "own"):
        assert variants[f"vllm_fs-{layout}-lru"]["tiers"]["fs_files"] > 0
    best = row["vllm_best"]
    assert variants[f"vllm_{best}"]["offload_hit_tokens"] == max(
        v["offload_hit_tokens"] for k, v in variants.items() if k.startswith("vllm_"))
    b = variants[f"vllm_{best}"]["offload_hit_tokens"]
    if b:
        assert row["ratio_disk"] == round(variants["ours_disk"]["offload_hit_tokens"] / b, 3)
    cap = row["capacity"]["pool_vs_cpu"]
    res = variants["vllm_cpu-chunk-lru"]["residency"]
    assert cap["vs"] == "cpu-chunk-lru" and res["union"]["final"] <= res["sum"]["final"] <= 176
    mine = variants["ours_pool"]["residency"]
    assert mine["stats_ready_final"] == mine["distinct"]["final"] <= 176
