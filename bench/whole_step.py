"""The whole scheduler step, our plugin vs vLLM's own offloading, interleaved in one run.

What a user pays per step is not the lookup alone: vLLM 0.33's ``schedule()`` (lookups, the
store jobs of ``build_connector_meta``, our ``on_schedule_end`` with the step's one message)
plus ``update_from_output()`` (``complete_store`` / ``complete_load``). Two ``MiniEngine``s
(vLLM's real core Scheduler and connector, fake model, ``bench/vllm_engine.py``) serve the
same continuous-batching chat (``chat_driver.Inflight``: ``IN_FLIGHT`` requests, multi-turn
conversations over shared system prompts, chunked prefill of ``CHUNK`` tokens):

* ``ours``: ``KVOffloadConnector`` + ``KVOffloadSpec`` (defaults) and a ``kvoffload serve``
  process, its pool holding ``resident`` extra blocks, every load's bytes checked (untimed);
* ``vllm``: vLLM's ``CPUOffloadingSpec`` (its worker needs CUDA: transfers complete without
  copies; every scheduler-side decision is vLLM's own), the same number of host blocks.

The two step alternately (which one goes first alternates too), so both see the same machine
load; the first ``WARMUP`` steps fill the engines and are not counted. ``busy=N``: N other
pairs of engines (``bench/busy_engines.py``, one OS process each, ours on the same daemon and
namespace) serve their own chats meanwhile, waiting a simulated GPU step between steps.
``bursts=N``: N times, evenly spaced, another client of the daemon commits ``burst_keys`` READY
blocks in ours' namespace between two steps (untimed: another engine's stores landing); the
``AFTER_BURST`` steps that follow are each engine's ``after_burst`` (vLLM sees no burst: its
excess over its own p50 is the noise the same steps carry), issue 24's bound being "no step
after a burst more than 1 ms above the steady p50".
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from typing import Any

from kvoffload.bench.chat_driver import ChatMix, Inflight
from kvoffload.bench.proc import daemon_process
from kvoffload.bench.sim import percentile
from kvoffload.bench.step_engines import CHUNK, engines, geometry

__all__ = ["CHUNK", "IN_FLIGHT", "WARMUP", "engines", "geometry", "run_whole_step"]

IN_FLIGHT = 48
WARMUP = 50
AFTER_BURST = 40  # steps watched after each burst (a burst's additions may span ~20 steps)


def _fill(control: str, geometry: Any, count: int, seed: int) -> list[bytes]:
    """``count`` ready blocks nobody asks for, stored by another client (resident load, a
    burst); their keys."""
    from kvoffload.connector.client import DaemonClient
    from kvoffload.daemon.control import protocol as p

    writer = DaemonClient(control, timeout_ms=120_000, name="bench filler")
    writer.register(geometry)
    rng = random.Random(seed)
    groups = len(geometry.groups)
    stored: list[bytes] = []
    for start in range(0, count, 1 << 14):
        keys = [rng.randbytes(32) + (i % groups).to_bytes(4, "big")
                for i in range(start, min(count, start + (1 << 14)))]
        writer.prepare_store([p.StoreItem(key=k, end_token=0) for k in keys])
        writer.commit_store(keys)
        stored += keys
    writer.close()
    return stored


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50_us": round(percentile(s, 50) * 1e6, 1), "p99_us": round(percentile(s, 99) * 1e6, 1),
            "mean_us": round(sum(s) / max(1, len(s)) * 1e6, 1), "samples": len(s)}


def run_whole_step(kind: str, steps: int, *, seed: int = 0, resident: int = 0,
                   extra: dict[str, Any] | None = None, busy: int = 0,
                   busy_in_flight: int = IN_FLIGHT // 2, gpu_ms: float = 20.0,
                   bursts: int = 0, burst_keys: int = 10_000,
                   say: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Per-step scheduler times of ours and vLLM's over ``steps`` interleaved steps each;
    ``busy`` other engine pairs (``busy_in_flight`` requests each, a ``gpu_ms`` model step)
    stepping on the machine meanwhile, their ours on the same daemon."""
    from kvoffload.bench.busy_engines import busy_engines

    shape, gpu_blocks, host_blocks = geometry(kind)
    groups = 1 + shape.mamba_groups
    # Room for every ours engine's host blocks: the background ones do not shrink the pool.
    slots = host_blocks * groups * (1 + busy) + resident + bursts * burst_keys
    every = max(1, steps // (bursts + 1))
    burst_at = {WARMUP + every * (b + 1) for b in range(bursts)}
    watched: set[int] = {i for at in burst_at for i in range(at, at + AFTER_BURST)}
    burst: list[bytes] = []
    background: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        _proc, ready = stack.enter_context(daemon_process(
            "--lease-ms", "600000", pool_bytes=slots * shape.page, slot_bytes=shape.page))
        ours, theirs = engines(kind, ready["control"], extra)
        stack.callback(ours.shutdown)
        stack.callback(theirs.shutdown)
        if resident:
            say(f"{kind}: {resident:,} resident blocks")
            _fill(ready["control"], ours.connector.scheduler.manager.geometry, resident, seed)
        if busy:
            say(f"{kind}: starting {busy} busy engine pairs")
            others = stack.enter_context(busy_engines(
                busy, kind=kind, control=ready["control"], seed=seed, in_flight=busy_in_flight,
                gpu_ms=gpu_ms, extra=extra))
        drivers = {"ours": Inflight(ours, ChatMix(seed), IN_FLIGHT, verify=True),
                   "vllm": Inflight(theirs, ChatMix(seed), IN_FLIGHT, verify=False)}
        for i in range(WARMUP + steps):
            if i % 500 == 0:
                say(f"{kind}: step {i}/{WARMUP + steps}")
            if i in burst_at:
                burst += _fill(ready["control"], ours.connector.scheduler.manager.geometry,
                               burst_keys, seed + 1 + i)
            order = ("ours", "vllm") if i % 2 else ("vllm", "ours")
            for name in order:
                drivers[name].step()
        daemon = _daemon_stats(ready["control"])
        view = ours.connector.scheduler.manager.session.view
        # The bursts' keys ours' view answers READY by the run's end (its refresh caught up).
        in_view = sum(view.ready.find(k) >= 0 for k in burst) if view is not None else 0
        if busy:
            background = others.stop()  # each one's own count of what it did
    out: dict[str, Any] = {"kind": kind, "steps": steps, "in_flight": IN_FLIGHT,
                           "chunk_tokens": CHUNK, "resident_blocks": resident,
                           "gpu_blocks_per_group": gpu_blocks, "host_blocks": host_blocks,
                           "busy": busy, "daemon": daemon, "bursts": bursts,
                           "burst_keys": burst_keys if bursts else 0, "bursts_in_view": in_view}
    for name, d in drivers.items():
        out[name] = {**_stats(d.step_seconds[WARMUP:]), **d.result()}
        if bursts:
            after = [t for i, t in enumerate(d.step_seconds) if i in watched]
            out[name]["after_burst"] = {
                "max_us": round(max(after) * 1e6, 1),
                "excess_ms": round((max(after) * 1e6 - out[name]["p50_us"]) / 1000, 3)}
    out["ours"]["manager"] = dict(ours.connector.scheduler.manager.counters)
    out["ours"]["session"] = dict(ours.connector.scheduler.manager.session.counters)
    if busy:
        out["busy_in_flight"], out["gpu_ms"], out["background"] = (busy_in_flight, gpu_ms,
                                                                   background)
        out["background_steps"] = [b["steps"] for b in background]
        out["background_ours_stores"] = [b["ours"]["stores_offered"] for b in background]
    if bursts:
        out["burst_paired"] = _paired(drivers, burst_at)
    p50 = out["ours"]["p50_us"] / max(1e-9, out["vllm"]["p50_us"])
    p99 = out["ours"]["p99_us"] / max(1e-9, out["vllm"]["p99_us"])
    out["ratio"], out["p99_ratio"] = round(p50, 3), round(p99, 3)
    return out


def _paired(drivers: dict[str, Inflight], burst_at: set[int]) -> dict[str, float]:
    """The bursts' own cost, step for step: ours - vLLM on the same step of the same workload
    (a long prefill is long on both sides), its largest in the ``AFTER_BURST`` steps after a
    burst less its median over all counted steps; ``control_ms`` the same over the steps
    before each burst (no burst: the noise of a max over as many steps)."""
    diffs = [o - v for o, v in zip(drivers["ours"].step_seconds, drivers["vllm"].step_seconds,
                                   strict=True)]
    steady = percentile(sorted(diffs[WARMUP:]), 50)

    def excess(first: int) -> float:
        window = [diffs[i] for at in burst_at
                  for i in range(max(WARMUP, at + first),
                                 min(len(diffs), at + first + AFTER_BURST))]
        return round((max(window) - steady) * 1e3, 3)

    return {"paired_excess_ms": excess(0), "control_ms": excess(-AFTER_BURST)}


def _daemon_stats(control: str) -> dict[str, Any]:
    """What the daemon holds: namespaces (1 when every engine shares the geometry), clients,
    ready blocks."""
    from kvoffload.connector.client import DaemonClient

    client = DaemonClient(control, timeout_ms=30_000, name="bench stats")
    try:
        stats = client.stats()
    finally:
        client.close()
    return {k: stats.get(k) for k in ("namespaces", "clients", "ready", "pending", "num_slots")}
