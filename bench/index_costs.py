"""Micro-costs of the shared index's safety machinery, one process, 1M-slot index in /dev/shm:
the fence, an idle refresh, bursts of changes in the view's own and another namespace (the
longest refresh, all of them, and how many steps until caught up), a
worker's generation check of a 384-slot job, one daemon entry write, an attach's rescan.

``python -m kvoffload.bench.index_costs`` (numbers in BENCHMARKS.md, "Engine safety")."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
from kvoffload.connector.index_view import IndexView, SlotGenerations
from kvoffload.daemon.store import fence
from kvoffload.daemon.store import shared_index as si

SLOTS = 1 << 20


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


def _per_call_us(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return round((time.perf_counter() - start) / n * 1e6, 3)


def run() -> dict[str, float]:
    path = Path(f"/dev/shm/kvoffload-index-costs-{uuid.uuid4().hex[:8]}")
    writer = si.SharedIndexWriter(path, SLOTS, "costs")
    view = IndexView(path, 0, "costs")
    out: dict[str, float] = {"fence_full_us": _per_call_us(fence.full, 100_000),
                             "refresh_idle_us": _per_call_us(view.refresh, 20_000)}
    view.refresh()
    for ns, label in ((0, "own"), (1, "other")):
        base = 0 if ns == 0 else SLOTS // 2
        for burst in (100, 10_000):
            for i in range(burst):
                writer.write(base + i, 1, ns, si.READY, 0, _key(base + i))
            # Each refresh is one step's (its budget: index_view.REFRESH_BUDGET_S); the burst
            # is caught up with after ``steps`` of them.
            took: list[float] = []
            while not took or not view.caught_up or view.applied != writer.head:
                start = time.perf_counter()
                view.refresh()
                took.append(time.perf_counter() - start)
            out[f"refresh_{burst}_{label}_max_ms"] = round(max(took) * 1e3, 3)
            out[f"refresh_{burst}_{label}_total_ms"] = round(sum(took) * 1e3, 3)
            out[f"refresh_{burst}_{label}_steps"] = len(took)
    gens = SlotGenerations(path, "costs")
    slots = np.arange(384)
    idents = np.array([si.ident(1, _key(i)) for i in range(384)], dtype=np.uint64)
    out["intact_mask_384_us"] = _per_call_us(lambda: gens.intact_mask(slots, idents), 2_000)
    out["entry_write_us"] = _per_call_us(
        lambda: writer.write(7, 3, 0, si.READY, 0, _key(7)), 20_000)
    start = time.perf_counter()
    again = IndexView(path, 0, "costs")
    out["attach_rescan_s"] = round(time.perf_counter() - start, 3)
    for res in (view, again, gens):
        res.close()
    writer.close()
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
