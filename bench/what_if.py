"""hybrid_chat's what-if: the stand-alone simulator (bench/sim.py) on the same turns.

Not the headline. ``bench/sim.py`` is a model of an engine that talks to the daemon directly:
it stores what our plugin cannot under vLLM 0.33 (decode tokens, turn-end tails) and has no
GPU prefix cache. It answers "what if the engine could store that", and it is where the disk
and Mooncake tiers are exercised on this workload (``ours_small_pool``, ``ours_disk_tier``,
``shared_tier``) and the cost-aware tails at other copy rates. Pools are in slots of one group
block of one key at full scale (``POOL_BYTES``); bytes are not copied (64-byte slots).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from kvoffload.bench.mooncake_run import run_shared_tier
from kvoffload.bench.sim import (
    NVME_READ_BYTES_PER_S,
    EmbeddedDaemon,
    OursEngine,
    Totals,
    TurnRecord,
)
from kvoffload.bench.workload import PRESETS, Turn
from kvoffload.daemon.lookup.cost import TailCost, TimeModel

PRESET = "qwen3.6-27b-tp1"
# Host pool at full scale. The workload keeps 6 conversations active at once (workload.py), so
# its working set is small; 8 GiB (167 slots of 49 MiB) makes eviction matter the way "other
# traffic evicts in between" turns on a busy node. Bytes are not copied, so no RAM is needed.
POOL_BYTES = 8 << 30
TINY = 1e-9  # daemon-side geometry scale: 64-byte slots, nothing is copied
# The disk-tier runs: a quarter of POOL_BYTES (41 slots). Even 8 GiB loses hits to eviction on
# this workload (quick run: 548k tokens served vs 606k with an unbounded pool); at 2 GiB pool
# only loses about half, which is the case a disk tier is for.
SMALL_POOL_BYTES = 2 << 30
# Disk tier size in blocks (4 TiB of 49 MiB blocks at full scale): more than the working set
# of the full run, so the disk never evicts and the comparison is about the pool alone.
DISK_BLOCKS = 80_000
DISK_FILE_BYTES = 1024  # bound on one tiny block's file (header, key, meta, 64 data bytes)
# How long a lookup parks on its promotions; never reached here (reads are of 64-byte files),
# a lookup still pending at the deadline would count as a miss.
WAIT_MS = 10_000


def _ours(turns: list[Turn], slots: int, cost: TailCost, *, tails: bool,
          cost_aware: bool, disk_blocks: int = 0,
          disk_stats: dict[str, int] | None = None) -> Totals:
    """Our engine over an embedded daemon; ``disk_blocks`` > 0 adds a disk tier below the pool
    (its ``TierStats`` are copied into ``disk_stats`` at the end)."""
    geometry = PRESETS[PRESET].geometry(TINY)
    with EmbeddedDaemon(slots * geometry.slot_bytes(), slot_bytes=geometry.slot_bytes(),
                        disk_bytes=disk_blocks * DISK_FILE_BYTES) as d:
        client = d.client()
        try:
            client.register(geometry)
            engine = OursEngine(client, geometry, cost, tails=tails, cost_aware=cost_aware,
                                wait_ms=WAIT_MS if disk_blocks else 0,
                                promotions=d.disk_reads if disk_blocks else None)
            for turn in turns:
                engine.run_turn(turn)
            if disk_stats is not None:
                disk_stats.update(d.disk_stats())
            return engine.totals
        finally:
            client.close()


def run_disk_tier(turns: list[Turn], cost: TailCost, *, pool_bytes: int = SMALL_POOL_BYTES,
                  disk_blocks: int = DISK_BLOCKS) -> tuple[dict[str, Any], dict[str, Any],
                                                           dict[str, Any]]:
    """``ours`` on a small pool, without and with a disk tier below it: (pool only, with disk,
    the ``disk_tier`` summary)."""
    full = cost.geometry
    slots = pool_bytes // full.slot_bytes()
    pool_only = _ours(turns, slots, cost, tails=True, cost_aware=True).summary()
    stats: dict[str, int] = {}
    disk = _ours(turns, slots, cost, tails=True, cost_aware=True, disk_blocks=disk_blocks,
                 disk_stats=stats).summary()
    summary = {
        "pool_bytes_full_scale": slots * full.slot_bytes(), "pool_slots": slots,
        "disk_bytes_full_scale": disk_blocks * full.slot_bytes(), "disk_blocks": disk_blocks,
        "disk_read_bytes_per_s": NVME_READ_BYTES_PER_S,
        "served_pool_only": pool_only["served_tokens"], "served_disk": disk["served_tokens"],
        "served_gain": round(disk["served_tokens"] / max(1, pool_only["served_tokens"]) - 1, 4),
        "ttft_ms_mean_pool_only": pool_only["ttft_ms_mean"],
        "ttft_ms_mean_disk": disk["ttft_ms_mean"],
        "ttft_gain": round(1 - disk["ttft_ms_mean"] / max(1e-9, pool_only["ttft_ms_mean"]), 4),
        "promotions": disk["promotions"], "promotions_waited": disk["promotions_waited"],
        # Every promoted block is charged as a full-size NVMe read (a few were served from
        # the write still in flight: tier_ops read_memory), the waited ones also in TTFT.
        "disk_bytes_read": disk["promotions"] * full.slot_bytes(),
        "disk_bytes_waited": disk["disk_bytes_waited"],
        # The daemon's own disk-tier counters (writes are pool evictions kept on disk).
        "tier": {k: stats.get(k, 0) for k in ("writes", "writes_skipped", "reads",
                                              "read_errors", "corrupt", "evictions", "blocks")},
    }
    return pool_only, disk, summary


def _no_offload(turns: Iterable[Turn], model: TimeModel) -> Totals:
    totals = Totals(model)
    for turn in turns:
        totals.add(TurnRecord(len(turn.prompt), 0, 0, 0))
    return totals


def measure_copy_bytes_per_s(nbytes: int = 64 << 20, reps: int = 5) -> float:
    """Host memory copy rate here (median of ``reps``; buffers touched first): what a cost
    model measured at start would use on this machine instead of the GPU's 50 GB/s."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return nbytes / times[len(times) // 2]


def _cost_gain(turns: list[Turn], slots: int, full: Any, copy_rate: float) -> dict[str, Any]:
    """Ours with cost-aware tails on and off, same daemon, at one copy bandwidth."""
    cost = TailCost(full, TimeModel(copy_bytes_per_s=copy_rate))
    on = _ours(turns, slots, cost, tails=True, cost_aware=True).summary()
    off = _ours(turns, slots, cost, tails=True, cost_aware=False).summary()
    return {
        "copy_bytes_per_s": copy_rate,
        "tail_pays_from_tokens": {"above_a_chunk_hit": round(cost.threshold_tokens(True), 1),
                                  "without_chunk_hit": round(cost.threshold_tokens(False), 1)},
        "ttft_ms_mean_on": on["ttft_ms_mean"], "ttft_ms_mean_off": off["ttft_ms_mean"],
        "ttft_ms_p99_on": on["ttft_ms_p99"], "ttft_ms_p99_off": off["ttft_ms_p99"],
        "served_on": on["served_tokens"], "served_off": off["served_tokens"],
        "keys_stored_on": on["keys_stored"], "keys_stored_off": off["keys_stored"],
        "tails_declined_on_load": on["tails_declined"],
        "ttft_gain": round(1 - on["ttft_ms_mean"] / max(1e-9, off["ttft_ms_mean"]), 4),
    }


def sim_what_if(turns: list[Turn], seed: int, say: Callable[[str], None]) -> dict[str, Any]:
    """Every simulator variant on ``turns``: the ``sim_what_if`` field of hybrid_chat."""
    full = PRESETS[PRESET].geometry(1.0)
    slots = POOL_BYTES // full.slot_bytes()
    model = TimeModel()
    cost = TailCost(full, model)
    out: dict[str, Any] = {
        "what": "bench/sim.py, a stand-alone engine over the daemon (not our plugin in vLLM): "
                "stores decode tokens and turn-end tails, no GPU prefix cache, requests one at "
                "a time; a what-if, not the headline",
        "pool_slots": slots, "pool_bytes_full_scale": slots * full.slot_bytes()}
    variants: dict[str, dict[str, Any]] = {}
    variants["no_offload"] = _no_offload(turns, model).summary()
    say("what-if: simulator, ours")
    variants["ours"] = _ours(turns, slots, cost, tails=True, cost_aware=True).summary()
    variants["ours_cost_off"] = _ours(turns, slots, cost, tails=True, cost_aware=False).summary()
    variants["chunks_only"] = _ours(turns, slots, cost, tails=False, cost_aware=False).summary()
    say("what-if: small pool, without and with the disk tier")
    (variants["ours_small_pool"], variants["ours_disk_tier"],
     out["disk_tier"]) = run_disk_tier(turns, cost)
    say("what-if: two nodes, pool only, then sharing a Mooncake store")
    out["shared_tier"] = run_shared_tier(turns, cost, SMALL_POOL_BYTES, preset=PRESET,
                                         scale=TINY, seed=seed)
    out["variants"] = variants
    measured = measure_copy_bytes_per_s()
    out["cost_aware_tails"] = [_cost_gain(turns, slots, full, rate)
                               for rate in (model.copy_bytes_per_s, measured, 5e9)]
    out["cost_aware_tails_rates"] = ["time model (50 GB/s)", "host copy measured here",
                                     "5 GB/s (unpinned / shared link)"]
    return out
