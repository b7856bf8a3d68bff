"""No request waits long on another engine's unfinished store: it computes instead.

Through vLLM 0.33's real Scheduler and worker connector (two MiniEngines, one daemon process).
Engine A claims a prompt's blocks and its worker is held mid-store (a stuck copy; A's session
stays alive and heartbeats, so the daemon keeps A's claims PENDING for as long as A lives).
Engine B gets the same prompt: its lookups see the keys PENDING and vLLM defers the request --
for ``kvoffload_pending_wait_ms`` at most; then B computes the prompt itself, bytes checked,
while A is still held (its fake model writes the prompt's own rows). Without the bound B's request never runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_helpers import run_daemon
from tests.plugin_common import hold_first, plugin_config, run_held
from tests.vllm_harness import vllm_import_error

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]

PROMPT = list(range(700, 730))


def _engine(control: str, **extra: Any) -> Any:
    from kvoffload.bench.vllm_engine import MiniEngine

    return MiniEngine(plugin_config(control, kvoffload_copy_async=False, **extra),
                      connector="KVOffloadConnector", connector_module="kvoffload.connector.vllm")


def _pending_in_view(e: Any) -> int:
    view = e.connector.scheduler.manager.session.view
    return len(view.pending) if view is not None else 0


def test_a_request_waits_a_bounded_time_on_another_engines_pending_store(
        tmp_path: Path) -> None:
    with run_daemon(tmp_path) as d:
        a = _engine(d.control)
        entered, release = hold_first(a.worker._handover.worker, "copy")
        a.add(PROMPT, "a", max_tokens=2)
        runner = run_held(a, entered)  # A's claims are in the index, its copy never ends
        try:
            b = _engine(d.control, kvoffload_pending_wait_ms=50)
            manager = b.connector.scheduler.manager
            b.add(PROMPT, "b", max_tokens=2)
            deadline = time.monotonic() + 15  # a liveness deadline, not a timing claim
            while b.busy() and time.monotonic() < deadline:
                b.step()
                time.sleep(0.002)
            assert not b.busy(), "B's request waited on A's unfinished store and never ran"
            assert entered.is_set() and not release.is_set() and runner.is_alive()
            assert manager.counters["waits_given_up"] > 0
            assert b.prefill_tokens["b"] == len(PROMPT)  # B computed the whole prompt itself
            assert _pending_in_view(b) > 0  # A's keys are still PENDING: B did not wait for them
        finally:
            release.set()
            runner.join(30)
        assert not runner.is_alive()
        b.shutdown()
        a.shutdown()
