"""Model presets and the multi-turn chat workload of shared/spec/workloads.md.

Everything is reproducible from a seed. Numbers that are assumptions (system prompt length,
thinking share, think-time interleaving) are named constants below, so they can be calibrated
in one place.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec

MiB = 1 << 20


@dataclass(frozen=True)
class Preset:
    name: str
    block_tokens: int
    tokens_per_hash: int
    attention_bytes_per_token: int  # per rank
    mamba_groups: int
    tp: int = 1

    def geometry(self, scale: float = 1.0) -> Geometry:
        """Groups share one page size (that is why hybrid blocks are long); bytes scaled."""
        page = max(64, int(self.block_tokens * self.attention_bytes_per_token * scale) // 64 * 64)
        groups = [GroupSpec(kind=GroupKind.FULL_ATTENTION, tokens_per_block=self.block_tokens,
                            bytes_per_block=page)]
        groups += [GroupSpec(kind=GroupKind.MAMBA, tokens_per_block=self.block_tokens,
                             bytes_per_block=page)] * self.mamba_groups
        return Geometry(namespace=f"{self.name}/scale={scale:g}", groups=tuple(groups),
                        tokens_per_hash=self.tokens_per_hash, tp_world_size=self.tp)


PRESETS = {p.name: p for p in [
    Preset("qwen3.6-27b-tp1", 784, 16, 64 * 1024, 3),
    Preset("qwen3-next-80b-tp4", 272, 16, 6 * 1024, 3, tp=4),
    Preset("qwen3-next-80b-tp1", 544, 16, 24 * 1024, 3),
    Preset("llama-8b-attention-only", 16, 16, 128 * 1024, 0),
]}

# Assumptions (workloads.md): calibrate here.
SYSTEM_PROMPT_TOKENS = (500, 2000)
CONCURRENT_CONVERSATIONS = 6  # interleaved, so other traffic evicts between a user's turns
THINKING_SHARE = 0.5  # replies whose leading "thinking" is stripped from the next prompt
VOCAB = 150_000


def _lognormal_int(rng: random.Random, median: float, mean: float, lo: int, hi: int) -> int:
    import math

    mu = math.log(median)
    sigma = math.sqrt(max(1e-6, 2 * (math.log(mean) - mu)))
    return max(lo, min(hi, int(rng.lognormvariate(mu, sigma))))


@dataclass
class Turn:
    conversation: int
    index: int
    prompt: list[int]
    reply: list[int]  # everything the engine generates (thinking included)


@dataclass
class Conversation:
    cid: int
    turns_left: int
    history: list[int] = field(default_factory=list)


def chat_turns(requests: int, seed: int) -> Iterator[Turn]:
    """Turns of interleaved multi-turn conversations, ShareGPT-like lengths."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(rng.randint(*SYSTEM_PROMPT_TOKENS))]
    active: list[Conversation] = []
    next_id = 0
    for _ in range(requests):
        while len(active) < CONCURRENT_CONVERSATIONS:
            msgs = _lognormal_int(rng, 6, 7.3, 2, 30)
            active.append(Conversation(next_id, max(1, msgs // 2), list(system)))
            next_id += 1
        conv = rng.choice(active)
        user = [rng.randrange(VOCAB) for _ in range(_lognormal_int(rng, 20, 90, 2, 2000))]
        prompt = conv.history + user
        visible = [rng.randrange(VOCAB) for _ in range(_lognormal_int(rng, 300, 380, 10, 3000))]
        thinking = ([rng.randrange(VOCAB) for _ in range(rng.randint(50, 400))]
                    if rng.random() < THINKING_SHARE else [])
        yield Turn(conv.cid, len(conv.history), prompt, thinking + visible)
        # The next prompt re-renders history without the thinking part.
        conv.history = prompt + visible
        conv.turns_left -= 1
        if conv.turns_left == 0:
            active.remove(conv)


def block_hashes(tokens: list[int], tokens_per_hash: int, seed: bytes = b"kvoffload") -> list[bytes]:
    """Chained prefix hashes, one per full unit of ``tokens_per_hash`` tokens (as vLLM)."""
    out: list[bytes] = []
    parent = hashlib.sha256(seed).digest()
    for i in range(len(tokens) // tokens_per_hash):
        unit = array("I", tokens[i * tokens_per_hash:(i + 1) * tokens_per_hash]).tobytes()
        parent = hashlib.sha256(parent + unit).digest()
        out.append(parent)
    return out
