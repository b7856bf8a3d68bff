"""restart suite: one engine restarts mid-run; the shared pool outlives it, vLLM's own does not.

A rolling restart or an upgrade replaces one engine (a new vLLM scheduler and worker). With
vLLM's per-engine CPU offloading its host cache dies with it; with our daemon the new engine
registers on the same pool and finds every block the node stored, its own earlier ones too.

N engines (4) replay a trace (bench/trace_replay.py; the suite's trace options as the trace
suite's) with KV-aware routing; ahead of request ``restart_at`` engine 0 is shut down and a
fresh one (empty GPU cache; for vLLM an empty CPU cache too) takes its place. Counted on the
restarted engine over the requests that follow, up to ``after_s`` seconds of trace time (5
minutes on the public trace): offload-hit tokens, GPU hits, recomputed tokens; the same over
every engine. Same sizes and memory rule as the trace suite (equal host blocks; vLLM in each
of its configurations, the best after the fact is the baseline). ``ratio`` = median over 3
windows of ours / best vLLM offload-hit tokens on the restarted engine after the restart
(target >= 2); ``ratio_all_engines`` the same over every engine. Both also hold the shared
pool's advantage without any restart (the trace suite's ratio): ``lost_to_restart`` (full
runs) is what the restart itself cost each side. Run alone: ``python -m
kvoffload.bench.suites.restart [--full] [--trace F] [--routing round_robin]``.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from typing import Any

from kvoffload.bench.seeds import reason_of
from kvoffload.bench.suites.trace import (
    HOST_PER_GPU,
    ROUTINGS,
    SIZES,
    _shape,
    _spread,
    generated_trace,
    run_ours,
    run_vllm,
)
from kvoffload.bench.trace_replay import Replay, Scale, Served, load_trace, window_starts
from kvoffload.bench.vllm_baseline import mark_not_run
from kvoffload.bench.vllm_peers import offload_engine

TARGET = 2.0
RESTARTED = 0
ROUTING = "kv_aware"
# (requests before the restart, trace seconds counted after it, windows): quick / full
PLAN = {True: (40, 20.0, 3), False: (1000, 300.0, 3)}


def _after(served: Sequence[Served], first: int, last: int) -> dict[str, Any]:
    """Tallies of requests ``first <= index < last``: on the restarted engine and in all."""
    def tally(rows: list[Served]) -> dict[str, int]:
        return {"requests": len(rows), "prompt_tokens": sum(s.prompt for s in rows),
                "offload_hit_tokens": sum(s.offload for s in rows),
                "gpu_tokens": sum(s.gpu for s in rows),
                "recomputed_tokens": sum(s.recomputed for s in rows)}

    rows = [s for s in served if first <= s.index < last]
    return {"restarted_engine": tally([s for s in rows if s.engine == RESTARTED]),
            "all_engines": tally(rows)}


def _run(kind: str, window: list[Any], at: int | None, gpu: int, host: int, scale: Scale,
         engines: int, seed: int, routing: str = ROUTING) -> dict[str, Any]:
    """One replay of ``kind`` (ours, or a vLLM configuration); ``at`` None: no restart."""
    from kvoffload.bench.vllm_engine import plugin_engine

    def restart(replay: Replay, i: int, where: str) -> None:
        if at is None or i != at:
            return
        replay.engines[RESTARTED].shutdown()
        fresh = (plugin_engine(where, gpu_blocks=gpu, shape=_shape()) if kind == "ours" else
                 offload_engine(host // engines, where, gpu_blocks=gpu, shape=_shape()))
        replay.replace(RESTARTED, fresh)

    if kind == "ours":
        return run_ours(window, routing, engines, gpu, host, scale, seed=seed, before=restart)
    return run_vllm(window, routing, engines, gpu, host, scale, kind, seed=seed,
                    before=restart)


def _ratio(ours: int, theirs: int) -> float | None:
    return round(ours / theirs, 3) if theirs else (float("inf") if ours else None)


def run_restart_bench(quick: bool = True, *, trace: str | None = None, trace_scale: int = 16,
                      engines: int = 4, before: int | None = None, after_s: float | None = None,
                      n_windows: int | None = None, gpu_blocks: int | None = None,
                      configs: Sequence[str] | None = None, controls: bool | None = None,
                      routing: str = ROUTING, progress: Any = None) -> dict[str, Any]:
    """``controls`` (default: full runs): the same windows without a restart too, so that
    what the restart cost each side shows (``lost_to_restart``: on the restarted engine and
    over all engines; with a closed-loop routing the requests the restarted engine gets differ
    between the two runs, with ``round_robin`` they are the same)."""
    say = progress or (lambda _msg: None)
    sizes, (plan_before, plan_after, plan_windows) = SIZES[quick], PLAN[quick]
    before = before or plan_before
    after_s = after_s or plan_after
    n_windows = n_windows or plan_windows
    gpu = gpu_blocks or sizes.gpu_blocks
    # --quick: vLLM's default configuration alone (on this block-aligned, attention-only
    # replay the four gave equal restarted-engine hits in every full run).
    configs = tuple(configs or (("chunk-lru",) if quick else sizes.configs))
    controls = not quick if controls is None else controls
    host = engines * HOST_PER_GPU * gpu
    scale = Scale(trace_scale, 16)
    out: dict[str, Any] = {
        "ratio": None, "target": TARGET, "meets": False, "direction": ">=",
        "trace": trace or "generated (bench/trace_gen.py, seed 0, 400 requests)",
        "engines": engines, "routing": routing, "restarted_engine": RESTARTED,
        "requests_before_restart": before, "after_s": after_s, "gpu_blocks_per_engine": gpu,
        "host_blocks_total": host, "vllm_configs": list(configs),
        "ratio_means": "offload-hit tokens on the restarted engine in the trace time after its "
                       "restart, one shared daemon / the best per-engine vLLM CPU offload "
                       "configuration (restarted the same way), median over windows",
    }
    if mark_not_run(out):
        return out
    requests = load_trace(trace) if trace else generated_trace(
        None if quick else n_windows * before * 2)
    if not trace:
        out["trace"] = f"generated (bench/trace_gen.py, seed 0, {len(requests)} requests)"
    out["windows"] = []
    missed: list[str] = []
    # Each window: ``before`` requests, then those within ``after_s`` of the restart.
    for w, first in enumerate(window_starts(len(requests), n_windows, before * 2)):
        t0 = requests[min(first + before, len(requests) - 1)].timestamp_ms
        end = first + before
        while end < len(requests) and requests[end].timestamp_ms < t0 + after_s * 1000:
            end += 1
        window = requests[first:end]
        say(f"window {w + 1}: {len(window)} requests, restart at {before}; "
            f"vLLM {len(configs)} configs, ours")
        row: dict[str, Any] = {"first_request": first, "requests": len(window),
                               "requests_after": len(window) - before}
        for kind in (*configs, "ours"):
            got = _run(kind, window, before, gpu, host, scale, engines, w, routing)
            row[kind] = {**_after(got.pop("served"), before, len(window)), "run": got}
        hits = {k: {part: row[k][part]["offload_hit_tokens"]
                    for part in ("restarted_engine", "all_engines")} for k in (*configs, "ours")}
        best = max(configs, key=lambda c: hits[c]["restarted_engine"])
        row["vllm_best"] = best
        row["ratio"], row["ratio_all_engines"] = (
            _ratio(hits["ours"][part], max(hits[c][part] for c in configs))
            for part in ("restarted_engine", "all_engines"))
        if controls:  # the best vLLM configuration and ours, never restarted
            for kind in (best, "ours"):
                got = _run(kind, window, None, gpu, host, scale, engines, w, routing)
                kept = _after(got.pop("served"), before, len(window))
                row[kind]["no_restart"] = kept
                row[kind]["lost_to_restart"] = {
                    part: (round(1 - hits[kind][part] / kept[part]["offload_hit_tokens"], 3)
                           if kept[part]["offload_hit_tokens"] else None)
                    for part in ("restarted_engine", "all_engines")}
        run = row["ours"]["run"]
        if run["verify_failures"] or run["failed_loads"] or run["unaccounted_tokens"]:
            missed.append(f"window {w + 1}: {run['verify_failures']} wrong loads, "
                          f"{run['failed_loads']} failed, {run['unaccounted_tokens']} "
                          "tokens unaccounted")
        out["windows"].append(row)
    ratios = [r["ratio"] for r in out["windows"] if r["ratio"] is not None]
    out["seeds"] = _spread(ratios)  # the runner's spread column: windows here
    out["ratio"] = statistics.median(ratios) if ratios else None
    every = [r["ratio_all_engines"] for r in out["windows"] if r["ratio_all_engines"]]
    out["ratio_all_engines"] = statistics.median(every) if every else None
    out["windows_all_engines"] = _spread(every)
    if out["ratio"] is None:
        missed.append("no offload hit on the restarted engine in any window")
    elif out["ratio"] < TARGET:
        missed.append(f"ratio {out['ratio']} < {TARGET} (median of {len(ratios)} windows)")
    out["meets"] = not missed
    out["reason"] = reason_of(missed)
    return out


def main(argv: list[str]) -> None:
    from kvoffload.bench.suite_args import run_alone, trace_suite_parser

    args = trace_suite_parser("restart", ROUTINGS, routing=ROUTING,
                              window=False).parse_args(argv)
    run_alone(run_restart_bench, args, routing=args.routing)


if __name__ == "__main__":
    main(sys.argv[1:])
