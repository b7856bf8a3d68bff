"""lookup suite: what the plugin costs vLLM's scheduler, ours against vLLM's own offloading.

Headline, the whole step (``bench/whole_step.py``): vLLM 0.33's core Scheduler, ``schedule()``
+ ``update_from_output()`` timed per step, 48 requests in flight (continuous batching, a chat
mix of shared system prompts and follow-ups), chunked prefill of 2,048 tokens, our plugin + a
daemon process vs vLLM's ``CPUOffloadingSpec``, stepped alternately in one run, in the
qwen3.6 hybrid geometry and attention-only (the latter also with ``big_resident`` blocks in
the pool). ``ratio`` = ours p50 / vLLM p50 of the hybrid step (target <= 1.05),
``p99_ratio`` (<= 1.5), ``attention_ratio``, ``attention_big_ratio`` the same.
``busy_ratio`` / ``busy_p99_ratio`` (``whole_step.hybrid_busy``, the same targets): the hybrid
step again with ``BUSY`` other engine pairs on the machine (3 with --quick), each one process
with ours on the same daemon and namespace and a vLLM CPU-offload engine, stepping their own
chats with a 20 ms simulated GPU step (``bench/busy_engines.py``). ``burst_excess_ms``
(``whole_step.hybrid_bursts``, target <= 1 ms): what 3 bursts of another client's 10,000
commits in ours' namespace add to a step, step for step: the largest ours - vLLM difference
in the 40 steps after a burst, less its median (the same steps of the same workload, so a
long prefill cancels); ``burst_excess_control_ms``, the same over the 40 steps before each
burst, is that statistic's noise. ``burst_step_excess_ms``: each side's longest step after a
burst less its own p50 (vLLM sees no burst: on this host its own figure is 1-2 ms).

Secondary, the lookup alone (``lookup_only``): one 32k-token prompt of the qwen3.6 preset (tokens_per_hash 16, 1 attention + 3 Mamba groups,
block 784), every complete chunk and the highest tail stored, looked up with
``OffloadingConnector.get_num_new_matched_tokens`` (fresh request state each time, the step
closed after each, untimed), interleaved in one run:

* ``vllm``: vLLM 0.33's scheduler over its own ``CPUOffloadingManager`` (in-process);
* ``ours`` / ``ours_big``: the same scheduler code over our plugin (``KVOffloadConnector`` +
  ``KVOffloadSpec``) and a live daemon (embedded on its own loop thread, real ipc sockets, its
  shared index in /dev/shm) holding 1k / 1M resident blocks (100k with --quick).

ours p50 / vLLM p50 (target <= 1.0), p99 (<= 1.5), and ``blocking_round_trips_per_lookup``
(target 0: the plugin reads the shared index in place). ``bare_client``: one ``Lookup``
round trip of the non-vLLM client API (the demo's path), hashes packed outside the timing.
Run alone: ``python -m kvoffload.bench.suites.lookup [--full]``.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from typing import Any

from kvoffload.bench.proc import daemon_process
from kvoffload.bench.seeds import reason_of
from kvoffload.bench.sim import EmbeddedDaemon, percentile
from kvoffload.bench.vllm_baseline import mark_not_run
from kvoffload.bench.workload import PRESETS, block_hashes
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, PackedHashes
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.lookup.plan import chunk_keys, tail_key

__all__ = ["run_lookup_bench"]

TARGET = 1.05  # the whole step, ours p50 / vLLM's
LOOKUP_TARGET = 1.0  # the lookup alone
P99_TARGET = 1.5
PROMPT_TOKENS = 32_768
PRESET = "qwen3.6-27b-tp1"
BUSY = 7  # other engine pairs on the machine in the whole step's busy run (3 with --quick)
BURSTS = 3  # bursts of another client's 10,000 commits in the whole step's burst run
BURST_EXCESS_MS = 1.0  # issue 24: no step after a burst more than this above its steady p50


def prompt_keys(geometry: Geometry, hashes: list[bytes], n: int) -> list[bytes]:
    """Every complete chunk key of every group, and the tail at the highest boundary a lookup
    tries first (``round_down(n - 1, tokens_per_hash)``)."""
    tph = geometry.tokens_per_hash
    keys = [k for gi in range(len(geometry.groups)) for k in chunk_keys(geometry, hashes, gi)]
    boundary = (n - 1) // tph * tph
    return keys + [tail_key(geometry, hashes, gi, boundary) for gi in range(len(geometry.groups))]


def _stats_us(samples_s: list[float]) -> dict[str, float]:
    s = sorted(samples_s)
    return {"p50_us": round(percentile(s, 50) * 1e6, 2), "p99_us": round(percentile(s, 99) * 1e6, 2),
            "samples": len(s)}


def vllm_lookup(tokens: list[int]) -> tuple[Callable[[], float], dict[str, Any]]:
    """vLLM 0.33's scheduler lookup of ``tokens`` with everything stored: a function that
    times one lookup with fresh request state, and what the lookup found."""
    from kvoffload.bench.vllm_baseline import build_connector, make_request, store_keys

    full = PRESETS[PRESET].geometry(1.0)
    conn = build_connector(full, num_chunks=4096)
    sched = conn.connector_scheduler
    req = make_request(tokens, "bench-lookup", full.tokens_per_hash)
    store_keys(conn, prompt_keys(full, list(req.block_hashes), len(tokens)))
    mgr = sched.manager
    calls = [0]
    lookup = mgr.lookup

    def counted(key: bytes, ctx: Any) -> Any:
        calls[0] += 1
        return lookup(key, ctx)

    mgr.lookup = counted
    conn.on_new_request(req)
    hit, _ = conn.get_num_new_matched_tokens(req, 0)
    sched._release_step()
    info = {"hit_tokens": hit, "manager_lookups": calls[0]}
    mgr.lookup = lookup  # time the uninstrumented manager
    clock = time.perf_counter

    def once() -> float:
        # Untimed: fresh request state (vLLM builds it once, at arrival) and the end of the
        # scheduler step (build_connector_meta releases the manager region the lookup opened).
        conn.on_new_request(req)
        t0 = clock()
        conn.get_num_new_matched_tokens(req, 0)
        took = clock() - t0
        sched._release_step()
        return took

    return once, info


def _timer(fn: Callable[[], Any]) -> Callable[[], float]:
    clock = time.perf_counter

    def once() -> float:
        t0 = clock()
        fn()
        return clock() - t0

    return once


def _fill(d: EmbeddedDaemon, geometry: Geometry, count: int, seed: int) -> None:
    """Add ``count`` ready filler blocks straight into the daemon's index (on its loop)."""
    rng = random.Random(seed)
    groups = len(geometry.groups)
    done = 0
    while done < count:
        n = min(100_000, count - done)
        keys = [rng.randbytes(32) + (i % groups).to_bytes(4, "big") for i in range(n)]

        def add(server: Any, keys: list[bytes] = keys) -> None:
            index = server.index
            ns = index.namespace(geometry)
            for k in keys:
                index.prepare(ns, k, 0, False)
                index.commit(ns, k)

        d.call(add)
        done += n


HEADROOM = 512  # pool slots beyond the resident blocks (see plugin_lookup)
HEAD_SIZE = 1  # tiny pages: 1M resident blocks fit in /dev/shm; lookups never touch bytes


def plugin_lookup(tokens: list[int], resident: int, seed: int
                  ) -> tuple[Callable[[], float], dict[str, Any], Callable[[], None]]:
    """vLLM 0.33's scheduler over our plugin and a live daemon holding ``resident`` blocks:
    a function timing one lookup, what it found, and a closer."""
    from kvoffload.bench.vllm_baseline import (
        build_connector,
        end_step,
        kv_cache_config,
        make_request,
    )
    from kvoffload.connector.vllm import KVOffloadConnector

    full = PRESETS[PRESET].geometry(1.0)
    # One slot holds one key's block; vLLM's per-block bytes sum every group's page.
    block = sum(g.kv_cache_spec.page_size_bytes
                for g in kv_cache_config(full, head_size=HEAD_SIZE).kv_cache_groups)
    req0 = make_request(tokens, "bench-lookup", full.tokens_per_hash)
    # A real daemon process, as engines meet it (an embedded one would share our GIL).
    stack = contextlib.ExitStack()
    try:
        _proc, ready = stack.enter_context(daemon_process(
            "--lease-ms", "600000", pool_bytes=(resident + HEADROOM) * block, slot_bytes=block))
        extra = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.connector.vllm",
                 "kvoffload_control": ready["control"], "kvoffload_timeout_ms": 10_000,
                 "kvoffload_store_reserve": 1}
        conn = build_connector(full, 0, extra=extra, connector_cls=KVOffloadConnector,
                               head_size=HEAD_SIZE)
        stack.callback(conn.shutdown)
        manager = conn.connector_scheduler.manager
        geometry = manager.geometry
        keys = prompt_keys(geometry, list(req0.block_hashes), len(tokens))
        writer = DaemonClient(ready["control"], timeout_ms=120_000, name="bench setup")
        writer.register(geometry)
        fill = random.Random(seed)
        groups = len(geometry.groups)
        filler = [fill.randbytes(32) + (i % groups).to_bytes(4, "big")
                  for i in range(resident - len(keys))]
        # The prompt's keys last (most recent), and room beyond ``resident`` for the slots
        # the daemon keeps free ahead of stores while engines read its index (up to 256):
        # otherwise evicting ahead drops the oldest blocks, the prompt's, and ours would
        # answer a miss vLLM never sees.
        everything = filler + keys
        # Pending stores count against one client's share of the pool (client_pool_share_pct):
        # batches well under it.
        step = max(1, min(1 << 15, resident // 4))
        for i in range(0, len(everything), step):
            batch = everything[i:i + step]
            writer.prepare_store([p.StoreItem(key=k, end_token=0) for k in batch])
            writer.commit_store(batch)
        writer.close()
    except BaseException:
        stack.close()
        raise
    sched = conn.connector_scheduler
    session = manager.session
    # Steady state: the view applies a burst over several steps (index_view.REFRESH_BUDGET_S,
    # its cost is index_costs'); the lookups timed here are those of a view that caught up.
    view = session.view
    while view is not None and (view.refresh() or not view.caught_up):
        pass
    req = make_request(tokens, "bench-lookup", geometry.tokens_per_hash)
    conn.on_new_request(req)
    hit, _ = conn.get_num_new_matched_tokens(req, 0)
    sched._req_status.pop(req.request_id, None)
    end_step(conn)
    info = {"hit_tokens": hit, "resident_blocks": resident,
            "view_keys": len(session.view.ready) if session.view else 0}
    clock = time.perf_counter
    waits = [session.client.round_trips]

    def once() -> float:
        conn.on_new_request(req)
        t0 = clock()
        conn.get_num_new_matched_tokens(req, 0)
        took = clock() - t0
        sched._req_status.pop(req.request_id, None)
        end_step(conn)  # the step's one message goes out here, untimed, as in vLLM
        return took

    def close() -> None:
        info["blocking_round_trips"] = session.client.round_trips - waits[0]
        stack.close()

    return once, info, close


def bare_client_lookup(tokens: list[int]) -> tuple[Callable[[], float], Callable[[], None]]:
    """Secondary figure: one ``Lookup`` round trip of the non-vLLM client API."""
    geometry = PRESETS[PRESET].geometry(1e-9)
    hashes = block_hashes(tokens, geometry.tokens_per_hash)
    keys = prompt_keys(geometry, hashes, len(tokens))
    slot = geometry.slot_bytes()
    d = EmbeddedDaemon((len(keys) + 1040) * slot, slot_bytes=slot).__enter__()
    client = d.client("kvoffload bench lookup")
    client.register(geometry)
    client.prepare_store([p.StoreItem(key=k, end_token=0) for k in keys])
    client.commit_store(keys)
    _fill(d, geometry, 1000, seed=3)
    packed = PackedHashes.pack(hashes)
    query = p.LookupQuery(req_id="q", hash_blob=packed.blob, hash_bytes=packed.width,
                          num_tokens=len(tokens), num_prompt_tokens=len(tokens))

    def close() -> None:
        client.close()
        d.__exit__(None, None, None)

    return _timer(lambda: client.lookup([query])), close


def _lookup_only(tokens: list[int], samples: int, small: int, big: int,
                 say: Callable[[str], None]) -> dict[str, Any]:
    """The lookup alone (the former headline), ours at ``small`` and ``big`` resident."""
    out: dict[str, Any] = {"samples": samples, "residency_blocks": [small, big],
                           "target": LOOKUP_TARGET, "p99_target": P99_TARGET}
    kinds: dict[str, Callable[[], float]] = {}
    closers: list[Callable[[], None]] = []
    try:
        say("lookup alone: vLLM 0.33 scheduler over its CPU manager")
        kinds["vllm"], out["vllm_answer"] = vllm_lookup(tokens)
        say(f"lookup alone: over our plugin, daemons with {small:,} and {big:,} blocks")
        t0 = time.perf_counter()
        kinds["ours"], ours_info, close = plugin_lookup(tokens, small, seed=1)
        closers.append(close)
        kinds["ours_big"], big_info, close = plugin_lookup(tokens, big, seed=2)
        closers.append(close)
        out["setup_seconds"] = round(time.perf_counter() - t0, 2)
        kinds["bare_client"], close = bare_client_lookup(tokens)
        closers.append(close)
        times: dict[str, list[float]] = {k: [] for k in kinds}
        rounds = max(1, samples // 25)
        for r in range(rounds + 1):
            for name, fn in kinds.items():
                got = [fn() for _ in range(25)]
                if r:  # round 0 warms up
                    times[name] += got
    finally:
        for close in closers:
            close()
    out["ours_answer"], out["ours_big_answer"] = ours_info, big_info
    for name, values in times.items():
        out[name] = _stats_us(values)
        out[name]["max_us"] = round(max(values) * 1e6, 1)
    p50 = {k: percentile(sorted(v), 50) for k, v in times.items()}
    p99 = {k: percentile(sorted(v), 99) for k, v in times.items()}
    out["ratio"] = round(p50["ours"] / p50["vllm"], 3)
    out["p99_ratio"] = round(p99["ours"] / p99["vllm"], 3)
    out["big_ratio"] = round(p50["ours_big"] / p50["vllm"], 3)
    out["big_p99_ratio"] = round(p99["ours_big"] / p99["vllm"], 3)
    out["bare_client_ratio"] = round(p50["bare_client"] / p50["vllm"], 3)
    lookups = samples + 25 + 1
    out["blocking_round_trips_per_lookup"] = round(
        (ours_info["blocking_round_trips"] + big_info["blocking_round_trips"]) / (2 * lookups), 4)
    out["answers_agree"] = (ours_info["hit_tokens"] == big_info["hit_tokens"]
                            == out["vllm_answer"]["hit_tokens"])
    return out


def _whole_steps(steps: int, big: int, busy: int, say: Callable[[str], None]
                 ) -> dict[str, Any]:
    from kvoffload.bench.whole_step import AFTER_BURST, run_whole_step

    runs = {"hybrid": run_whole_step("hybrid", steps, say=say),
            "attention": run_whole_step("attention", steps, say=say)}
    runs["attention_big"] = run_whole_step("attention", steps, resident=big, seed=1, say=say)
    if busy:
        runs["hybrid_busy"] = run_whole_step("hybrid", max(steps // 2, 50), busy=busy, say=say)
    # Another client's bursts of 10,000 commits in ours' namespace, between steps.
    # Bursts 2 x AFTER_BURST steps apart at least: a burst's control window (the steps before
    # it) holds no earlier burst's aftermath.
    runs["hybrid_bursts"] = run_whole_step(
        "hybrid", max(steps // 4, (BURSTS + 1) * 2 * AFTER_BURST), bursts=BURSTS, seed=2, say=say)
    return runs


def run_lookup_bench(quick: bool = True, *, samples: int | None = None,
                     big_resident: int | None = None, steps: int | None = None,
                     busy: int | None = None,
                     progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = progress or (lambda _msg: None)
    samples = samples or (500 if quick else 5000)
    big = big_resident or (100_000 if quick else 1_000_000)
    steps = steps or (200 if quick else 2000)
    busy = (3 if quick else BUSY) if busy is None else busy
    out: dict[str, Any] = {
        "ratio": None, "target": TARGET, "p99_target": P99_TARGET, "meets": False,
        "preset": PRESET, "prompt_tokens": PROMPT_TOKENS, "steps": steps, "busy": busy,
        "ratio_means": "p50 of the whole scheduler step (schedule() + update_from_output(), 48 "
                       "requests in flight, chat mix, chunked prefill of 2,048 tokens) of vLLM "
                       "0.33's core Scheduler: over our plugin + a daemon process / over vLLM's "
                       "own CPUOffloadingSpec, qwen3.6 hybrid geometry",
        "method": "the two engines step alternately (the first of each pair alternates), same "
                  "workload from the same seed; 50 warm-up steps not counted; busy_ratio: "
                  "the hybrid run (half the steps) with `busy` other engine pairs (ours on the "
                  "same daemon + vLLM's) stepping their own chats, 20 ms GPU step each",
    }
    if mark_not_run(out):
        return out
    rng = random.Random(7)
    tokens = [rng.randrange(150_000) for _ in range(PROMPT_TOKENS)]
    out["whole_step"] = runs = _whole_steps(steps, big, busy, say)
    lookup = _lookup_only(tokens, samples, 1_000, big, say)
    out["lookup_only"] = {k: v for k, v in lookup.items()
                          if k not in ("vllm", "ours", "ours_big", "bare_client")}
    for name in ("vllm", "ours", "ours_big", "bare_client"):  # the latency plot's rows
        out[name] = lookup[name]
    out["ratio"], out["p99_ratio"] = runs["hybrid"]["ratio"], runs["hybrid"]["p99_ratio"]
    for name in ("attention", "attention_big"):
        out[f"{name}_ratio"] = runs[name]["ratio"]
        out[f"{name}_p99_ratio"] = runs[name]["p99_ratio"]
    named = [("ratio", TARGET), ("p99_ratio", P99_TARGET), ("attention_ratio", TARGET),
             ("attention_p99_ratio", P99_TARGET), ("attention_big_ratio", TARGET),
             ("attention_big_p99_ratio", P99_TARGET)]
    if "hybrid_busy" in runs:
        out["busy_ratio"] = runs["hybrid_busy"]["ratio"]
        out["busy_p99_ratio"] = runs["hybrid_busy"]["p99_ratio"]
        named += [("busy_ratio", TARGET), ("busy_p99_ratio", P99_TARGET)]
    bursts = runs["hybrid_bursts"]
    out["burst_excess_ms"] = bursts["burst_paired"]["paired_excess_ms"]
    out["burst_excess_control_ms"] = bursts["burst_paired"]["control_ms"]
    out["burst_step_excess_ms"] = {side: bursts[side]["after_burst"]["excess_ms"]
                                   for side in ("ours", "vllm")}
    named.append(("burst_excess_ms", BURST_EXCESS_MS))
    checks = [(f"{k} {out[k]}", out[k], t) for k, t in named]
    checks += [(f"lookup-only {k} {lookup[k]}", lookup[k], t) for k, t in (
        ("ratio", LOOKUP_TARGET), ("p99_ratio", P99_TARGET), ("big_ratio", LOOKUP_TARGET),
        ("big_p99_ratio", P99_TARGET))]
    missed = [f"{what} > {t}" for what, value, t in checks if value > t]
    wrong = sum(r["ours"]["verify_failures"] + r["ours"]["failed_loads"] for r in runs.values())
    if wrong:
        missed.append(f"{wrong} loads with wrong bytes or failed")
    if lookup["blocking_round_trips_per_lookup"]:
        missed.append(f"blocking_round_trips_per_lookup "
                      f"{lookup['blocking_round_trips_per_lookup']} > 0")
    if not lookup["answers_agree"]:
        missed.append("lookup-only hit tokens differ between ours, ours_big and vLLM")
    out["meets"] = not missed
    out["reason"] = reason_of(missed)
    return out


if __name__ == "__main__":
    from kvoffload.bench.runner import suite_main

    suite_main(run_lookup_bench)
