"""The routers of the multi-engine suites (bench/routing.py): who gets which request, and the
GPU prefix match read from vLLM's own block pool. No timing anywhere."""

from __future__ import annotations

import os

import pytest
from kvoffload.bench.routing import LoadClock, Route, Router, gpu_match_blocks
from kvoffload.bench.vllm_baseline import vllm_import_error

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def test_round_robin_and_sticky_follow_the_conversation() -> None:
    rr, sticky = Router("round_robin", 4), Router("sticky", 4)
    # Turn k of conversation c: (c + k) mod N, so every next turn moves; sticky stays.
    assert [rr.pick(Route(0, 1, conversation=1, turn=k), [0.0] * 4) for k in range(5)] == [
        1, 2, 3, 0, 1]
    assert {sticky.pick(Route(0, 1, conversation=6, turn=k), [0.0] * 4) for k in range(5)} == {2}
    # Requests without conversations: arrival order.
    assert [Router("round_robin", 3).pick(Route(i, 1), [0.0] * 3) for i in range(4)] == [
        0, 1, 2, 0]
    with pytest.raises(ValueError, match="conversation ids"):
        Router("sticky", 2).pick(Route(0, 1), [0.0, 0.0])
    with pytest.raises(ValueError, match="unknown routing"):
        Router("least_loaded", 2)


def test_random_is_seeded() -> None:
    routers = [Router("random", 4, seed=s) for s in (3, 3, 4)]
    picks = [[r.pick(Route(i, 1), [0.0] * 4) for i in range(50)] for r in routers]
    assert picks[0] == picks[1] != picks[2]
    assert set(picks[0]) == {0, 1, 2, 3}


def test_kv_aware_cost_match_then_load() -> None:
    r = Router("kv_aware", 3)
    route = Route(0, blocks=10)
    # Longest match wins when loads are equal.
    assert r.pick(route, [0.0, 0.0, 0.0], {0: 2, 1: 7, 2: 3}.__getitem__) == 1
    # Equal matches: the least loaded, then the lowest index.
    assert r.pick(route, [5.0, 1.0, 1.0], lambda e: 4) == 1
    # Dynamo's cost: 5 saved blocks do not pay for 12 active ones (10-5+12 > 10-0+0).
    assert r.pick(route, [12.0, 0.0, 3.0], {0: 5, 1: 0, 2: 0}.__getitem__) == 1
    # With an infinite weight the longest match always wins, whatever the load.
    greedy = Router("kv_aware", 3, overlap_weight=float("inf"))
    assert greedy.pick(route, [12.0, 0.0, 3.0], {0: 5, 1: 0, 2: 0}.__getitem__) == 0
    assert r.spread() == [0, 3, 0] and greedy.spread() == [1, 0, 0]


def test_load_clock_holds_blocks_until_prefill_and_decode_end() -> None:
    clock = LoadClock(2, prefill_tokens_per_s=1000.0, decode_s_per_token=0.1)
    # 1,000 tokens: prefill ends at 1 s, 10 output tokens decode until 2 s.
    assert clock.admit(0, 0.0, 1000, 10, blocks=7) == pytest.approx(2.0)
    # A second prefill on the same engine queues behind the first (FIFO).
    assert clock.admit(0, 0.5, 500, 0, blocks=3) == pytest.approx(1.5)
    assert clock.loads(1.0) == [10.0, 0.0]
    assert clock.loads(1.6) == [7.0, 0.0]
    assert clock.loads(2.0) == [0.0, 0.0]


@pytest.mark.vllm
@pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error()))
def test_gpu_match_is_what_vllms_scheduler_finds() -> None:
    """After a prompt ran on engine A, the probe matches its complete blocks there (not the
    last token's block) and nothing on B; reading it changes nothing A's scheduler sees."""
    from kvoffload.bench.vllm_baseline import make_request
    from kvoffload.bench.vllm_engine import Shape
    from kvoffload.bench.vllm_peers import offload_engine

    shape = Shape(mamba_groups=0, unit=16)
    a, b = (offload_engine(16, gpu_blocks=24, shape=shape) for _ in range(2))
    try:
        tokens = list(range(100, 100 + 5 * 16))  # 5 blocks
        a.add(tokens, "first", max_tokens=2)
        a.run()
        probe = make_request(tokens + [7, 8], "probe", shape.unit)
        assert gpu_match_blocks(a, probe) == 5 and gpu_match_blocks(b, probe) == 0
        exact = make_request(tokens, "exact", shape.unit)
        assert gpu_match_blocks(a, exact) == 4  # vLLM recomputes the last token's block
        a.add(tokens + [7, 8], "second", max_tokens=2)
        a.run()
        assert a.prefill_tokens["second"] == 2  # the scheduler found the same 5 blocks
    finally:
        a.shutdown()
        b.shutdown()
