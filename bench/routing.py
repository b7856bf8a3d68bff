"""Which engine gets a request: the routings the multi-engine suites (sharing, trace) compare.

* ``round_robin``: request ``i`` to engine ``i mod N`` (a load balancer with no prefix
  affinity; for conversations, turn ``k`` of conversation ``c`` to ``(c + k) mod N``, the
  sharing suite's original routing and the worst case for per-engine caches);
* ``sticky``: a conversation stays on one engine (session affinity; needs conversation ids,
  so it is not defined on a trace without them);
* ``random``: a seeded uniform choice;
* ``kv_aware``: the engine with the longest GPU prefix match, as Dynamo's KV router and
  llm-d's prefix scorer do, read straight from each engine's vLLM block pool (what their KV
  events would tell a router, without the events' lag). Load enters as Dynamo's cost does:
  ``overlap_weight * blocks to prefill + active blocks``, lowest wins, ties to the least
  loaded, then the lowest index. With ``overlap_weight = inf`` the longest match always wins
  (ties to the least loaded): one popular prefix then draws every request to one engine.
* ``kv_aware_cpu``: the same, with each engine's host-memory offload counted as matched too
  (llm-d's precise scorer consumes vLLM's CPU-medium KV events): the best a router can do for
  per-engine offload. Over one shared pool every engine matches the same, so it equals
  ``kv_aware``.

Load is the caller's: ``loads[e]`` in blocks held by requests in flight on engine ``e``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

ROUTINGS = ("round_robin", "sticky", "random", "kv_aware", "kv_aware_cpu")
# Dynamo's KvRouterConfig default: one saved prefill block weighs as one active block.
OVERLAP_WEIGHT = 1.0


@dataclass
class Route:
    """One request as a router sees it."""

    index: int  # arrival order
    blocks: int  # the prompt's blocks
    conversation: int | None = None
    turn: int = 0


@dataclass
class Router:
    """``pick`` returns an engine index; ``matches(e)`` (kv-aware only) gives engine ``e``'s
    matched prefix in blocks for the current request."""

    name: str
    engines: int
    seed: int = 0
    overlap_weight: float = OVERLAP_WEIGHT
    picks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.name not in ROUTINGS:
            raise ValueError(f"unknown routing {self.name!r}: one of {', '.join(ROUTINGS)}")
        self._rng = random.Random(self.seed)

    @property
    def kv_aware(self) -> bool:
        return self.name.startswith("kv_aware")

    def pick(self, route: Route, loads: Sequence[float],
             matches: Callable[[int], int] | None = None) -> int:
        n = self.engines
        if self.name == "round_robin":
            e = (route.index if route.conversation is None
                 else route.conversation + route.turn) % n
        elif self.name == "sticky":
            if route.conversation is None:
                raise ValueError("sticky routing needs conversation ids (a trace has none)")
            e = route.conversation % n
        elif self.name == "random":
            e = self._rng.randrange(n)
        else:
            assert matches is not None, "kv-aware routing needs each engine's prefix match"
            e = min(range(n), key=lambda i: (
                self._cost(route.blocks, matches(i), loads[i]), loads[i], i))
        self.picks.append(e)
        return e

    def _cost(self, blocks: int, matched: int, load: float) -> float:
        prefill = max(0, blocks - matched)
        if math.isinf(self.overlap_weight):
            return float(prefill)  # longest match first; the tie-break sees the load
        return self.overlap_weight * prefill + load

    def spread(self) -> list[int]:
        """Requests per engine so far."""
        return [self.picks.count(e) for e in range(self.engines)]


def gpu_match_blocks(engine: Any, request: Any) -> int:
    """Blocks of ``request``'s prefix in ``engine``'s vLLM GPU prefix cache, as its scheduler
    would find them (``find_longest_cache_hit`` only reads the block pool: no touch, no stats)."""
    manager = engine.scheduler.kv_cache_manager
    _blocks, tokens, *_ = manager.coordinator.find_longest_cache_hit(
        request.block_hashes, request.num_tokens - 1)
    return int(tokens) // engine.shape.block


def offload_match_blocks(engine: Any, request: Any) -> int:
    """Blocks of ``request``'s prefix in the engine's own offload manager (attention group
    keys, stopping at the first miss; a tiering manager's CPU primary tier): what its
    CPU-medium KV events would tell a router."""
    from kvoffload.bench.residency import cpu_policy
    from vllm.v1.kv_offload.base import make_offload_key

    policy = cpu_policy(engine.connector.connector_scheduler.manager)
    per_block = engine.shape.block // engine.shape.unit
    hashes = request.block_hashes[per_block - 1::per_block]
    n = 0
    for h in hashes[:(request.num_tokens - 1) // engine.shape.block]:
        # The manager's own index (``lookup`` wants a request context; this reads the same
        # table without touching recency).
        if policy.get(make_offload_key(h, 0)) is None:
            break
        n += 1
    return n


class LoadClock:
    """Active blocks per engine in virtual time, for the kv-aware cost: a request holds its
    blocks from arrival until its prefill (queued FIFO behind the engine's earlier prefills
    at ``prefill_tokens_per_s``) and its decode (``decode_s_per_token`` per output token)
    are done. Times and token counts are the trace's real ones, not the scaled replay's."""

    def __init__(self, engines: int, *, prefill_tokens_per_s: float = 10_000.0,
                 decode_s_per_token: float = 0.02) -> None:
        self.prefill_rate, self.tpot = prefill_tokens_per_s, decode_s_per_token
        self.prefill_free = [0.0] * engines
        self.active: list[list[tuple[float, int]]] = [[] for _ in range(engines)]

    def loads(self, now: float) -> list[float]:
        for held in self.active:
            held[:] = [(end, b) for end, b in held if end > now]
        return [float(sum(b for _, b in held)) for held in self.active]

    def admit(self, engine: int, now: float, prefill_tokens: int, output_tokens: int,
              blocks: int) -> float:
        """The request's finish time; its blocks count on ``engine`` until then."""
        start = max(now, self.prefill_free[engine])
        self.prefill_free[engine] = start + prefill_tokens / self.prefill_rate
        end = self.prefill_free[engine] + output_tokens * self.tpot
        self.active[engine].append((end, blocks))
        return end
