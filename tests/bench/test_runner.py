"""`kvoffload bench`'s own part: a reason for every suite that misses, the spread over seeds,
phase lines or a bar, and the libraries' logging kept off stderr. Suites are stand-ins here;
no timing is asserted."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from kvoffload.bench import runner as cli
from kvoffload.bench.seeds import aggregate_seeds, generic_reason

from kvoffload.cli import main


def _run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp: Path,
         suites: dict[str, Any], *extra: str) -> dict[str, Any]:
    monkeypatch.setattr(cli, "_suite", lambda name: suites.get(name))
    monkeypatch.setattr(cli, "write_plots", lambda report, out: [])
    args = ["bench", "--json", "--out", str(tmp)] + [
        a for name in suites for a in ("--suite", name)] + list(extra)
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)["suites"]


def test_every_suite_gets_a_reason(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    def events(quick: bool) -> dict[str, Any]:  # higher is better, missed, no reason given
        return {"ratio": 3.0, "target": 4.0, "meets": False}

    def lookup(quick: bool) -> dict[str, Any]:  # lower is better, missed
        return {"ratio": 1.25, "target": 1.0, "meets": False}

    def load(quick: bool) -> dict[str, Any]:  # headline met, another check failed
        return {"ratio": 0.5, "target": 1.0, "meets": False}

    def memory(quick: bool) -> dict[str, Any]:  # its own reason is kept
        return {"ratio": 0.9, "target": 1.0, "meets": False, "reason": "RSS 309 MB vs 300 MB"}

    def copy(quick: bool) -> dict[str, Any]:
        raise RuntimeError("no device")

    def sharing(quick: bool) -> dict[str, Any]:
        return {"ratio": 2.3, "target": 1.8, "meets": True}

    got = _run(monkeypatch, capsys, tmp_path, {"events": events, "lookup": lookup,
                                                "load": load, "memory": memory, "copy": copy,
                                                "sharing": sharing})
    assert got["events"]["reason"] == "ratio 3.0 is 25.0 % below the target (>= 4.0)"
    assert got["lookup"]["reason"] == "ratio 1.25 is 25.0 % above the target (<= 1.0)"
    assert "another check of the suite failed" in got["load"]["reason"]
    assert got["memory"]["reason"] == "RSS 309 MB vs 300 MB"
    assert got["copy"]["reason"].startswith("not run: RuntimeError('no device')")
    assert got["sharing"]["reason"] == "all sub-targets met"
    md = (tmp_path / "bench.md").read_text()
    assert "25.0 % below the target" in md and "| sharing | 2.30 |" in md


def test_a_suite_s_own_direction_wins() -> None:
    r = {"ratio": 0.5, "target": 0.8, "meets": False, "direction": ">="}
    assert generic_reason("lookup", r) == "ratio 0.5 is 37.5 % below the target (>= 0.8)"
    err = repr(RuntimeError("daemon did not start: Traceback (most recent call last):\n  File "
                            "x\nTypeError: bad keyword 'auto_views'\n"))
    assert generic_reason("load", {"ratio": None, "meets": False, "error": err}) == (
        "not run: TypeError: bad keyword 'auto_views'")
    assert "names no sub-target" in generic_reason("load", {
        "ratio": 0.5, "target": "zero errors", "meets": False})


def test_seeds_give_the_spread(monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    calls: dict[str, list[Any]] = {"sharing": [], "events": []}

    def sharing(quick: bool, seed: int = 0) -> dict[str, Any]:
        calls["sharing"].append(seed)
        ratio = [1.0, 3.0, 2.0][seed]
        return {"ratio": ratio, "ratio_4": ratio * 10, "target": 1.5, "meets": ratio >= 1.5,
                "reason": f"2 engines: {ratio} < 1.5" if ratio < 1.5 else "all sub-targets met"}

    def events(quick: bool) -> dict[str, Any]:  # no seed parameter: runs once
        calls["events"].append(None)
        return {"ratio": 5.0, "target": 4.0, "meets": True}

    got = _run(monkeypatch, capsys, tmp_path, {"sharing": sharing, "events": events},
               "--seeds", "3")
    assert calls == {"sharing": [0, 1, 2], "events": [None]}
    s = got["sharing"]
    assert (s["seeds"]["min"], s["seeds"]["median"], s["seeds"]["max"]) == (1.0, 2.0, 3.0)
    assert s["ratio"] == 2.0 and s["ratio_4"] == 20.0
    assert s["seeds"]["ratio_4"] == {"min": 10.0, "median": 20.0, "max": 30.0}
    assert [row["ratio"] for row in s["seeds"]["per_seed"]] == [1.0, 3.0, 2.0]
    assert s["meets"] is False and s["reason"] == "seed 0: 2 engines: 1.0 < 1.5"
    assert "seeds" not in got["events"] and got["events"]["meets"] is True
    assert "1.00 / 2.00 / 3.00 (n=3)" in (tmp_path / "bench.md").read_text()


def test_seeds_with_an_error_and_bad_counts(capsys: pytest.CaptureFixture[str]) -> None:
    out = aggregate_seeds([(0, {"ratio": 2.0, "target": 1.5, "meets": True}),
                           (1, {"ratio": None, "target": 1.5, "meets": False,
                                "error": "RuntimeError('x')"})])
    assert out["seeds"]["n"] == 2 and out["seeds"]["median"] == 2.0
    assert out["meets"] is False and "seed 1: RuntimeError('x')" in out["reason"]
    assert main(["bench", "--seeds", "0"]) == 2
    assert "--seeds 0: must be at least 1" in capsys.readouterr().err


def test_libraries_are_quiet_unless_verbose(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    for key in ("KVO_BENCH_QUIET", "VLLM_LOGGING_LEVEL", "MC_LOG_LEVEL"):
        monkeypatch.delenv(key, raising=False)
    vllm_log = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_log, "level", logging.NOTSET)
    seen: list[tuple[str | None, str | None, int]] = []

    def events(quick: bool) -> dict[str, Any]:
        env = dict(os.environ)
        seen.append((env.get("KVO_BENCH_QUIET"), env.get("MC_LOG_LEVEL"),
                     vllm_log.getEffectiveLevel()))
        vllm_log.warning("vLLM chatter")
        return {"ratio": 5.0, "target": 4.0, "meets": True}

    _run(monkeypatch, capsys, tmp_path, {"events": events}, "--verbose")
    assert seen[-1][:2] == (None, None) and seen[-1][2] < logging.ERROR
    monkeypatch.setattr(cli, "_suite", lambda name: events)
    assert main(["bench", "--suite", "events", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "vLLM chatter" not in err and "running events" in err  # a phase line, no TTY
    assert seen[-1] == ("1", "ERROR", logging.ERROR)  # inherited by what the suite starts
    # Afterwards the caller's environment and levels are back (a test session keeps its own).
    assert "KVO_BENCH_QUIET" not in os.environ and vllm_log.level == logging.NOTSET


def test_a_bar_on_a_tty() -> None:
    pytest.importorskip("tqdm")
    buf = io.StringIO()
    progress = cli.Progress(2, tty=True, stream=buf)
    say = progress.suite("sharing")
    say("2 engines: vLLM per-engine offload")
    progress.done()
    progress.done()
    progress.close()
    text = buf.getvalue()
    assert "sharing" in text and "2/2" in text and "2 engines" in text


def test_a_suite_whose_baseline_cannot_run_says_not_run(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """No ratio because vLLM (the baseline) is missing: "not run" with why, not a miss with
    "no ratio measured"; what the suite measured of ours stays in the result."""
    import kvoffload.bench.vllm_baseline as vb

    monkeypatch.setattr(vb, "vllm_import_error", lambda: "no vllm here")

    def events(quick: bool) -> dict[str, Any]:  # as run_events_bench without vLLM
        return {"ratio": None, "target": 4.0, "meets": False, "ours_events_per_s": 123,
                "baseline": "unavailable: ModuleNotFoundError: No module named 'vllm'"}

    def memory(quick: bool) -> dict[str, Any]:  # a suite's own "unavailable" baseline
        return {"ratio": None, "target": 1.0, "meets": False, "baseline": "unavailable: x"}

    got = _run(monkeypatch, capsys, tmp_path, {"events": events, "memory": memory})
    assert got["events"]["reason"] == "vLLM baseline not run: no vllm here"
    assert got["events"]["ours_events_per_s"] == 123
    assert got["memory"]["reason"] == "baseline not run: unavailable: x"
    md = (tmp_path / "bench.md").read_text()
    assert "| events | None |  | 4.0 | not run | vLLM baseline not run: no vllm here |" in md
    assert "no ratio measured" not in md


def test_bench_quick_without_vllm_says_the_events_suite_did_not_run(tmp_path: Path) -> None:
    """The real CLI, with vLLM unimportable (a stand-in package that raises on import, first
    on the path): the events suite reports "not run" and why."""
    import subprocess
    import sys

    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('vLLM hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": f"{fake.parent}{os.pathsep}"
           f"{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "kvoffload", "bench", "--quick", "--suite",
                          "events", "--json", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)["suites"]["events"]
    assert r["ratio"] is None and r["not_run"].startswith("vLLM baseline not run:"), r
    assert "vLLM hidden by the test" in r["reason"] and r["ours_events_per_s"] > 0
    assert "| events | None |" in (tmp_path / "out" / "bench.md").read_text()
    assert "not run" in (tmp_path / "out" / "bench.md").read_text()
