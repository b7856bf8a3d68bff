"""Issue 26: a fresh engine on a big pool stores its first request and loads the second.

Against a daemon with ``--pool-bytes 4GiB`` and no ``--slot-bytes``, the first engine's
Register sizes the slots and builds the index (1,048,576 slots of 4 KiB): it used to outlast
the engine's 500 ms timeout, and the engine ran offline for its first requests, silently.
Through vLLM 0.33's core Scheduler with our connector: the first request of a fresh engine
stores its chunk and tail, the second loads 28 tokens, bytes verified (as with 1 GiB).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from kvoffload.bench.suites.load import metric_sum, scrape_metrics
from kvoffload.connector.client import DaemonClient

from tests.daemon_helpers import run_daemon
from tests.vllm_harness import vllm_import_error

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]

POOL = 4 << 30
ROW = 256  # attention bytes per token: 16-token blocks of 4 KiB, a slot each: 1M slots


def _shm_free() -> int:
    vfs = os.statvfs("/dev/shm")
    return vfs.f_bavail * vfs.f_frsize


@pytest.mark.parametrize("connector", ["OffloadingConnector", "KVOffloadConnector"])
def test_a_fresh_engine_on_a_4gib_pool_stores_at_once_and_then_loads(tmp_path: Path,
                                                                      connector: str) -> None:
    if _shm_free() < POOL + (1 << 30):  # the pool, its index, and room for everyone else
        pytest.skip(f"/dev/shm has {_shm_free() >> 20} MiB free; this test needs "
                    f"{(POOL >> 20) + 1024} MiB")
    from kvoffload.bench.vllm_engine import MiniEngine, Shape

    from tests.plugin_common import plugin_config

    with run_daemon(tmp_path, pool_bytes=POOL) as d:  # the first engine sizes the slots
        started = time.monotonic()
        module = "kvoffload.connector.vllm" if connector == "KVOffloadConnector" else None
        # The engine's default kvoffload_timeout_ms (500), which the first Register outlasted.
        config = plugin_config(d.control, kvoffload_copy_async=False, kvoffload_timeout_ms=500)
        e = MiniEngine(config, connector=connector, connector_module=module,
                       shape=Shape(row=ROW))
        attached_s = time.monotonic() - started  # the engine waits for its attach at start
        observer = DaemonClient(d.control, timeout_ms=30_000)
        stats = observer.stats()
        assert stats["num_slots"] == POOL // (16 * ROW) == 1 << 20
        prompt = list(range(7, 37))  # 30 tokens
        manager = e.connector.scheduler.manager
        e.add(prompt, "first", max_tokens=4)
        e.run()
        assert e.prefill_tokens["first"] == 30
        # Chunk 0 of both groups, the attention block at 28 and the core's CoW Mamba snapshot.
        assert manager.counters["stores_offered"] == 4
        assert manager.counters.get("stores_skipped_offline", 0) == 0
        assert e.scheduler.reset_prefix_cache()
        e.scribble()  # every KV byte overwritten: only a load can restore the prefix
        verified: dict[str, bool] = {}
        e.on_loaded = lambda req_id: verified.__setitem__(req_id, e.verify(req_id, prompt))
        e.add(prompt, "second", max_tokens=4)
        e.run()
        assert e.prefill_tokens["second"] == 2  # 28 tokens loaded
        assert verified == {"second": True}
        lag = scrape_metrics(d.http_url)
        slow_turns = metric_sum(lag, "kvoffload_event_loop_lag_seconds_count") - metric_sum(
            lag, "kvoffload_event_loop_lag_seconds_bucket", le="0.1")
        print(f"{connector}, 4 GiB pool, {stats['num_slots']} slots: engine built and "
              f"attached in {attached_s:.2f} s; "
              f"{slow_turns:.0f} loop turns over 100 ms")
        e.shutdown()
        observer.close()
