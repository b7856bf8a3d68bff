"""engine_chat suite: multi-turn hybrid chat through vLLM 0.33's real engine loop, ours vs vLLM.

Both variants run vLLM's own core ``Scheduler`` (``bench/vllm_engine.py``: its WORKER-role
connector on CPU KV tensors, a fake model whose KV bytes follow from the tokens):

* ``ours``: our plugin (``KVOffloadConnector`` + ``KVOffloadSpec``) and a live daemon process;
  every load's bytes are checked against what the model would have computed;
* ``vllm``: vLLM's own ``CPUOffloadingSpec`` / ``CPUOffloadingManager`` with the same bytes of
  host memory (its worker needs CUDA, so its transfers complete without moving bytes; the
  scheduler decisions, which are what this suite compares, are vLLM's own).

Conversations take turns round-robin (a user's next turn comes after every other user's), the
GPU cache is small (it cannot keep every conversation), and each prompt is the whole history
plus a new message. Reported per variant: prompt tokens recomputed, tokens loaded, deferral
answers (``get_num_new_matched_tokens`` -> None), verified loads. ``ratio`` = ours recomputed /
vLLM recomputed (target <= 0.6); ``deferral_delta`` = ours - vLLM (target <= 2).
Run alone: ``python -m kvoffload.bench.suites.engine_chat [--full]``.
"""

from __future__ import annotations

import random
from typing import Any

from kvoffload.bench.chat_driver import ChatTurn, drive
from kvoffload.bench.proc import daemon_process
from kvoffload.bench.seeds import reason_of
from kvoffload.bench.vllm_baseline import mark_not_run

TARGET = 0.6
DEFERRAL_SLACK = 2
SLOT = 4096


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


def run_engine_chat_bench(quick: bool = True, *, conversations: int | None = None,
                          turns: int = 5, slots: int | None = None, gpu_blocks: int = 48,
                          prompt_only: bool = True, seed: int = 0,
                          progress: Any = None) -> dict[str, Any]:
    say = progress or (lambda _msg: None)
    n = conversations or (8 if quick else 16)
    slots = slots or (160 if quick else 320)
    out: dict[str, Any] = {
        "ratio": None, "target": TARGET, "meets": False, "conversations": n, "turns": turns,
        "host_bytes": slots * SLOT, "gpu_blocks": gpu_blocks,
        "offload_prompt_only": prompt_only, "seed": seed,
        "ratio_means": "prompt tokens recomputed, ours / vLLM's CPUOffloadingManager, through "
                       "vLLM 0.33's core Scheduler, same workload, same host bytes",
    }
    if mark_not_run(out):
        return out
    from kvoffload.bench.vllm_engine import plugin_engine, vllm_cpu_engine

    convs = _conversations(n, turns, seed=11 + seed)  # seed 0: the published runs
    say("vLLM's own CPU offloading")
    theirs = vllm_cpu_engine(slots * SLOT, gpu_blocks=gpu_blocks,
                             offload_prompt_only=prompt_only)
    try:
        out["vllm"] = _drive(theirs, convs, 8, verify=False)
    finally:
        theirs.shutdown()
    say("our plugin and a daemon process")
    # Slots sized by the engine's own block (slot_bytes 0): the same bytes per block as vLLM.
    with daemon_process("--lease-ms", "600000", pool_bytes=slots * SLOT,
                        slot_bytes=0) as (_proc, ready):
        ours = plugin_engine(ready["control"], gpu_blocks=gpu_blocks,
                             offload_prompt_only=prompt_only)
        try:
            out["ours"] = _drive(ours, convs, 8, verify=True)
            out["ours"]["manager"] = dict(ours.connector.scheduler.manager.counters)
        finally:
            ours.shutdown()
    o, v = out["ours"], out["vllm"]
    out["floor_recomputed_tokens"] = _floor(convs, 8)
    out["ratio"] = round(o["recomputed_tokens"] / max(1, v["recomputed_tokens"]), 3)
    out["deferral_delta"] = o["deferrals"] - v["deferrals"]
    missed = []
    if out["ratio"] > TARGET:
        missed.append(f"recomputed ratio {out['ratio']} > {TARGET}")
    if out["deferral_delta"] > DEFERRAL_SLACK:
        missed.append(f"deferrals +{out['deferral_delta']} > +{DEFERRAL_SLACK}")
    if o["verify_failures"]:
        missed.append(f"{o['verify_failures']} loads with wrong bytes")
    out["meets"] = not missed
    out["reason"] = reason_of(missed)
    return out


if __name__ == "__main__":
    from kvoffload.bench.runner import suite_main

    suite_main(run_engine_chat_bench)
