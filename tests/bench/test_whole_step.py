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


def test_an_unknown_geometry_is_refused() -> None:
    from kvoffload.bench.whole_step import geometry

    with pytest.raises(ValueError, match="'hybrid' or 'attention'"):
        geometry("mla")
