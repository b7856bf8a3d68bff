"""A small, seeded trace in the format of Mooncake's FAST'25 release, for tests and CI runs.

Not a copy of the public trace: a generator with its shape (one JSON object a line:
``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` one id per 512-token
block, new ids numbered consecutively). A chat service: every prompt starts with the shared
system block (id 0, as in the conversation trace); a request opens a new conversation or
continues one of the recently active ones, whose prompt then repeats the previous prompt's
complete blocks, then new blocks (the previous reply, the new message). Arrivals are Poisson.

The public trace (12,031 requests over 59 minutes; leading-block reuse 36.6 %) is
``FAST25-release/traces/conversation_trace.jsonl`` in the kvcache-ai/Mooncake repository on
GitHub; pass it with ``kvoffload bench --suite trace --trace FILE``.

``python -m kvoffload.bench.trace_gen --out FILE [--requests N] [--seed S]`` writes one;
tests/data/mooncake_like_trace.jsonl is ``--requests 400 --seed 0``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any

BLOCK = 512
SHIPPED = {"requests": 400, "seed": 0}  # tests/data/mooncake_like_trace.jsonl


def generate(requests: int = 400, *, seed: int = 0, rate_per_s: float = 3.4,
             follow_up: float = 0.45, active: int = 40) -> list[dict[str, Any]]:
    """``requests`` records. ``follow_up``: the share continuing a conversation, one of the
    ``active`` most recently served (fewer than the public trace's hundreds, so that a short
    window holds reuse)."""
    rng = random.Random(seed)
    next_id = 1  # id 0: the system prompt every conversation starts with
    recent: list[tuple[list[int], int, int]] = []  # (hash ids, input length, output length)
    out: list[dict[str, Any]] = []
    t = 0.0
    for _ in range(requests):
        t += rng.expovariate(rate_per_s)
        if recent and rng.random() < follow_up:
            ids, length, reply = recent.pop(rng.randrange(len(recent)))
            # The previous prompt's complete blocks are reused; its partial last block, the
            # reply and the new message make the new content.
            keep = ids[:-1] if length % BLOCK else ids
            added = length - BLOCK * len(keep) + reply + _message(rng)
        else:
            keep, added = [0], 300 + _message(rng) + int(rng.lognormvariate(8.6, 1.0))
        new = math.ceil(added / BLOCK)
        ids = keep + list(range(next_id, next_id + new))
        next_id += new
        length = BLOCK * len(keep) + added
        reply = min(2000, max(1, int(rng.lognormvariate(5.6, 0.8))))
        out.append({"timestamp": int(t * 1000), "input_length": length,
                    "output_length": reply, "hash_ids": ids})
        recent.append((ids, length, reply))
        if len(recent) > active:
            recent.pop(0)
    return out


def _message(rng: random.Random) -> int:
    return int(rng.lognormvariate(4.5, 1.2))


def dumps(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--requests", type=int, default=SHIPPED["requests"])
    ap.add_argument("--seed", type=int, default=SHIPPED["seed"])
    args = ap.parse_args(argv)
    args.out.write_text(dumps(generate(args.requests, seed=args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
