"""A routine restart (SIGTERM) that engines do not notice: loads in flight finish intact.

Through vLLM 0.33's real Scheduler and worker connector with our ``KVOffloadConnector``: a
load is held mid-copy while the daemon gets SIGTERM. The daemon drains -- new work answers
``shutting_down``, the engine's next ``Step`` still releases its pins -- and marks the index
superseded only once that load's pins are gone, so the load passes its post-copy check and the
model reads exactly the stored bytes; then the daemon exits 0.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_helpers import DaemonHandle, run_daemon
from tests.plugin_common import (
    connect,
    hold_first,
    kv_matches,
    plugin_config,
    run_held,
    wait_until,
)
from tests.vllm_harness import vllm_import_error

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]

PROMPT = list(range(900, 930))


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonHandle]:
    with run_daemon(tmp_path, "--drain-ms", "20000", pool_bytes=32 * 4096,
                    slot_bytes=4096) as d:
        yield d


def test_sigterm_with_a_load_in_flight_fails_no_load(daemon: DaemonHandle) -> None:
    from kvoffload.bench.vllm_engine import MiniEngine

    e = MiniEngine(plugin_config(daemon.control, kvoffload_copy_async=False,
                                 kvoffload_liveness_ms=60_000),
                   connector="KVOffloadConnector", connector_module="kvoffload.connector.vllm")
    e.add(PROMPT, "first", max_tokens=2)
    e.run()
    assert e.scheduler.reset_prefix_cache()
    e.scribble()
    entered, release = hold_first(e.worker._handover.worker, "load")
    seen: dict[str, bool] = {}

    def on_loaded(req_id: str) -> None:
        seen["correct"] = kv_matches(e, req_id, PROMPT)

    e.on_loaded = on_loaded
    e.add(PROMPT, "second", max_tokens=2)
    runner = run_held(e, entered)  # its copy has not run yet ...
    # ... and its pins are in: the Step that carries them went out without waiting, and on a
    # loaded host the daemon may not have read it yet when the signal comes.
    watcher = connect(daemon.control, e.connector.scheduler.manager.geometry)
    assert wait_until(lambda: watcher.stats()["pinned"] > 0)
    watcher.close()
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)
    # Draining: it does not stop while the pin is held (an engine's Step still gets through).
    assert not wait_until(lambda: daemon.proc.poll() is not None, 1.0)  # type: ignore[union-attr]
    release.set()
    runner.join(30)
    assert not runner.is_alive()
    assert seen.get("correct") is True  # loaded, checked intact, the stored bytes
    assert not e.failed_loads and e.prefill_tokens["second"] == 2
    e.step()  # the release of its pins goes out with the next step: the drain ends
    assert daemon.proc.wait(30) == 0
    # ... because the pins were released, not because drain_ms ran out.
    assert "drain ended" not in daemon.log(), daemon.log()[-2000:]
    e.shutdown()
