"""The sharing suite's TP=2 variant: two engines, each a vLLM scheduler with our plugin and two
rank processes (vLLM's WORKER connector with its rank), on one daemon. Small sizes; no timing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from kvoffload.bench.vllm_baseline import vllm_import_error

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(vllm_import_error() is not None,
                                 reason=str(vllm_import_error()))]


def _convs() -> list[list[list[int]]]:
    from kvoffload.bench.suites.engine_chat import _conversations

    return _conversations(2, 2, seed=23)


def test_tp2_loads_are_checked_on_every_rank() -> None:
    from kvoffload.bench.suites.sharing import _variant, run_tp_variant

    tp = run_tp_variant(_convs(), 200)
    # Each conversation's second turn lands on the other engine (round-robin): its prefix was
    # stored only by the other engine's rank processes, and is loaded into this engine's.
    assert tp["rank_processes"] == 4 and tp["loads"] == 2
    assert tp["rank_checks"] == 2 * tp["loads"] and tp["verify_failures"] == 0
    # TP changes where the bytes live, not what the scheduler decides: the same hits as TP=1.
    tp1 = _variant(2, _convs(), 200, ours=True)
    assert tp["prompt_tokens"] == tp1["prompt_tokens"]
    assert tp["offload_hit_tokens"] == tp1["offload_hit_tokens"] > 0
    assert tp["recomputed_tokens"] == tp1["recomputed_tokens"]


def test_tp2_check_catches_wrong_bytes() -> None:
    """Pages overwritten in the pool after the stores: every load must fail its rank check."""
    from kvoffload.bench.suites.sharing import run_tp_variant

    def scribble(turn: int, ready: dict[str, Any]) -> None:
        if turn == 0:
            size = os.path.getsize(ready["pool_path"])
            with open(ready["pool_path"], "r+b") as f:
                f.write(b"\x01" * size)

    tp = run_tp_variant(_convs(), 200, between_turns=scribble)
    assert tp["loads"] == 2 and tp["verify_failures"] == 2
    assert Path("/dev/shm").exists()
