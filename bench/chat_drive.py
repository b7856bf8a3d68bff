"""One driver for the chat suites that run through vLLM's engine loop (engine_chat, hybrid_chat).

``drive`` feeds turns (a prompt and the reply the fake model will sample) to a ``MiniEngine``
one request at a time, in workload order, each run to completion, and accounts for every prompt
token: cached in the GPU prefix cache, served by the offload (complete chunks, or the partial
tail above the last block edge), or recomputed by the model. The model's count of computed
prompt tokens is measured independently of the connector's answer, so
``gpu + served + recomputed == prompt`` is a check, not an identity. ``verify=True`` checks the
bytes of every load against what the model would have computed (``MiniEngine.verify``).
Simulated TTFT uses daemon/cost.py's ``TimeModel`` over full-size bytes: what a load copies is
one attention page per block it fills plus each Mamba group's state page.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.daemon.cost import TimeModel


@dataclass(frozen=True)
class ChatTurn:
    prompt: list[int]
    reply: list[int]


@dataclass(frozen=True)
class FullScale:
    """The model the simulated TTFT is charged for: bytes of one group block at full size."""

    page_bytes: int
    mamba_groups: int
    model: TimeModel = TimeModel()

    def load_bytes(self, block: int, gpu: int, served: int) -> int:
        if served <= 0:
            return 0
        attention_pages = -(-(gpu + served) // block) - gpu // block
        return (attention_pages + self.mamba_groups) * self.page_bytes


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def drive(engine: Any, turns: Iterable[ChatTurn], *, verify: bool,
          scale: FullScale | None = None, gpu_cache: bool = True,
          max_steps: int = 4000) -> dict[str, Any]:
    """Run every turn; totals per variant (see the module docstring). ``gpu_cache=False``
    empties vLLM's GPU prefix cache before each request (other traffic evicted it), so every
    reused token comes from the offload or is recomputed."""
    out: dict[str, Any] = {"requests": 0, "prompt_tokens": 0, "recomputed_tokens": 0,
                           "gpu_cached_tokens": 0, "served_tokens": 0,
                           "served_chunk_tokens": 0, "served_tail_tokens": 0,
                           "deferrals": 0, "loads": 0, "verify_failures": 0,
                           "failed_loads": 0, "bytes_loaded_full_scale": 0}
    answer: dict[str, tuple[int, int]] = {}  # request -> (local tokens, final hit)
    original = engine.connector.get_num_new_matched_tokens

    def counting(request: Any, local: int) -> Any:
        hit, is_async = original(request, local)
        if hit is None:
            out["deferrals"] += 1
        else:
            answer[request.request_id] = (local, hit)
        return hit, is_async

    engine.connector.get_num_new_matched_tokens = counting
    prompts: dict[str, list[int]] = {}
    loaded: set[str] = set()

    def on_loaded(req_id: str) -> None:
        out["loads"] += 1
        loaded.add(req_id)
        if verify and not engine.verify(req_id, prompts[req_id]):
            out["verify_failures"] += 1

    engine.on_loaded = on_loaded
    block = engine.shape.block
    ttft_ms: list[float] = []
    steps0, sched0 = engine.steps, engine.scheduler_seconds
    unaccounted = 0
    out["load_answer_mismatch"] = 0  # loads whose start is not the connector's answer
    for i, turn in enumerate(turns):
        req_id = f"r{i}"
        prompts[req_id] = turn.prompt
        if not gpu_cache and not engine.scheduler.reset_prefix_cache():
            out["gpu_cache_resets_failed"] = out.get("gpu_cache_resets_failed", 0) + 1
        engine.add(turn.prompt, req_id, reply=turn.reply)
        engine.run(max_steps=max_steps)
        n = len(turn.prompt)
        recomputed = engine.prefill_tokens.pop(req_id, 0)
        started = engine.first_start.pop(req_id, 0)  # GPU cache hit + offload load
        local, hit = answer.pop(req_id, (0, 0))
        if req_id not in loaded:  # a GPU partial-block hit the load would not exceed
            local, hit = started, 0
        tail = (local + hit) % block if hit else 0
        out["requests"] += 1
        out["prompt_tokens"] += n
        out["recomputed_tokens"] += recomputed
        out["gpu_cached_tokens"] += started - hit
        unaccounted += abs(n - started - recomputed)
        out["load_answer_mismatch"] += started != local + hit
        out["served_tokens"] += hit
        out["served_tail_tokens"] += tail
        out["served_chunk_tokens"] += hit - tail
        if scale is not None:
            nbytes = scale.load_bytes(block, local, hit)
            out["bytes_loaded_full_scale"] += nbytes
            ttft_ms.append(1000 * scale.model.ttft(recomputed, nbytes))
        del prompts[req_id]
        loaded.discard(req_id)
        engine.replies.pop(req_id, None)
    out["failed_loads"] = len(engine.failed_loads)
    out["steps"] = engine.steps - steps0
    out["scheduler_us_per_step"] = round(
        1e6 * (engine.scheduler_seconds - sched0) / max(1, out["steps"]), 1)
    # What the first step found computed plus what the model computed is the prompt, for
    # every request (a preemption or a failed load would compute tokens twice).
    out["unaccounted_tokens"] = unaccounted
    out["accounted"] = unaccounted == 0 and out["load_answer_mismatch"] == 0
    if ttft_ms:
        out["ttft_ms_mean"] = round(sum(ttft_ms) / len(ttft_ms), 2)
        out["ttft_ms_p50"] = round(_percentile(ttft_ms, 0.5), 2)
        out["ttft_ms_p99"] = round(_percentile(ttft_ms, 0.99), 2)
    return out
