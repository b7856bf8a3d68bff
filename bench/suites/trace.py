"""trace suite: a production trace through N vLLM engines, one daemon vs per-engine offload.

``kvoffload bench --suite trace --trace FILE [--trace-scale T]`` replays a Mooncake FAST'25
trace (bench/trace_replay.py; without ``--trace``, the seeded Mooncake-like trace of
bench/trace_gen.py). Each of 3 windows of consecutive requests, in timestamp order, through
N engines (vLLM 0.33's core ``Scheduler`` + WORKER connector each, attention-only, 16-token
blocks, one hash id = ``T`` tokens), once per routing (bench/routing.py: round-robin, random,
KV-aware on GPU prefixes, and KV-aware that also sees each engine's own CPU cache; the trace
has no conversation ids, so no sticky routing), at equal total host memory counted in blocks
(bench/vllm_peers.py says why blocks):

* ``ours``: every engine with our plugin on ONE ``kvoffload serve`` process of ``host`` slots;
  every load's bytes checked; the daemon's RssAnon sampled over the run;
* ``vllm``: each engine its own ``CPUOffloadingSpec`` with ``host / N`` chunks, in each of
  vLLM's configurations (store policy chunk / request x eviction LRU / ARC); the best of them
  in each window and routing is the baseline (chosen after the fact: the peer's best case);
* ``ceiling``: the trace's unbounded prefix hits (an infinite cache shared by every engine).

Sizes (state them with any number): GPU ``gpu_blocks`` per engine, host memory 4x that per
engine (a 2 TB node of 8 GPUs has ~3-6x its GPU KV memory in DRAM), all of it in one pool for
ours. ``ratio`` = median over windows of ours / best vLLM offload-hit tokens at 4 engines
with ``kv_aware_cpu`` routing, the router per-engine caches do best under (target >= 1.2;
``kv_aware`` when that one is not run); ``ratio_<routing>`` the same per routing. Verify
failures must be 0. ``run_rss`` (``--rss``): the whole trace through one daemon, its RssAnon. Run alone: ``python -m kvoffload.bench.suites.trace [--full] [--trace F]``.

Effective capacity (issue 25, "duplicates across engines"): every replay also samples, every
``residency_every`` requests and at its end, the distinct blocks held in host memory
(bench/residency.py: the daemon's shared index, checked against its Stats; each vLLM engine's
cache policy): ``cell["capacity"]`` is ours / vLLM's union (mean over samples, final), with
vLLM's duplication factor (sum / union); ``capacity_<routing>`` spreads it over windows. The
below-memory variant (a pool far below the working set, disk and Mooncake tiers under it, vs
vLLM's tiering spec) is bench/suites/below_memory.py.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.bench.proc import daemon_process
from kvoffload.bench.residency import (
    ResidencySampler,
    capacity,
    check_against_stats,
    ours_summary,
    vllm_resident,
    vllm_summary,
)
from kvoffload.bench.routing import Router
from kvoffload.bench.seeds import reason_of
from kvoffload.bench.suites.load import rss_anon
from kvoffload.bench.trace_replay import (
    Replay,
    Scale,
    TraceRequest,
    ceiling_tokens,
    load_trace,
    parse_trace,
    window_starts,
)
from kvoffload.bench.vllm_baseline import mark_not_run
from kvoffload.bench.vllm_peers import CONFIGS, offload_engine, pool_slots

TARGET = 1.2
ROUTINGS = ("round_robin", "random", "kv_aware", "kv_aware_cpu")
HEADLINE = ("kv_aware_cpu", "kv_aware")  # the first one run: the peer's best router
HOST_PER_GPU = 4  # host blocks per GPU block and engine


@dataclass(frozen=True)
class Sizes:
    windows: int
    window: int  # requests
    gpu_blocks: int  # per engine: the trace's longest prompt (247 ids) must fit
    configs: tuple[str, ...]  # vLLM configurations run
    residency_every: int  # requests between samples of the blocks resident


SIZES = {True: Sizes(3, 60, 192, ("chunk-lru", "request-lru"), 20),  # quick
         False: Sizes(3, 1000, 512, CONFIGS, 100)}


def _shape() -> Any:
    from kvoffload.bench.vllm_engine import Shape

    # Attention only (the trace's model is): prefixes are block-aligned, no partial tails.
    return Shape(mamba_groups=0, unit=16)


def generated_trace(requests: int | None = None) -> list[TraceRequest]:
    """bench/trace_gen.py's trace, seed 0: the shipped test trace's 400 requests by default
    (full runs without ``--trace`` ask for more, so that their windows do not overlap)."""
    from kvoffload.bench.trace_gen import SHIPPED, dumps, generate

    records = generate(requests or SHIPPED["requests"], seed=SHIPPED["seed"])
    return parse_trace(dumps(records).splitlines(), "generated")


def _rss_stats(samples: list[int]) -> dict[str, Any]:
    """RssAnon over the run; ``growth_after_fill``: end minus the sample at a quarter of the
    run (by then the pool is full and evicting: what grows after is per-request state)."""
    if not samples:
        return {}
    q = samples[len(samples) // 4]
    return {"start": samples[0], "end": samples[-1], "max": max(samples), "samples": len(samples),
            "growth_after_fill": samples[-1] - q, "every": samples}


def run_ours(window: Sequence[TraceRequest], routing: str, engines: int, gpu: int, host: int,
             scale: Scale, *, seed: int = 0, rss_every: int = 50,
             before: Callable[[Replay, int, str], None] | None = None,
             residency_every: int | None = None, daemon_args: Sequence[str] = (),
             pause_s: float = 0.0,
             after: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """One daemon of ``host`` slots for every engine; ``before(replay, i, control)`` runs
    ahead of request ``i`` (the restart suite replaces an engine there). ``residency_every``:
    sample the distinct blocks the daemon holds (bench/residency.py); ``daemon_args``: more
    ``kvoffload serve`` flags (a disk or Mooncake tier); ``after(ready)``: read the live
    daemon once the replay is done (its dict is ``out["after"]``)."""
    from kvoffload.bench.vllm_engine import plugin_engine

    shape = _shape()
    with daemon_process("--lease-ms", "600000", *daemon_args, pool_bytes=host * shape.page,
                        slot_bytes=0) as (proc, ready):
        started = [plugin_engine(ready["control"], gpu_blocks=gpu, shape=shape)
                   for _ in range(engines)]
        replay = Replay(started, Router(routing, engines, seed=seed), scale, pause_s=pause_s)
        rss: list[int] = []
        sampler = ResidencySampler(lambda: check_against_stats(
            ready["pool_path"], ready["control"]), residency_every or 0)
        try:
            if pool_slots(started[0]) != host:
                raise AssertionError(f"pool has {pool_slots(started[0])} slots, {host} asked")

            def hook(i: int) -> None:
                if i % rss_every == 0:
                    rss.append(rss_anon(proc.pid))
                if residency_every:
                    sampler.before(i)
                if before is not None:
                    before(replay, i, ready["control"])

            replay.run(window, before=hook)
            rss.append(rss_anon(proc.pid))
            if residency_every:
                sampler.final(len(window))
            out = replay.result()
            if after is not None:
                out["after"] = after(ready)
        finally:
            for e in replay.engines:
                e.shutdown()
    out["daemon_rss_anon"] = _rss_stats(rss)
    if residency_every:
        out["residency"] = ours_summary(sampler)
    out["served"] = replay.served
    return out


def run_vllm(window: Sequence[TraceRequest], routing: str, engines: int, gpu: int, host: int,
             scale: Scale, config: str, *, seed: int = 0,
             before: Callable[[Replay, int, str], None] | None = None,
             residency_every: int | None = None, pause_s: float = 0.0,
             make: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Each engine its own vLLM CPU offload of ``host // engines`` chunks (``make``: another
    engine of the same memory, e.g. with a tier below it); ``residency_every``: sample the
    keys their CPU caches hold (bench/residency.py)."""
    started = [make() if make is not None else
               offload_engine(host // engines, config, gpu_blocks=gpu, shape=_shape())
               for _ in range(engines)]
    replay = Replay(started, Router(routing, engines, seed=seed), scale, verify=False,
                    pause_s=pause_s)
    sampler = ResidencySampler(lambda: vllm_resident(replay.engines), residency_every or 0)

    def hook(i: int) -> None:
        if residency_every:
            sampler.before(i)
        if before is not None:
            before(replay, i, config)

    try:
        replay.run(window, before=hook)
        if residency_every:
            sampler.final(len(window))
        out = replay.result()
    finally:
        for e in replay.engines:
            e.shutdown()
    if residency_every:
        out["residency"] = vllm_summary(sampler)
    out["served"] = replay.served
    return out


def _cell(window: Sequence[TraceRequest], routing: str, n: int, gpu: int, host: int,
          scale: Scale, configs: Sequence[str], ceiling: int, seed: int,
          every: int) -> dict[str, Any]:
    theirs = {c: run_vllm(window, routing, n, gpu, host, scale, c, seed=seed,
                          residency_every=every) for c in configs}
    mine = run_ours(window, routing, n, gpu, host, scale, seed=seed, residency_every=every)
    best = max(configs, key=lambda c: theirs[c]["offload_hit_tokens"])
    cell: dict[str, Any] = {"ours": mine, "vllm": theirs, "vllm_best": best}
    # Effective capacity against the configuration holding the most distinct blocks (the
    # peer's best case for this measure; not always the one with the most hits).
    roomiest = max(configs, key=lambda c: theirs[c]["residency"]["union"]["mean"] or 0)
    cell["capacity"] = {"vs": roomiest, **capacity(mine["residency"],
                                                   theirs[roomiest]["residency"]),
                        "vllm_duplication": theirs[roomiest]["residency"]["duplication"]}
    b = theirs[best]["offload_hit_tokens"]
    # Per-engine offload that serves nothing at all: ours is infinitely better, or both are 0.
    cell["ratio"] = (round(mine["offload_hit_tokens"] / b, 3) if b else
                     float("inf") if mine["offload_hit_tokens"] else None)
    for r in (mine, *theirs.values()):
        r.pop("served", None)
        r["hit_ratio_vs_ceiling"] = round((r["gpu_tokens"] + r["offload_hit_tokens"])
                                          / ceiling, 3) if ceiling else None
    return cell


def _spread(values: list[float]) -> dict[str, Any]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "n": len(values)} if values else {"min": None, "median": None, "max": None, "n": 0}


def run_trace_bench(quick: bool = True, *, trace: str | None = None, trace_scale: int = 16,
                    engines: int = 4, routings: Sequence[str] = ROUTINGS,
                    n_windows: int | None = None, window: int | None = None,
                    gpu_blocks: int | None = None, configs: Sequence[str] | None = None,
                    progress: Any = None) -> dict[str, Any]:
    say = progress or (lambda _msg: None)
    size = SIZES[quick]
    n_windows, window = n_windows or size.windows, window or size.window
    gpu = gpu_blocks or size.gpu_blocks
    configs = tuple(configs or size.configs)
    host = engines * HOST_PER_GPU * gpu
    scale = Scale(trace_scale, 16)
    out: dict[str, Any] = {
        "ratio": None, "target": TARGET, "meets": False, "direction": ">=",
        "trace": trace or "generated (bench/trace_gen.py, seed 0, 400 requests)",
        "tokens_per_id": trace_scale, "engines": engines, "gpu_blocks_per_engine": gpu,
        "host_blocks_total": host, "host_blocks_per_engine_vllm": host // engines,
        "vllm_configs": list(configs), "routings": list(routings),
        "ratio_means": "offload-hit tokens, one shared daemon / the best per-engine vLLM CPU "
                       "offload configuration at equal host blocks, KV-aware routing that also "
                       "sees each engine's CPU cache (the peer's best router), median over "
                       "windows",
    }
    if mark_not_run(out):
        return out
    if scale.tokens_per_id % scale.block:
        raise ValueError(f"--trace-scale {trace_scale}: must be a multiple of {scale.block}")
    requests = load_trace(trace) if trace else generated_trace(
        None if quick else n_windows * window)
    if not trace:
        out["trace"] = f"generated (bench/trace_gen.py, seed 0, {len(requests)} requests)"
    starts = window_starts(len(requests), n_windows, window)
    out["windows"] = []
    missed = []
    for w, first in enumerate(starts):
        win = requests[first:first + window]
        ceiling = sum(ceiling_tokens(win, scale))
        row: dict[str, Any] = {"first_request": first, "requests": len(win),
                               "minutes": round((win[-1].timestamp_ms - win[0].timestamp_ms)
                                                / 60000, 2), "ceiling_tokens": ceiling}
        for routing in routings:
            say(f"window {w + 1}/{len(starts)}, {routing}: vLLM {len(configs)} configs, ours")
            cell = _cell(win, routing, engines, gpu, host, scale, configs, ceiling, seed=w,
                         every=size.residency_every)
            row[routing] = cell
            ours = cell["ours"]
            if ours["verify_failures"] or ours["failed_loads"] or ours["unaccounted_tokens"]:
                missed.append(f"window {w + 1} {routing}: {ours['verify_failures']} wrong "
                              f"loads, {ours['failed_loads']} failed, "
                              f"{ours['unaccounted_tokens']} tokens unaccounted")
            res = ours["residency"]
            if res["stats_ready_final"] != res["resident"]["final"]:
                missed.append(f"window {w + 1} {routing}: the index shows "
                              f"{res['resident']['final']} blocks READY, the daemon's Stats "
                              f"{res['stats_ready_final']}")
        row["prompt_tokens"] = row[routings[0]]["ours"]["prompt_tokens"]
        out["windows"].append(row)
    for routing in routings:
        ratios = [r[routing]["ratio"] for r in out["windows"] if r[routing]["ratio"] is not None]
        out[f"ratio_{routing}"] = statistics.median(ratios) if ratios else None
        out[f"windows_{routing}"] = _spread(ratios)
        caps = [r[routing]["capacity"] for r in out["windows"]]
        out[f"capacity_{routing}"] = {
            "final": _spread([c["final"] for c in caps if c["final"] is not None]),
            "mean": _spread([c["mean"] for c in caps if c["mean"] is not None]),
            "vllm_duplication_mean": _spread([c["vllm_duplication"]["mean"] for c in caps
                                              if c["vllm_duplication"]["mean"] is not None])}
    head = next((r for r in HEADLINE if r in routings), routings[0])
    out["headline_routing"] = head
    out["ratio"] = out[f"ratio_{head}"]
    out["seeds"] = out[f"windows_{head}"]  # the runner's spread column: windows here
    if out["ratio"] is None:
        missed.append("no vLLM offload hit in any window: ratio undefined")
    elif engines == 4 and out["ratio"] < TARGET:
        missed.append(f"{head}: ratio {out['ratio']} < {TARGET} (median of "
                      f"{out['seeds']['n']} windows)")
    out["meets"] = not missed
    out["reason"] = reason_of(missed)
    return out


def run_rss(requests: Sequence[TraceRequest], *, engines: int = 4, gpu: int = 512,
            host: int = 8192, every: int = 250, scale: Scale | None = None) -> dict[str, Any]:
    """The whole trace through one daemon (round-robin): its RssAnon every ``every`` requests.
    The public trace's 12,031 requests on 8,192 slots is where the daemon's heap used to grow
    ~19 MB (the recently-evicted key set: daemon/streams/publish.py ``RecentKeys`` now)."""
    out = run_ours(requests, "round_robin", engines, gpu, host, scale or Scale(),
                   rss_every=every)
    out.pop("served")
    return out


def main(argv: list[str]) -> None:
    from kvoffload.bench.suite_args import run_alone, trace_suite_parser

    ap = trace_suite_parser("trace", ROUTINGS)
    ap.add_argument("--rss", action="store_true",
                    help="the whole trace through one daemon, its RssAnon over the run")
    args = ap.parse_args(argv)
    if args.rss:
        import json

        requests = load_trace(args.trace) if args.trace else generated_trace()
        print(json.dumps(run_rss(requests, scale=Scale(args.trace_scale, 16)), indent=2))
        return
    run_alone(run_trace_bench, args, routings=tuple(args.routing or ROUTINGS))


if __name__ == "__main__":
    main(sys.argv[1:])
