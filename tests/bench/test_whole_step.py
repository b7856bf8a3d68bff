"""The whole-step bench (``bench/whole_step.py``) runs both engines on the same workload and
reports what the suite's headline needs; the numbers themselves live in BENCHMARKS.md."""

from __future__ import annotations

import pytest
from kvoffload.bench.vllm_baseline import vllm_import_error

pytestmark = pytest.mark.skipif(vllm_import_error() is not None,
                                reason=str(vllm_import_error()))


def test_both_engines_serve_the_same_chat_and_ours_loads_correct_bytes() -> None:
    from kvoffload.bench.whole_step import IN_FLIGHT, WARMUP, run_whole_step

    out = run_whole_step("attention", 40, seed=2)
    ours, vllm = out["ours"], out["vllm"]
    assert ours["samples"] == vllm["samples"] == 40 and ours["steps"] == WARMUP + 40
    assert out["in_flight"] == IN_FLIGHT
    # The same workload from the same seed: the same requests arrive on both sides.
    assert ours["requests"] == vllm["requests"] and ours["prompt_tokens"] == vllm["prompt_tokens"]
    assert ours["manager"]["stores_offered"] > 0  # ours stored through the daemon
    assert ours["manager"].get("stores_short_reservation", 0) == 0
    assert ours["verify_failures"] == 0 and ours["failed_loads"] == 0
    assert out["ratio"] > 0 and out["p99_ratio"] > 0


def test_a_burst_of_another_clients_commits_lands_between_steps_and_is_watched() -> None:
    from kvoffload.bench.whole_step import AFTER_BURST, WARMUP, run_whole_step

    out = run_whole_step("attention", 2 * AFTER_BURST, seed=4, bursts=1, burst_keys=500)
    assert out["bursts"] == 1 and out["burst_keys"] == 500
    # Every one of the burst's blocks reached ours' view (as READY) within the 40 steps after.
    assert out["bursts_in_view"] == 500
    for side in ("ours", "vllm"):
        after = out[side]["after_burst"]
        assert after["max_us"] > 0
        assert out[side]["samples"] == 2 * AFTER_BURST
    assert out["ours"]["steps"] == WARMUP + 2 * AFTER_BURST
    # Step for step (ours - vLLM), after the burst and, as its control, before it.
    assert set(out["burst_paired"]) == {"paired_excess_ms", "control_ms"}
    assert all(isinstance(v, float) for v in out["burst_paired"].values())
    assert out["ours"]["verify_failures"] == 0 and out["ours"]["failed_loads"] == 0


def test_the_paired_burst_figure_is_the_largest_diff_after_a_burst_over_the_median() -> None:
    from types import SimpleNamespace

    from kvoffload.bench.whole_step import AFTER_BURST, WARMUP, _paired

    n = WARMUP + 200
    at = WARMUP + 100  # the burst lands before this step
    vllm = [1e-3] * n
    ours = [1.2e-3] * n  # 0.2 ms slower on every step: the median difference
    ours[10] = 10e-3  # a warm-up step: never counted
    ours[WARMUP + 10] = 6e-3  # long before the burst: outside both windows
    ours[at - 7] = 1.9e-3  # in the control window (the AFTER_BURST steps before the burst)
    ours[at + 5] = 4.2e-3  # in the watched window
    ours[at + AFTER_BURST + 3] = 8e-3  # just after the watched window
    drivers = {"ours": SimpleNamespace(step_seconds=ours),
               "vllm": SimpleNamespace(step_seconds=vllm)}
    out = _paired(drivers, {at})  # type: ignore[arg-type]
    assert out == {"paired_excess_ms": pytest.approx(3.0, abs=1e-3),
                   "control_ms": pytest.approx(0.7, abs=1e-3)}


def test_an_unknown_geometry_is_refused() -> None:
    from kvoffload.bench.whole_step import geometry

    with pytest.raises(ValueError, match="'hybrid' or 'attention'"):
        geometry("mla")


def test_busy_engines_step_store_into_the_shared_daemon_and_are_gone_after() -> None:
    import os

    from kvoffload.bench.whole_step import run_whole_step

    before = set(_children())  # other tests' servers (a session's Prometheus, daemons)
    out = run_whole_step("attention", 30, seed=3, busy=1, gpu_ms=5.0)
    assert out["busy"] == 1 and len(out["background"]) == 1
    (bg,) = out["background"]
    # The background pair really served its chat, and its ours engine stored into the daemon.
    assert bg["steps"] > 0 and bg["ours"]["steps"] == bg["vllm"]["steps"] == bg["steps"]
    assert bg["ours"]["stores_offered"] > 0 and bg["ours"]["stores_committed"] > 0
    assert out["background_steps"] == [bg["steps"]]
    assert out["background_ours_stores"] == [bg["ours"]["stores_offered"]]
    # One namespace: the same geometry, the same cache; more blocks ready in it than the
    # foreground's ours stored alone.
    assert out["daemon"]["namespaces"] == 1
    assert out["daemon"]["ready"] > out["ours"]["manager"]["stores_committed"]
    # The pool has room for both ours engines: the foreground's capacity is unchanged.
    assert out["daemon"]["num_slots"] == 2 * out["host_blocks"]
    assert out["ours"]["samples"] == out["vllm"]["samples"] == 30
    assert out["ours"]["verify_failures"] == 0 and out["ours"]["failed_loads"] == 0
    with pytest.raises(ProcessLookupError):  # reaped: no background process left behind
        os.kill(bg["pid"], 0)
    assert set(_children()) <= before  # nor a daemon or a zombie of this run


def _children() -> list[int]:
    """Processes whose parent is this one (a zombie included: not yet reaped): compared with
    those alive before, since the suite's session fixtures keep servers of their own."""
    import os
    from pathlib import Path

    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid():
            kids.append(int(stat.parent.name))
    return kids


def test_a_busy_engine_that_fails_to_start_is_reported_and_reaped() -> None:
    from kvoffload.bench.busy_engines import busy_engines

    # The child's own error comes back (geometry refused), and the child is reaped.
    before = set(_children())
    with pytest.raises(RuntimeError, match="(?s)busy engine 0.*'hybrid' or 'attention'"), \
            busy_engines(1, kind="mla", control="ipc:///nonexistent/control.sock"):
        pytest.fail("an engine pair that never stepped is not ready")
    assert set(_children()) <= before
