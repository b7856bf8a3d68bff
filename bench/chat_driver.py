"""One driver for the chat suites that run through vLLM's engine loop (engine_chat, hybrid_chat).

``drive`` feeds turns (a prompt and the reply the fake model will sample) to a ``MiniEngine``
one request at a time, in workload order, each run to completion, and accounts for every prompt
token: cached in the GPU prefix cache, served by the offload (complete chunks, or the partial
tail above the last block edge), or recomputed by the model. The model's count of computed
prompt tokens is measured independently of the connector's answer, so
``gpu + served + recomputed == prompt`` is a check, not an identity. ``verify=True`` checks the
bytes of every load against what the model would have computed (``MiniEngine.verify``).
Simulated TTFT uses daemon/lookup/cost.py's ``TimeModel`` over full-size bytes: what a load copies is
one attention page per block it fills plus each Mamba group's state page.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.daemon.lookup.cost import TimeModel


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


class Driver:
    """One engine's side of a run: ``turn`` runs one request to completion, ``result`` sums
    up. Several drivers take turns request by request, so their per-step scheduler times are
    measured under the same machine load. ``gpu_cache=False`` empties vLLM's GPU prefix cache
    before each request (other traffic evicted it): every reused token comes from the offload
    or is recomputed."""

    def __init__(self, engine: Any, *, verify: bool, scale: FullScale | None = None,
                 gpu_cache: bool = True, max_steps: int = 4000) -> None:
        self.engine, self.verify, self.scale = engine, verify, scale
        self.gpu_cache, self.max_steps = gpu_cache, max_steps
        self.out: dict[str, Any] = {
            "requests": 0, "prompt_tokens": 0, "recomputed_tokens": 0, "gpu_cached_tokens": 0,
            "served_tokens": 0, "served_chunk_tokens": 0, "served_tail_tokens": 0,
            "deferrals": 0, "loads": 0, "verify_failures": 0, "failed_loads": 0,
            "bytes_loaded_full_scale": 0, "load_answer_mismatch": 0, "unaccounted_tokens": 0,
            "gpu_cache_resets_failed": 0}
        self._answer: dict[str, tuple[int, int]] = {}  # request -> (local tokens, final hit)
        self._prompts: dict[str, list[int]] = {}
        self._loaded: set[str] = set()
        self._ttft_ms: list[float] = []
        self._steps0, self._sched0 = engine.steps, engine.scheduler_seconds
        original = engine.connector.get_num_new_matched_tokens

        def counting(request: Any, local: int) -> Any:
            hit, is_async = original(request, local)
            if hit is None:
                self.out["deferrals"] += 1
            else:
                self._answer[request.request_id] = (local, hit)
            return hit, is_async

        engine.connector.get_num_new_matched_tokens = counting
        engine.on_loaded = self._on_loaded

    def _on_loaded(self, req_id: str) -> None:
        self.out["loads"] += 1
        self._loaded.add(req_id)
        if self.verify and not self.engine.verify(req_id, self._prompts[req_id]):
            self.out["verify_failures"] += 1

    def turn(self, turn: ChatTurn) -> None:
        engine, out = self.engine, self.out
        req_id = f"r{out['requests']}"
        self._prompts[req_id] = turn.prompt
        if not self.gpu_cache and not engine.scheduler.reset_prefix_cache():
            out["gpu_cache_resets_failed"] += 1
        engine.add(turn.prompt, req_id, reply=turn.reply)
        engine.run(max_steps=self.max_steps)
        n = len(turn.prompt)
        recomputed = engine.prefill_tokens.pop(req_id, 0)
        started = engine.first_start.pop(req_id, 0)  # GPU cache hit + offload load
        local, hit = self._answer.pop(req_id, (0, 0))
        if req_id not in self._loaded:  # a GPU partial-block hit the load would not exceed
            local, hit = started, 0
        tail = (local + hit) % engine.shape.block if hit else 0
        out["requests"] += 1
        out["prompt_tokens"] += n
        out["recomputed_tokens"] += recomputed
        out["gpu_cached_tokens"] += started - hit
        # What the first step found computed plus what the model computed is the prompt (a
        # preemption or a failed load would compute tokens twice).
        out["unaccounted_tokens"] += abs(n - started - recomputed)
        out["load_answer_mismatch"] += started != local + hit
        out["served_tokens"] += hit
        out["served_tail_tokens"] += tail
        out["served_chunk_tokens"] += hit - tail
        if self.scale is not None:
            nbytes = self.scale.load_bytes(engine.shape.block, local, hit)
            out["bytes_loaded_full_scale"] += nbytes
            self._ttft_ms.append(1000 * self.scale.model.ttft(recomputed, nbytes))
        del self._prompts[req_id]
        self._loaded.discard(req_id)
        engine.replies.pop(req_id, None)

    def result(self) -> dict[str, Any]:
        out, engine = dict(self.out), self.engine
        out["failed_loads"] = len(engine.failed_loads)
        out["steps"] = engine.steps - self._steps0
        out["scheduler_us_per_step"] = round(
            1e6 * (engine.scheduler_seconds - self._sched0) / max(1, out["steps"]), 1)
        out["accounted"] = out["unaccounted_tokens"] == 0 and out["load_answer_mismatch"] == 0
        if self._ttft_ms:
            out["ttft_ms_mean"] = round(sum(self._ttft_ms) / len(self._ttft_ms), 2)
            out["ttft_ms_p50"] = round(_percentile(self._ttft_ms, 0.5), 2)
            out["ttft_ms_p99"] = round(_percentile(self._ttft_ms, 0.99), 2)
        return out


def drive(engine: Any, turns: Iterable[ChatTurn], *, verify: bool,
          scale: FullScale | None = None, gpu_cache: bool = True) -> dict[str, Any]:
    """Every turn on one engine; its totals (see ``Driver``)."""
    driver = Driver(engine, verify=verify, scale=scale, gpu_cache=gpu_cache)
    for turn in turns:
        driver.turn(turn)
    return driver.result()


# ------------------------------------------------------------------ continuous batching


class ChatMix:
    """Multi-turn conversations for an engine that keeps many requests in flight: a few shared
    system prompts, users' messages and replies of ShareGPT-like lengths (workload.py's
    distributions, replies capped at ``reply_cap``). A conversation's next turn is its history
    plus a new message, handed out only once its previous turn finished; one grown past
    ``max_tokens`` ends and a new one starts. Reproducible from ``seed``."""

    def __init__(self, seed: int, *, systems: int = 4, max_tokens: int = 12_000,
                 reply_cap: int = 512) -> None:
        from kvoffload.bench.workload import SYSTEM_PROMPT_TOKENS, VOCAB, _lognormal_int

        self._rng = rng = random.Random(seed)
        self._vocab, self._length = VOCAB, _lognormal_int
        self.systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(*SYSTEM_PROMPT_TOKENS))]
                        for _ in range(systems)]
        self.max_tokens, self.reply_cap = max_tokens, reply_cap
        self._idle: list[list[int]] = []  # histories whose last turn finished

    def _tokens(self, median: float, mean: float, lo: int, hi: int) -> list[int]:
        rng = self._rng
        return [rng.randrange(self._vocab) for _ in range(self._length(rng, median, mean, lo, hi))]

    def next_turn(self) -> ChatTurn:
        rng = self._rng
        # Follow-ups and new conversations about equally often, once some are waiting.
        if self._idle and rng.random() < 0.5:
            history = self._idle.pop(rng.randrange(len(self._idle)))
        else:
            history = list(rng.choice(self.systems))
        prompt = history + self._tokens(20, 90, 2, 2000)
        reply = self._tokens(100, 160, 4, self.reply_cap)
        return ChatTurn(prompt, reply)

    def finished(self, turn: ChatTurn) -> None:
        history = turn.prompt + turn.reply
        if len(history) + self.reply_cap + 2000 < self.max_tokens:
            self._idle.append(history)


class Inflight:
    """Continuous batching on one ``MiniEngine``: ``n`` requests in flight, a finished one's
    place taken at once by the mix's next turn; ``step`` runs one engine step and returns what
    vLLM's scheduler spent in it (``schedule()`` + ``update_from_output()``). ``verify``: every
    load's bytes are checked against the fake model's."""

    def __init__(self, engine: Any, mix: ChatMix, n: int, *, verify: bool) -> None:
        self.engine, self.mix, self.n, self.verify = engine, mix, n, verify
        engine.token_per_step = True  # decode steps as vLLM takes them: most steps are these
        self._live: dict[str, tuple[Any, ChatTurn]] = {}
        self._count = 0
        self.step_seconds: list[float] = []
        self.out: dict[str, Any] = {"requests": 0, "prompt_tokens": 0, "recomputed_tokens": 0,
                                    "deferrals": 0, "loads": 0, "verify_failures": 0}
        original = engine.connector.get_num_new_matched_tokens

        def counting(request: Any, local: int) -> Any:
            hit, is_async = original(request, local)
            self.out["deferrals"] += hit is None
            return hit, is_async

        engine.connector.get_num_new_matched_tokens = counting
        engine.on_loaded = self._on_loaded

    def _on_loaded(self, req_id: str) -> None:
        self.out["loads"] += 1
        live = self._live.get(req_id)
        if self.verify and live is not None and not self.engine.verify(req_id,
                                                                       live[1].prompt):
            self.out["verify_failures"] += 1

    def step(self) -> float:
        engine = self.engine
        while len(self._live) < self.n:
            turn = self.mix.next_turn()
            req_id = f"c{self._count}"
            self._count += 1
            self._live[req_id] = (engine.add(turn.prompt, req_id, reply=turn.reply), turn)
        engine.step()
        for req_id, (req, turn) in list(self._live.items()):
            if req.is_finished():
                del self._live[req_id]
                self.mix.finished(turn)
                self.out["requests"] += 1
                self.out["prompt_tokens"] += len(turn.prompt)
                self.out["recomputed_tokens"] += engine.prefill_tokens.pop(req_id, 0)
                engine.first_start.pop(req_id, None)
                engine.replies.pop(req_id, None)
        self.step_seconds.append(engine.last_step_seconds)
        return engine.last_step_seconds

    def result(self) -> dict[str, Any]:
        out = dict(self.out)
        out["failed_loads"] = len(self.engine.failed_loads)
        out["steps"] = len(self.step_seconds)
        return out
