"""The trace, restart and sharing suites through vLLM's engine loop, at tiny sizes: accounting,
equal memory, byte checks, and what each comparison must show by construction. No timing."""

from __future__ import annotations

import os

import pytest
from kvoffload.bench.vllm_baseline import vllm_import_error

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(vllm_import_error() is not None,
                                 reason=str(vllm_import_error()))]
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _accounted(r: dict) -> None:
    assert r["gpu_tokens"] + r["offload_hit_tokens"] + r["recomputed_tokens"] == r[
        "prompt_tokens"] > 0
    assert r["unaccounted_tokens"] == 0 and r["failed_loads"] == 0


def test_trace_suite_accounting_and_ceiling() -> None:
    from kvoffload.bench.suites.trace import run_trace_bench

    r = run_trace_bench(True, n_windows=2, window=24, gpu_blocks=176,
                        routings=("round_robin", "kv_aware_cpu"), configs=("chunk-lru",))
    assert r["host_blocks_total"] == 4 * 4 * 176 and r["headline_routing"] == "kv_aware_cpu"
    assert len(r["windows"]) == 2 and r["seeds"]["n"] <= 2
    for row in r["windows"]:
        for routing in ("round_robin", "kv_aware_cpu"):
            cell = row[routing]
            ours, theirs = cell["ours"], cell["vllm"]["chunk-lru"]
            for v in (ours, theirs):
                _accounted(v)
                # Nothing serves more than an unbounded cache shared by every engine.
                assert v["gpu_tokens"] + v["offload_hit_tokens"] <= row["ceiling_tokens"]
            assert ours["prompt_tokens"] == theirs["prompt_tokens"] == row["prompt_tokens"]
            assert ours["verify_failures"] == 0 and ours["deferrals"] >= 0
            assert ours["daemon_rss_anon"]["samples"] >= 1
        rr = row["round_robin"]
        # Round-robin ignores the caches: both variants see the same engine per request.
        assert rr["ours"]["requests_per_engine"] == rr["vllm"]["chunk-lru"][
            "requests_per_engine"] == [6, 6, 6, 6]
    # This trace's windows reuse across engines: the shared pool serves something.
    assert any(row["round_robin"]["ours"]["offload_hit_tokens"] for row in r["windows"])
    assert r["meets"] is (r["ratio"] is not None and r["ratio"] >= 1.2)


def test_trace_replay_counts_wrong_bytes() -> None:
    """The pool scribbled after the first half: loads of what was stored before it fail their
    byte check (blocks stored after it are intact again, so not every later load fails)."""
    from kvoffload.bench.suites.trace import generated_trace, run_ours
    from kvoffload.bench.trace_replay import Scale

    window = generated_trace()[:30]

    def scribble(replay: object, i: int, control: str) -> None:
        if i == 15:
            reg = replay.engines[0].connector.connector_scheduler.manager.session.reg  # type: ignore[attr-defined]
            with open(reg.pool_path, "r+b") as f:
                f.write(b"\x01" * os.path.getsize(reg.pool_path))

    clean = run_ours(window, "round_robin", 4, 176, 2816, Scale())
    dirty = run_ours(window, "round_robin", 4, 176, 2816, Scale(), before=scribble)
    later = [s for s in dirty["served"] if s.index >= 15 and s.offload]
    assert clean["verify_failures"] == 0 and clean["loads"] > 0
    assert later and 0 < dirty["verify_failures"] <= len(later)


def test_restart_keeps_the_shared_pool_and_empties_vllms() -> None:
    from kvoffload.bench.suites.restart import RESTARTED, run_restart_bench

    r = run_restart_bench(True, before=20, after_s=15.0, n_windows=1, gpu_blocks=176,
                          configs=("chunk-lru",), controls=True)
    row = r["windows"][0]
    ours, theirs = row["ours"], row["chunk-lru"]
    assert row["requests_after"] > 0 and ours["run"]["verify_failures"] == 0
    for v in (ours, theirs):
        _accounted(v["run"])
        assert v["restarted_engine"]["requests"] > 0
    # vLLM's restarted engine starts with an empty CPU cache: it can only hit what it stored
    # after the restart; ours finds what every engine stored before it too.
    assert ours["restarted_engine"]["offload_hit_tokens"] > theirs["restarted_engine"][
        "offload_hit_tokens"]
    assert ours["run"]["requests_per_engine"][RESTARTED] > 0
    assert "lost_to_restart" in ours and "no_restart" in theirs


def test_sharing_routings_at_equal_blocks() -> None:
    """Sticky routing with room for everything: per-engine offload serves exactly what the
    shared pool does (nothing crosses engines); round-robin: only the shared pool can serve."""
    from kvoffload.bench.suites.sharing import run_sharing_bench

    r = run_sharing_bench(True, conversations=4, turns=3, slots=400, engines=(2,), tp=False,
                          configs=("chunk-lru", "request-lru"))
    assert r["host_blocks_total"] == 400
    sticky, rr, kv = r["sticky_2"], r["engines_2"], r["kv_aware_2"]
    assert sticky["ours"]["offload_hit_tokens"] == sticky["vllm"]["offload_hit_tokens"]
    assert sticky["ratio"] == 1.0
    assert rr["ours"]["offload_hit_tokens"] > rr["vllm"]["offload_hit_tokens"]
    for cell in (sticky, rr, kv):
        assert cell["ours"]["verify_failures"] == 0
        assert cell["vllm"]["offload_hit_tokens"] == max(cell["vllm_offload_hit_tokens"].values())
    assert sticky["ours"]["requests_per_engine"] == [6, 6]
