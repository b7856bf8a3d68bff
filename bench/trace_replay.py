"""Replay a Mooncake FAST'25 trace through N vLLM engines: the trace, token mapping, ceiling.

A trace is JSON lines in the format of ``FAST25-release/traces/*.jsonl`` in the
kvcache-ai/Mooncake repository: ``timestamp`` (ms since the first request), ``input_length``,
``output_length`` and ``hash_ids``, one id per 512-token block of the prompt, equal ids
meaning equal content (and, since ids are assigned along prefixes, equal prefixes).

``Scale`` maps each id to a fixed run of ``tokens_per_id`` token ids (its last, partial block
to a proportional share), so a CPU replay is small while its prefix structure is the trace's
exactly: two prompts share ``k`` runs exactly when their ``hash_ids`` share ``k`` leading ids.
``Replay`` serves requests one at a time in timestamp order on ``MiniEngine``s
(bench/vllm_engine.py: vLLM 0.33's core Scheduler and WORKER connector), each request to the
engine its router picks, and accounts for every prompt token: found in that engine's GPU
prefix cache, served by the offload, or recomputed (the model's own count, so the sum is a
check). ``ceiling_tokens`` is what an unbounded cache shared by every engine could serve.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvoffload.bench.residency import cpu_policy
from kvoffload.bench.routing import LoadClock, Route, Router, gpu_match_blocks, offload_match_blocks

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake traces
TOKEN_BASE = 50_000  # run tokens start here (the fake model samples ids near 1000)


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_trace(lines: Iterable[str], source: str = "trace") -> list[TraceRequest]:
    """Requests in timestamp order (stable); a malformed line is one ``ValueError`` naming it."""
    out: list[TraceRequest] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            req = TraceRequest(int(rec["timestamp"]), int(rec["input_length"]),
                               int(rec["output_length"]),
                               tuple(int(x) for x in rec["hash_ids"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{source}:{n}: not a Mooncake trace record ({exc})") from None
        if req.input_length <= 0 or not req.hash_ids or len(req.hash_ids) != math.ceil(
                req.input_length / TRACE_BLOCK):
            raise ValueError(f"{source}:{n}: {len(req.hash_ids)} hash_ids for "
                             f"{req.input_length} input tokens (want one per {TRACE_BLOCK})")
        out.append(req)
    return sorted(out, key=lambda r: r.timestamp_ms)


def load_trace(path: str | Path) -> list[TraceRequest]:
    with open(path) as f:
        return parse_trace(f, str(path))


def window_starts(total: int, count: int, length: int) -> list[int]:
    """First request of each of ``count`` windows of ``length``, spread evenly over a trace of
    ``total`` (overlapping when it is shorter than ``count * length``)."""
    last = max(0, total - length)
    return [round(i * last / (count - 1)) for i in range(count)] if count > 1 else [0]


@dataclass(frozen=True)
class Scale:
    """``tokens_per_id`` tokens stand for one 512-token id (a multiple of the engine block
    keeps every shared prefix block-aligned, as it is at full size)."""

    tokens_per_id: int = 16
    block: int = 16

    def prompt(self, r: TraceRequest) -> list[int]:
        t = self.tokens_per_id
        last = r.input_length - TRACE_BLOCK * (len(r.hash_ids) - 1)
        tokens = [TOKEN_BASE + x * t + j for x in r.hash_ids for j in range(t)]
        cut = t - max(1, round(last * t / TRACE_BLOCK))
        return tokens[:len(tokens) - cut] if cut else tokens

    def output(self, r: TraceRequest) -> int:
        return max(1, round(r.output_length * self.tokens_per_id / TRACE_BLOCK))

    def real_tokens(self, scaled: int) -> int:
        return round(scaled * TRACE_BLOCK / self.tokens_per_id)

    def reusable(self, prompt_len: int, matched_ids: int, ids: int) -> int:
        """Tokens a cache can serve when ``matched_ids`` leading ids are cached: whole blocks,
        and never the last prompt token (vLLM recomputes it for the logits)."""
        tokens = prompt_len if matched_ids >= ids else matched_ids * self.tokens_per_id
        return min(tokens, (prompt_len - 1) // self.block * self.block)


def ceiling_tokens(window: Sequence[TraceRequest], scale: Scale) -> list[int]:
    """Per request: the prefix tokens an unbounded cache shared by all engines could serve,
    i.e. its longest run of leading ids seen in an earlier request of the window."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for r in window:
        matched = 0
        while matched < len(r.hash_ids) and r.hash_ids[:matched + 1] in seen:
            matched += 1
        out.append(scale.reusable(len(scale.prompt(r)), matched, len(r.hash_ids)))
        seen.update(r.hash_ids[:k] for k in range(1, len(r.hash_ids) + 1))
    return out


@dataclass
class Served:
    index: int
    engine: int
    prompt: int
    gpu: int
    offload: int
    recomputed: int


@dataclass
class Replay:
    """Engines, a router and the tallies of everything served. ``replace`` swaps an engine
    for a fresh one (a restart) and keeps counting."""

    engines: list[Any]
    router: Router
    scale: Scale = Scale()
    verify: bool = True
    clock: LoadClock | None = None
    max_steps: int = 4000
    # Wall time an engine step that scheduled nothing sleeps: it waits on a tier's threads
    # (a disk write, a promotion) that would otherwise compete with a spinning loop.
    pause_s: float = 0.0
    served: list[Served] = field(default_factory=list)
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys((
        "requests", "prompt_tokens", "gpu_tokens", "offload_hit_tokens", "recomputed_tokens",
        "deferrals", "loads", "verify_failures", "failed_loads", "unaccounted_tokens"), 0))

    def __post_init__(self) -> None:
        self.clock = self.clock or LoadClock(len(self.engines))
        self._answer: dict[str, int] = {}
        self._prompts: dict[str, list[int]] = {}
        self._loaded: set[str] = set()
        for e in self.engines:
            self._attach(e)

    def _attach(self, engine: Any) -> None:
        original = engine.connector.get_num_new_matched_tokens

        def counting(request: Any, local: int) -> Any:
            hit, is_async = original(request, local)
            if hit is None:
                self.totals["deferrals"] += 1
            else:
                self._answer[request.request_id] = hit
            return hit, is_async

        def loaded(req_id: str) -> None:
            self.totals["loads"] += 1
            self._loaded.add(req_id)
            if self.verify and not engine.verify(req_id, self._prompts[req_id]):
                self.totals["verify_failures"] += 1

        engine.connector.get_num_new_matched_tokens = counting
        engine.on_loaded = loaded

    def replace(self, k: int, engine: Any) -> None:
        self.totals["failed_loads"] += len(self.engines[k].failed_loads)
        self.engines[k] = engine
        self._attach(engine)

    def _matches(self, tokens: list[int]) -> Callable[[int], int]:
        from kvoffload.bench.vllm_baseline import make_request

        probe = make_request(tokens, "route-probe", self.engines[0].shape.unit)
        with_offload = self.router.name == "kv_aware_cpu"

        def matches(e: int) -> int:
            engine = self.engines[e]
            m = gpu_match_blocks(engine, probe)
            # Per-engine offload only: a shared pool matches the same on every engine.
            if with_offload and cpu_policy(
                    engine.connector.connector_scheduler.manager) is not None:
                m = max(m, offload_match_blocks(engine, probe))
            return m

        return matches

    def _run(self, engine: Any) -> None:
        if not self.pause_s:
            engine.run(max_steps=self.max_steps)
            return
        for _ in range(self.max_steps):
            if not engine.busy():
                return
            if not engine.step().num_scheduled_tokens:
                time.sleep(self.pause_s)
        raise AssertionError(f"engine still busy after {self.max_steps} steps")

    def serve(self, tokens: list[int], reply: list[int], route: Route, *,
              now_s: float = 0.0, output_real: int | None = None) -> Served:
        """One request on the router's engine, run to completion (its stores land too)."""
        assert self.clock is not None
        loads = self.clock.loads(now_s)
        matches = self._matches(tokens) if self.router.kv_aware else None
        k = self.router.pick(route, loads, matches)
        engine = self.engines[k]
        req_id = f"q{route.index}"
        self._prompts[req_id] = tokens
        engine.add(tokens, req_id, reply=reply)
        self._run(engine)
        recomputed = engine.prefill_tokens.pop(req_id, 0)
        started = engine.first_start.pop(req_id, 0)
        answer = self._answer.pop(req_id, 0)
        # An answer whose load never ran (a GPU hit covered it) served nothing.
        hit = answer if req_id in self._loaded else 0
        self._loaded.discard(req_id)
        del self._prompts[req_id]
        engine.replies.pop(req_id, None)
        s = Served(route.index, k, len(tokens), started - hit, hit, recomputed)
        self.served.append(s)
        t = self.totals
        t["requests"] += 1
        t["prompt_tokens"] += s.prompt
        t["gpu_tokens"] += s.gpu
        t["offload_hit_tokens"] += s.offload
        t["recomputed_tokens"] += s.recomputed
        t["unaccounted_tokens"] += abs(s.prompt - started - recomputed)
        blocks = -(-(len(tokens) + len(reply)) // engine.shape.block)
        self.clock.admit(k, now_s, self.scale.real_tokens(recomputed),
                         output_real if output_real is not None else len(reply), blocks)
        return s

    def run(self, window: Sequence[TraceRequest], start: int = 0,
            before: Callable[[int], None] | None = None) -> None:
        """Every request of ``window`` in order; ``before(i)`` runs ahead of request ``i``."""
        for i, r in enumerate(window):
            if before is not None:
                before(i)
            tokens = self.scale.prompt(r)
            reply = [1 + (x % 997) for x in range(len(tokens), len(tokens) + self.scale.output(r))]
            self.serve(tokens, reply, Route(start + i, -(-len(tokens) // self.scale.block)),
                       now_s=r.timestamp_ms / 1000, output_real=r.output_length)

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.totals)
        out["failed_loads"] += sum(len(e.failed_loads) for e in self.engines)
        out["requests_per_engine"] = self.router.spread()
        return out
