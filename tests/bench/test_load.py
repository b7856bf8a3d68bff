"""Short load run (the CI version of ``kvoffload bench load``: 64 clients x 60 s there).

16 concurrent clients issue lookups (pinned), stores and loads for 5 s against a real daemon
whose pool is small enough to evict all the time: zero errors, every client made progress,
and the daemon's anonymous RSS is flat over the second half of the run.
"""

from __future__ import annotations

from kvoffload.bench.suites.load import RSS_GROWTH_TARGET, run_load


def test_sixteen_clients_no_errors_no_starvation_flat_memory() -> None:
    out = run_load(clients=16, seconds=5.0)
    assert out["errors"] == 0, out["error_samples"]
    assert out["daemon_protocol_errors"] == 0
    assert out["daemon_alive"]
    assert out["ops_min_client"] > 0  # nobody starved
    assert out["daemon_evictions"] > 0  # the run exercised eviction, not just an empty pool
    assert set(out["latency"]) == {"lookup", "prepare_store", "commit_store", "pin_load",
                                   "complete_load"}
    assert all(v["p99_ms"] >= v["p50_ms"] > 0 for v in out["latency"].values())
    assert out["rss_samples"] >= 10
    assert out["rss_growth"] < RSS_GROWTH_TARGET, out




def test_load_verdict_names_what_missed() -> None:
    from kvoffload.bench.suites.load import load_verdict

    ok = {"errors": 0, "daemon_protocol_errors": 0.0, "ops_min_client": 12, "rss_growth": 0.02,
          "daemon_alive": True}
    assert load_verdict(ok) == (True, "all sub-targets met")
    meets, reason = load_verdict({**ok, "errors": 3, "rss_growth": 0.125})
    assert not meets
    assert reason == ("3 client errors (target 0); daemon RSS grew 12.5 % after warm-up "
                      "(target < 10 %)")
    assert load_verdict({**ok, "ops_min_client": 0, "daemon_alive": False})[1] == (
        "a client made no progress (slowest client: 0 ops); the daemon exited during the run")
