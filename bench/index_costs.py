"""Micro-costs of the shared index's safety machinery, one process, 1M-slot index in /dev/shm:
the fence, an idle refresh, bursts of changes in the view's own and another namespace --
additions, removals, claims and their commits -- (the longest refresh, all of them, and how
many steps until caught up and the tombstones of removals purged), a
worker's generation check of a 384-slot job, one daemon entry write, an attach's rescan.

``python -m kvoffload.bench.index_costs [--budget-ms X]`` (numbers in BENCHMARKS.md, "Engine
safety")."""

from __future__ import annotations

import json
import sys
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


def _burst(out: dict[str, float], label: str, view: IndexView, writer: si.SharedIndexWriter,
           writes: Callable[[], None]) -> None:
    """Each refresh is one step's (its budget: index_view.REFRESH_BUDGET_S); the burst is
    caught up with after ``steps`` of them."""
    writes()
    took: list[float] = []
    while not took or not view.caught_up or view.applied != writer.head or view.ready.tombs:
        start = time.perf_counter()
        view.refresh()
        took.append(time.perf_counter() - start)
    out[f"refresh_{label}_max_ms"] = round(max(took) * 1e3, 3)
    out[f"refresh_{label}_total_ms"] = round(sum(took) * 1e3, 3)
    out[f"refresh_{label}_steps"] = len(took)


def run(budget_s: float | None = None) -> dict[str, float]:
    path = Path(f"/dev/shm/kvoffload-index-costs-{uuid.uuid4().hex[:8]}")
    writer = si.SharedIndexWriter(path, SLOTS, "costs")
    view = IndexView(path, 0, "costs")
    if budget_s is not None:
        view.budget_s = budget_s
    out: dict[str, float] = {"budget_ms": view.budget_s * 1e3,
                             "fence_full_us": _per_call_us(fence.full, 100_000),
                             "refresh_idle_us": _per_call_us(view.refresh, 20_000)}
    view.refresh()

    def put(ns: int, base: int, n: int, state: int, gen: int = 1) -> Callable[[], None]:
        def writes() -> None:
            for i in range(base, base + n):
                writer.write(i, gen, ns, state, 0, _key(i) if state != si.FREE else None)
        return writes

    for ns, label in ((0, "own"), (1, "other")):
        base = 0 if ns == 0 else SLOTS // 2
        for burst in (100, 10_000):
            _burst(out, f"{burst}_{label}", view, writer, put(ns, base, burst, si.READY))
        # The same 10,000 slots emptied (evictions): never deferred, applied vectorized.
        _burst(out, f"10000_{label}_removed", view, writer, put(ns, base, 10_000, si.FREE, 2))
    # Another engine's 10,000 claims, then their commits: READY over PENDING keys.
    _burst(out, "10000_own_claimed", view, writer, put(0, 0, 10_000, si.PENDING, 3))
    _burst(out, "10000_own_committed", view, writer, put(0, 0, 10_000, si.READY, 3))
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
    # ``--budget-ms X``: another budget than the default (``inf``: all in one step).
    args = sys.argv[1:]
    print(json.dumps(run(float(args[1]) / 1e3 if args[:1] == ["--budget-ms"] else None),
                     indent=1))
