"""engine_chat suite: multi-turn hybrid chat through vLLM 0.33's real engine loop, ours vs vLLM.

Both variants run vLLM's own core ``Scheduler`` (``bench/vllm_engine.py``: its WORKER-role
connector on CPU KV tensors, a fake model whose KV bytes follow from the tokens):

* ``ours``: our plugin (``KVOffloadConnector`` + ``KVOffloadSpec``, defaults) and a live daemon
  process; every load's bytes are checked against what the model would have computed;
* ``vllm``: vLLM's own ``CPUOffloadingSpec`` / ``CPUOffloadingManager`` in each configuration
  (store policy chunk / request x eviction LRU / ARC, bench/vllm_peers.py); the one that
  recomputes least is the baseline (its worker needs CUDA, so its transfers complete without
  moving bytes; the scheduler decisions, which are what this suite compares, are vLLM's own).

Memory is compared at **equal block counts** (not bytes: vLLM pads each chunk to 4 KiB, 8x this
engine's 512-byte block; at real block sizes the padding is negligible, so equal bytes are
equal blocks there), at two sizes: ``slots`` (160: the pool evicts) and ``room`` (1280: it
holds every block of the run). Conversations take turns round-robin (a user's next turn
comes after every other user's), the GPU cache is small, each prompt is the whole history
plus a new message. Reported per variant: prompt tokens recomputed, tokens loaded, deferral
answers (``get_num_new_matched_tokens`` -> None), verified loads. ``ratio`` = ours recomputed
/ the best vLLM configuration's at ``slots`` (target <= 1.0: no more than the peer's best);
``ratio_room`` the same at ``room``; ``ratio_vs_default`` against vLLM's default
configuration (chunk-lru, the old headline). ``deferral_delta`` = ours - vLLM (target <= 2).
Run alone: ``python -m kvoffload.bench.suites.engine_chat [--full]``.
"""

from __future__ import annotations

import random
from typing import Any

from kvoffload.bench.chat_driver import ChatTurn, drive
from kvoffload.bench.proc import daemon_process
from kvoffload.bench.seeds import reason_of
from kvoffload.bench.vllm_baseline import mark_not_run

TARGET = 1.0  # no more recomputation than the peer's best configuration
DEFERRAL_SLACK = 2
PAGE = 512  # bytes of one block of one group: one pool slot, one vLLM chunk


def _conversations(n: int, turns: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    return [[[rng.randrange(20_000, 40_000) for _ in range(rng.randint(20, 60))]
             for _ in range(turns)] for _ in range(n)]


def _floor(convs: list[list[list[int]]], reply_tokens: int, unit: int = 4) -> int:
    """Fewest prompt tokens any offload can leave to compute: the first turn, then what follows
    the previous prompt's last hash boundary (the reply is not stored, as vLLM's default)."""
    total = 0
    for conv in convs:
        history: list[int] = []
        for k, message in enumerate(conv):
            prompt = history + message
            total += len(prompt) if k == 0 else len(prompt) - (len(history) - reply_tokens - 1
                                                                ) // unit * unit
            history = prompt + [0] * reply_tokens
    return total


def _turns(convs: list[list[list[int]]], reply_tokens: int) -> list[ChatTurn]:
    """Round-robin turns; each reply (the fake model's) joins the history of the next prompt."""
    history: list[list[int]] = [[] for _ in convs]
    turns = []
    for turn in range(len(convs[0])):
        for c, conv in enumerate(convs):
            prompt = history[c] + conv[turn]
            reply = [1000 + len(prompt) + i for i in range(reply_tokens)]
            turns.append(ChatTurn(prompt, reply))
            history[c] = prompt + reply
    return turns


def _drive(engine: Any, convs: list[list[list[int]]], reply_tokens: int,
           verify: bool) -> dict[str, Any]:
    out = drive(engine, _turns(convs, reply_tokens), verify=verify)
    out["loaded_tokens"] = out["prompt_tokens"] - out["recomputed_tokens"]
    return out


def _size(convs: list[list[list[int]]], blocks: int, gpu_blocks: int, prompt_only: bool,
          configs: tuple[str, ...], say: Any) -> dict[str, Any]:
    """Every vLLM configuration, then ours, each with ``blocks`` blocks of host memory."""
    from kvoffload.bench.vllm_engine import plugin_engine
    from kvoffload.bench.vllm_peers import offload_engine

    theirs: dict[str, Any] = {}
    for config in configs:
        say(f"{blocks} blocks: vLLM's CPU offloading, {config}")
        e = offload_engine(blocks, config, gpu_blocks=gpu_blocks,
                           offload_prompt_only=prompt_only)
        try:
            theirs[config] = _drive(e, convs, 8, verify=False)
        finally:
            e.shutdown()
    say(f"{blocks} blocks: our plugin and a daemon process")
    with daemon_process("--lease-ms", "600000", pool_bytes=blocks * PAGE,
                        slot_bytes=0) as (_proc, ready):
        ours = plugin_engine(ready["control"], gpu_blocks=gpu_blocks,
                             offload_prompt_only=prompt_only)
        try:
            mine = _drive(ours, convs, 8, verify=True)
            mine["manager"] = dict(ours.connector.scheduler.manager.counters)
        finally:
            ours.shutdown()
    best = min(configs, key=lambda c: theirs[c]["recomputed_tokens"])
    out = {"host_blocks": blocks, "ours": mine, "vllm": theirs, "vllm_best": best,
           "ratio": round(mine["recomputed_tokens"] / max(1, theirs[best]["recomputed_tokens"]),
                          3)}
    if "chunk-lru" in theirs:
        out["ratio_vs_default"] = round(mine["recomputed_tokens"] / max(
            1, theirs["chunk-lru"]["recomputed_tokens"]), 3)
    return out


def run_engine_chat_bench(quick: bool = True, *, conversations: int | None = None,
                          turns: int = 5, slots: int | None = None, room: int | None = None,
                          gpu_blocks: int = 48, prompt_only: bool = True, seed: int = 0,
                          configs: tuple[str, ...] | None = None,
                          progress: Any = None) -> dict[str, Any]:
    """``room`` 0 runs the ``slots`` size alone."""
    from kvoffload.bench.vllm_peers import CONFIGS

    say = progress or (lambda _msg: None)
    n = conversations or (8 if quick else 16)
    slots = slots or (160 if quick else 320)
    room = (1280 if quick else 2560) if room is None else room
    configs = configs or CONFIGS
    out: dict[str, Any] = {
        "ratio": None, "target": TARGET, "meets": False, "conversations": n, "turns": turns,
        "host_blocks": slots, "room_blocks": room or None, "gpu_blocks": gpu_blocks,
        "offload_prompt_only": prompt_only, "seed": seed, "vllm_configs": list(configs),
        "memory": "equal block counts (vLLM's 4 KiB chunk padding left out)",
        "ratio_means": "prompt tokens recomputed, ours / the best of vLLM's CPUOffloadingManager "
                       "configurations, through vLLM 0.33's core Scheduler, same workload, "
                       "same number of host blocks",
    }
    if mark_not_run(out):
        return out
    convs = _conversations(n, turns, seed=11 + seed)  # seed 0: the published runs
    out["floor_recomputed_tokens"] = _floor(convs, 8)
    sizes = [slots] + ([room] if room else [])
    out["sizes"] = {str(b): _size(convs, b, gpu_blocks, prompt_only, tuple(configs), say)
                    for b in sizes}
    head = out["sizes"][str(slots)]
    o, v = head["ours"], head["vllm"][head["vllm_best"]]
    out["ours"], out["vllm"], out["vllm_best"] = o, v, head["vllm_best"]
    out["ratio"] = head["ratio"]
    out["ratio_vs_default"] = head.get("ratio_vs_default")
    if room:
        out["ratio_room"] = out["sizes"][str(room)]["ratio"]
    out["deferral_delta"] = o["deferrals"] - v["deferrals"]
    missed = []
    if out["ratio"] > TARGET:
        missed.append(f"recomputed ratio {out['ratio']} > {TARGET} at {slots} blocks (vs "
                      f"vLLM {head['vllm_best']})")
    if out["deferral_delta"] > DEFERRAL_SLACK:
        missed.append(f"deferrals +{out['deferral_delta']} > +{DEFERRAL_SLACK}")
    for b, size in out["sizes"].items():
        if size["ours"]["verify_failures"]:
            missed.append(f"{b} blocks: {size['ours']['verify_failures']} loads with wrong bytes")
    out["meets"] = not missed
    out["reason"] = reason_of(missed)
    return out


if __name__ == "__main__":
    from kvoffload.bench.runner import suite_main

    suite_main(run_engine_chat_bench)
