"""Issue 26: a clean vLLM engine shutdown releases what the engine holds at once.

Through vLLM 0.33's core Scheduler and the connector's own ``shutdown()`` (both connectors):
an engine stopped while its stores are claimed (PENDING for every engine) is neither a client
nor a holder of pending stores for the daemon right after, long before any lease could run
out, and a new engine's request on the same keys computes, stores and then loads them (bytes
verified) instead of waiting on keys nobody will commit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvoffload.bench.suites.load import metric_sum, scrape_metrics
from kvoffload.connector.client import DaemonClient

from tests.daemon_helpers import DaemonHandle, run_daemon
from tests.plugin_common import plugin_config
from tests.vllm_harness import vllm_import_error

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]

LEASE_MS = 60_000  # far longer than the test: nothing it sees can be a lease running out
BLOCK = 16


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonHandle]:
    with run_daemon(tmp_path, "--lease-ms", str(LEASE_MS)) as d:
        yield d


def _engine(control: str, connector: str, real_worker: bool = True) -> Any:
    from tests.plugin_engine import MiniEngine

    module = "kvoffload.connector.vllm" if connector == "KVOffloadConnector" else None
    return MiniEngine(plugin_config(control, kvoffload_copy_async=False), connector=connector,
                      connector_module=module, real_worker=real_worker)


def _held(observer: DaemonClient) -> tuple[int, int]:
    stats = observer.stats()
    return stats["clients"], stats["pending"]


@pytest.mark.parametrize("connector", ["OffloadingConnector", "KVOffloadConnector"])
def test_shutdown_releases_claims_and_a_new_engine_does_not_wait(daemon: DaemonHandle,
                                                                 connector: str) -> None:
    from tests.plugin_engine import ROW, token_row

    observer = DaemonClient(daemon.control, timeout_ms=10_000, name="observer")
    alone = _held(observer)
    assert alone == (1, 0)
    # The old engine's worker never reports its store jobs done (no worker: a job completes
    # one step after it is submitted), so the step that claims its keys leaves them PENDING.
    old = _engine(daemon.control, connector, real_worker=False)
    prompt = list(range(7, 37))  # 30 tokens: chunk 0 of both groups, then the tail's block
    old.add(prompt, "first", max_tokens=4)
    for _ in range(10):
        old.step()
        # The daemon applies a step's claims a moment after the step: wait for them before
        # stepping on, or (on a loaded host) the next step completes the job and commits it.
        settle = time.monotonic() + 2
        while not (held := _held(observer))[1] and time.monotonic() < settle:
            time.sleep(0.01)
        clients, pending = held
        if pending:
            break
    assert clients == 2 and pending > 0, "the old engine never claimed a store"

    old.shutdown()  # vLLM's connector shutdown: the manager's session says Bye
    deadline = time.monotonic() + 10  # a bound on waiting, far below the 60 s lease
    while _held(observer) != alone:
        assert time.monotonic() < deadline, _held(observer)
        time.sleep(0.01)
    metrics = scrape_metrics(daemon.http_url)
    assert metric_sum(metrics, "kvoffload_stores_total", outcome="aborted") == pending
    assert metric_sum(metrics, "kvoffload_stores_total", outcome="expired") == 0

    # A new engine on the same keys: nothing is PENDING, so its first request computes the
    # prompt and stores it within a few steps (run() fails past 200), the next one loads.
    new = _engine(daemon.control, connector)
    new.add(prompt, "again", max_tokens=4)
    new.run()
    assert new.prefill_tokens["again"] == 30
    assert new.scheduler.reset_prefix_cache()
    new.scribble()  # only the pool can restore the prefix now
    seen: dict[str, list[bytes]] = {}

    def check(req_id: str) -> None:  # when the worker reports the load done
        attn = new.block_table(req_id)[0]
        seen[req_id] = [bytes(new.pages["attn.0"][attn[t // BLOCK], ROW * (t % BLOCK):
                                                  ROW * (t % BLOCK + 1)].numpy())
                        for t in range(28)]

    new.on_loaded = check
    new.add(prompt, "loaded", max_tokens=4)
    new.run()
    assert new.prefill_tokens["loaded"] == 2  # 28 loaded, 2 computed
    assert seen["loaded"] == [bytes(token_row(prompt, t).numpy()) for t in range(28)]
    new.shutdown()
    observer.close()
