"""sharing suite: one cache for every engine of the node, against per-engine offload.

2 and 4 engines, each vLLM 0.33's own core ``Scheduler`` + WORKER connector
(``bench/vllm_engine.py``); conversations' turns (8-16 conversations x 6 turns, the whole
history each time) are routed over the engines three ways (bench/routing.py):

* ``round_robin``: turn ``k`` of conversation ``c`` to engine ``(c + k) mod N``: no prefix
  affinity, every next turn on another engine -- the worst case for per-engine caches;
* ``sticky``: a conversation stays on engine ``c mod N`` (session affinity) -- their best case;
* ``kv_aware``: the engine with the longest GPU prefix match (Dynamo's cost: blocks to
  prefill + active blocks, ties to the least loaded); "active" here: the blocks of the last N
  requests routed to that engine (turns are served one at a time).

Variants, at equal host memory counted in blocks (bench/vllm_peers.py: vLLM pads a chunk to
4 KiB, 8x this engine's 512-byte block; at real block sizes equal bytes are equal blocks):

* ``ours``: every engine loads our plugin (``KVOffloadConnector``) against ONE daemon process
  of ``slots`` slots; bytes checked on every load;
* ``vllm``: every engine runs vLLM's own ``CPUOffloadingSpec`` with ``slots / N`` chunks, in
  each configuration (store policy chunk / request x LRU / ARC); the best per cell is the
  baseline.

``offload_hit_tokens`` sums the tokens ``get_num_new_matched_tokens`` answered (what the
offload tier served, GPU prefix-cache hits excluded). ``ratio`` = ours / best vLLM offload
hits with 2 engines under round-robin (target >= 1.8), ``ratio_4`` with 4 (target >= 3);
``ratio_<routing>_<N>`` every cell (no target for sticky and KV-aware: reported as they are).
``seed`` shifts the conversations (``kvoffload bench --seeds N``). ``tp2``: round-robin over 2
engines whose 2 TP ranks each run in their own process (``bench/tp_ranks.py``), every load
checked on every rank. Run alone: ``python -m kvoffload.bench.suites.sharing [--full]``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from kvoffload.bench.proc import daemon_process
from kvoffload.bench.routing import Route, Router, gpu_match_blocks
from kvoffload.bench.seeds import reason_of
from kvoffload.bench.suites.engine_chat import _conversations
from kvoffload.bench.vllm_baseline import make_request, mark_not_run
from kvoffload.bench.vllm_peers import CONFIGS, offload_engine

TARGETS = {2: 1.8, 4: 3.0}  # round-robin only: the other routings have none
REPLY = 8
ROUTINGS = ("round_robin", "sticky", "kv_aware")
PAGE = 512  # bytes of one block of one group (bench/vllm_engine.py): one pool slot


def check_loads(engine: Any, prompts: dict[str, list[int]], out: dict[str, Any]) -> Any:
    """A load-done hook that checks every KV row the request now holds against the tokens."""
    from kvoffload.bench.vllm_engine import BLOCK, ROW, token_row

    def check(req_id: str) -> None:
        out["loads"] += 1
        req = engine.scheduler.requests[req_id]
        attn = engine.block_table(req_id)[0]
        tokens = prompts[req_id]
        for t in range(req.num_computed_tokens):
            row = engine.pages["attn.0"][attn[t // BLOCK], ROW * (t % BLOCK):
                                         ROW * (t % BLOCK + 1)]
            if bytes(row.numpy()) != bytes(token_row(tokens, t).numpy()):
                out["verify_failures"] += 1
                return

    return check


def _route(engines: list[Any], convs: list[list[list[int]]], between_turns: Any = None,
           routing: str = "round_robin") -> dict[str, Any]:
    """Every turn of every conversation (turn-major: each user's next turn comes after every
    other user's), each on the engine ``routing`` picks; tallies per variant.
    ``between_turns(turn)`` runs after every conversation's turn ``turn`` (tests tamper)."""
    out: dict[str, Any] = {"prompt_tokens": 0, "recomputed_tokens": 0, "offload_hit_tokens": 0,
                           "deferrals": 0, "loads": 0, "verify_failures": 0}
    prompts: dict[str, list[int]] = {}
    served: dict[str, int] = {}  # request -> tokens its (last) answered lookup served
    for e in engines:
        original = e.connector.get_num_new_matched_tokens

        def counting(request: Any, local: int, original: Any = original) -> Any:
            hit, is_async = original(request, local)
            out["deferrals"] += hit is None
            if hit is not None:
                served[request.request_id] = hit
            return hit, is_async

        e.connector.get_num_new_matched_tokens = counting
    router = Router(routing, len(engines))
    recent: deque[tuple[int, int]] = deque(maxlen=len(engines))  # (engine, blocks): in flight
    history: list[list[int]] = [[] for _ in convs]
    for turn in range(len(convs[0])):
        for c, conv in enumerate(convs):
            prompt = history[c] + conv[turn]
            req_id = f"c{c}t{turn}"
            blocks = -(-len(prompt) // 16)
            loads = [float(sum(b for k, b in recent if k == i)) for i in range(len(engines))]
            matches = None
            if router.kv_aware:
                probe = make_request(prompt, "route-probe", 4)

                def matches(i: int, probe: Any = probe) -> int:
                    return gpu_match_blocks(engines[i], probe)

            k = router.pick(Route(len(router.picks), blocks, c, turn), loads, matches)
            recent.append((k, blocks))
            e = engines[k]
            prompts[req_id] = prompt
            # A TP engine's ranks check in their own processes.
            checker = getattr(e, "load_checker", None)
            e.on_loaded = checker(prompts, out) if checker else check_loads(e, prompts, out)
            e.add(prompt, req_id, max_tokens=REPLY)
            e.run(max_steps=2000)
            out["prompt_tokens"] += len(prompt)
            out["recomputed_tokens"] += e.prefill_tokens[req_id]
            history[c] = prompt + [1000 + len(prompt) + i for i in range(REPLY)]
        if between_turns is not None:
            between_turns(turn)
    out["offload_hit_tokens"] = sum(served.values())
    out["requests_per_engine"] = router.spread()
    return out


def _variant(n_engines: int, convs: list[list[list[int]]], slots: int, ours: bool,
             routing: str = "round_robin", config: str = "chunk-lru") -> dict[str, Any]:
    """``slots`` blocks of host memory in all: one pool, or ``slots / N`` chunks per engine."""
    from kvoffload.bench.vllm_engine import plugin_engine

    def serve(engines: list[Any]) -> dict[str, Any]:
        try:
            return _route(engines, convs, routing=routing)
        finally:
            for e in engines:
                e.shutdown()

    if not ours:
        return serve([offload_engine(slots // n_engines, config, gpu_blocks=24)
                      for _ in range(n_engines)])
    with daemon_process("--lease-ms", "600000", pool_bytes=slots * PAGE,
                        slot_bytes=0) as (_proc, ready):
        return serve([plugin_engine(ready["control"], gpu_blocks=24, kvoffload_store_reserve=16)
                      for _ in range(n_engines)])


def run_tp_variant(convs: list[list[list[int]]], slots: int, *, engines: int = 2,
                   world: int = 2, between_turns: Any = None) -> dict[str, Any]:
    """``engines`` engines of ``world`` TP ranks each (a process per rank) on one daemon,
    round-robin; every load checked on every rank in its own process."""
    from kvoffload.bench.tp_ranks import TPEngine

    with daemon_process("--lease-ms", "600000", pool_bytes=slots * PAGE * world,
                        slot_bytes=0) as (_proc, ready):
        started: list[Any] = []
        try:
            for _ in range(engines):
                started.append(TPEngine(ready["control"], world=world, gpu_blocks=24,
                                        kvoffload_store_reserve=16))
            hook = None if between_turns is None else (
                lambda turn: between_turns(turn, ready))
            out: dict[str, Any] = {**_route(started, convs, hook), "engines": engines,
                                   "tp_world": world,
                                   "rank_processes": engines * world}
        finally:
            for e in started:
                e.shutdown()
    out.setdefault("rank_checks", 0)
    return out


def cell(k: int, convs: list[list[list[int]]], slots: int, routing: str,
         configs: Sequence[str]) -> dict[str, Any]:
    """One engine count and routing: every vLLM configuration, then ours; the best vLLM one
    is the baseline."""
    theirs = {c: _variant(k, convs, slots, ours=False, routing=routing, config=c)
              for c in configs}
    mine = _variant(k, convs, slots, ours=True, routing=routing)
    best = max(configs, key=lambda c: theirs[c]["offload_hit_tokens"])
    b = theirs[best]["offload_hit_tokens"]
    # Per-engine offload that never sees a conversation twice serves nothing at all.
    ratio = (round(mine["offload_hit_tokens"] / b, 3) if b else
             float("inf") if mine["offload_hit_tokens"] else None)
    return {"ours": mine, "vllm": theirs[best], "vllm_best": best, "ratio": ratio,
            "vllm_offload_hit_tokens": {c: theirs[c]["offload_hit_tokens"] for c in configs},
            "target": TARGETS.get(k) if routing == "round_robin" else None}


def run_sharing_bench(quick: bool = True, *, conversations: int | None = None,
                      turns: int = 6, slots: int | None = None,
                      engines: tuple[int, ...] = (2, 4), tp: bool = True, seed: int = 0,
                      routings: Sequence[str] = ROUTINGS, configs: Sequence[str] | None = None,
                      progress: Any = None) -> dict[str, Any]:
    say = progress or (lambda _msg: None)
    n = conversations or (8 if quick else 16)
    slots = slots or (320 if quick else 640)
    configs = tuple(configs or (("chunk-lru", "request-lru") if quick else CONFIGS))
    out: dict[str, Any] = {
        "ratio": None, "target": TARGETS[2], "meets": False, "conversations": n, "turns": turns,
        "host_blocks_total": slots, "host_bytes_total": slots * PAGE,
        "vllm_configs": list(configs), "routings": list(routings),
        "ratio_means": "offload hit tokens, one shared daemon / the best per-engine vLLM CPU "
                       "offload configuration with 1/N of the blocks, 2 engines, round-robin "
                       "routing (ratio_<routing>_<N>: every cell)",
    }
    if mark_not_run(out):
        return out
    convs = _conversations(n, turns, seed=23 + seed)
    out["seed"] = seed
    missed = []
    for routing in routings:
        for k in engines:
            say(f"{routing}, {k} engines: vLLM {len(configs)} configurations, one daemon")
            got = cell(k, convs, slots, routing, configs)
            # engines_<N>: round-robin, as before (plots.py draws it); the others by name.
            out[f"engines_{k}" if routing == "round_robin" else f"{routing}_{k}"] = got
            out[f"ratio_{routing}_{k}"] = got["ratio"]
            if got["target"] is not None and (got["ratio"] or 0) < got["target"]:
                missed.append(f"{routing}, {k} engines: {got['ratio']} < {got['target']}")
            if got["ours"]["verify_failures"]:
                missed.append(f"{routing}, {k} engines: {got['ours']['verify_failures']} "
                              "loads with wrong bytes")
    if tp:
        say("TP=2: 2 engines x 2 rank processes on one daemon")
        tp_convs = [conv[:3] for conv in convs[:4]]  # small: 4 rank processes on the node
        tp_out = run_tp_variant(tp_convs, slots)
        out["tp2"] = tp_out
        if not tp_out["loads"]:
            missed.append("TP=2: no load happened (nothing verified across processes)")
        if tp_out["verify_failures"]:
            missed.append(f"TP=2: {tp_out['verify_failures']} loads with wrong bytes on a rank")
    out["ratio"] = out.get("engines_2", {}).get("ratio")
    out["ratio_4"] = out.get("engines_4", {}).get("ratio")
    out["meets"] = not missed
    out["reason"] = reason_of(missed)
    return out


if __name__ == "__main__":
    from kvoffload.bench.runner import suite_main

    suite_main(run_sharing_bench)
