"""The trace replay's parts without engines: parsing, the token mapping, the ceiling, the
shipped generated trace. The engine-driven suites are in test_trace_suite.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvoffload.bench.trace_gen import SHIPPED, dumps, generate, main
from kvoffload.bench.trace_replay import (
    Scale,
    TraceRequest,
    ceiling_tokens,
    load_trace,
    parse_trace,
    window_starts,
)

SHIPPED_FILE = Path(__file__).resolve().parent.parent / "data" / "mooncake_like_trace.jsonl"


def rec(ts: int, length: int, ids: list[int], out: int = 10) -> str:
    return json.dumps({"timestamp": ts, "input_length": length, "output_length": out,
                       "hash_ids": ids})


def test_parse_orders_by_timestamp_and_names_bad_lines() -> None:
    got = parse_trace([rec(3000, 600, [0, 1]), "", rec(0, 512, [0])])
    assert [r.timestamp_ms for r in got] == [0, 3000]
    assert got[1] == TraceRequest(3000, 600, 10, (0, 1))
    with pytest.raises(ValueError, match=r"t.jsonl:2: 1 hash_ids for 600 input tokens"):
        parse_trace([rec(0, 512, [0]), rec(1, 600, [0])], "t.jsonl")
    with pytest.raises(ValueError, match=r"t.jsonl:1: not a Mooncake trace record"):
        parse_trace(['{"timestamp": 0}'], "t.jsonl")


def test_equal_leading_ids_are_exactly_equal_token_prefixes() -> None:
    scale = Scale(32, 16)
    a = TraceRequest(0, 3 * 512, 1, (0, 5, 6))
    b = TraceRequest(0, 2 * 512 + 100, 1, (0, 5, 9))
    pa, pb = scale.prompt(a), scale.prompt(b)
    assert len(pa) == 96 and len(pb) == 64 + round(100 * 32 / 512)  # the partial last id
    shared = next(i for i, (x, y) in enumerate(zip(pa, pb, strict=False)) if x != y)
    assert shared == 64  # two ids in common, not a token more
    assert scale.output(TraceRequest(0, 512, 512, (0,))) == 32
    assert scale.output(TraceRequest(0, 512, 1, (0,))) == 1  # at least one decode token


def test_ceiling_is_the_longest_seen_prefix_in_blocks() -> None:
    scale = Scale(16, 16)
    window = parse_trace([rec(0, 1024, [0, 1]), rec(1, 1536, [0, 1, 2]),
                          rec(2, 1024, [0, 1]), rec(3, 1024, [0, 7]), rec(4, 512, [3])])
    # First: nothing seen. Second: ids 0,1 (32 tokens). Third: all of it, but never the
    # last token's block (31 -> 16). Fourth: id 0. Fifth: nothing.
    assert ceiling_tokens(window, scale) == [0, 32, 16, 16, 0]


def test_windows_spread_over_the_trace() -> None:
    assert window_starts(100, 3, 20) == [0, 40, 80]
    assert window_starts(30, 3, 20) == [0, 5, 10]  # overlapping when the trace is short
    assert window_starts(10, 1, 20) == [0]


def test_shipped_trace_is_the_generator_output(tmp_path: Path) -> None:
    """tests/data/mooncake_like_trace.jsonl is reproduced by the shipped script, and has the
    public trace's shape: every prompt starts with block 0, later turns reuse earlier ones."""
    assert SHIPPED_FILE.read_text() == dumps(generate(**SHIPPED))
    out = tmp_path / "t.jsonl"
    assert main(["--out", str(out)]) == 0 and out.read_text() == SHIPPED_FILE.read_text()
    trace = load_trace(SHIPPED_FILE)
    assert len(trace) == SHIPPED["requests"]
    assert all(r.hash_ids[0] == 0 for r in trace)
    reuse = sum(ceiling_tokens(trace, Scale()))
    total = sum(len(Scale().prompt(r)) for r in trace)
    assert 0.2 < reuse / total < 0.8
    assert generate(50, seed=1) != generate(50, seed=2)
