"""The trace-replay suites' command lines: ``kvoffload bench`` lists the below-memory suite and
runs the real one with ``--trace`` / ``--trace-scale`` passed on (a tiny run: one window of a
trace written here), and the three suites' ``python -m`` entries share one parser
(bench/suite_args.py) that hands each run what was given. No timing."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest
from kvoffload.bench.vllm_baseline import vllm_import_error

from kvoffload.cli import build_parser, main

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _suite_choices() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bench = sub.choices["bench"]
    return list(next(a for a in bench._actions if a.dest == "suite").choices or [])


def test_bench_lists_the_trace_suites() -> None:
    choices = _suite_choices()
    assert {"trace", "restart", "below_memory"} <= set(choices)


def _tiny_trace(path: Path, requests: int = 12) -> None:
    """Requests sharing a 3-id prefix, then 2 ids of their own (timestamps 1 s apart)."""
    lines = [json.dumps({"timestamp": 1000 * i, "input_length": 512 * 4 + 100,
                         "output_length": 64, "hash_ids": [0, 1, 2, 100 + 2 * i, 101 + 2 * i]})
             for i in range(requests)]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.vllm
@pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error()))
def test_bench_runs_below_memory_with_the_trace_options(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    import kvoffload.bench.runner as runner
    from kvoffload.bench.suites import below_memory
    from kvoffload.bench.suites.trace import Sizes

    # The suite's --quick sizes cut to one window of 12 requests (the CLI has no size flags).
    monkeypatch.setattr(below_memory, "SIZES", {True: Sizes(1, 12, 64, ("chunk-lru",), 4)})
    monkeypatch.setattr(runner, "write_plots", lambda report, out: [])
    trace = tmp_path / "trace.jsonl"
    _tiny_trace(trace)
    assert main(["bench", "--suite", "below_memory", "--quick", "--trace", str(trace),
                 "--trace-scale", "32", "--seeds", "2", "--json",
                 "--out", str(tmp_path / "out")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["suites"]) == ["below_memory"]
    r = report["suites"]["below_memory"]
    assert "error" not in r, r.get("error")
    assert r["trace"] == str(trace) and r["tokens_per_id"] == 32
    assert r["host_blocks_total"] == 4 * 16 and r["routing"] == "kv_aware_cpu"
    (row,) = r["windows"]
    assert row["requests"] == 12
    # One id = 32 tokens = 2 blocks: every request's prompt is 5 ids, less its cut last one.
    prompt = row["vllm_cpu-chunk-lru"]["prompt_tokens"]
    assert prompt == row["ours_pool"]["prompt_tokens"] and 12 * 4 * 32 < prompt <= 12 * 5 * 32
    for name in ("ours_pool", "ours_disk", "vllm_cpu-chunk-lru", "vllm_fs-shared-lru",
                 "vllm_fs-own-lru"):
        v = row[name]
        assert v["gpu_tokens"] + v["offload_hit_tokens"] + v["recomputed_tokens"] == prompt
    assert row["ours_disk"]["verify_failures"] == 0
    # Not seed-aware: run once, its spread over windows (one here) in the seeds column.
    assert r["seeds"]["n"] == (1 if r["ratio"] is not None else 0)
    assert r["meets"] is (r["reason"] == "no ratio target: 0 wrong or failed loads in every "
                                         "replay of ours")
    assert "| below_memory |" in (tmp_path / "out" / "bench.md").read_text()


@pytest.mark.parametrize(("suite", "func"), [("trace", "run_trace_bench"),
                                             ("below_memory", "run_below_memory"),
                                             ("restart", "run_restart_bench")])
def test_python_m_entries_share_one_parser(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str], suite: str,
                                           func: str) -> None:
    import importlib

    module = importlib.import_module(f"kvoffload.bench.suites.{suite}")
    calls: list[tuple[bool, dict[str, Any]]] = []

    def run(quick: bool, **kwargs: Any) -> dict[str, Any]:
        calls.append((quick, kwargs))
        return {"ratio": 1.0}

    monkeypatch.setattr(module, func, run)
    argv = ["--full", "--trace", "t.jsonl", "--trace-scale", "32", "--windows", "2",
            "--routing", "round_robin"]
    if suite != "restart":
        argv += ["--window", "10"]
    module.main(argv)
    assert json.loads(capsys.readouterr().out) == {"ratio": 1.0}
    ((quick, kwargs),) = calls
    assert quick is False and callable(kwargs.pop("progress"))
    want: dict[str, Any] = {"trace": "t.jsonl", "trace_scale": 32, "n_windows": 2}
    want["routings" if suite == "trace" else "routing"] = (
        ("round_robin",) if suite == "trace" else "round_robin")
    if suite != "restart":
        want["window"] = 10
    assert kwargs == want
    module.main([])  # the defaults: --quick sizes, a generated trace
    quick, kwargs = calls[-1]
    assert quick is True and kwargs["trace"] is None and kwargs["trace_scale"] == 16
    with pytest.raises(SystemExit):
        module.main(["--routing", "sticky"])  # not a routing the trace suites have
