"""One engine that froze or lies in its reader record costs only itself.

A second "engine" attaches as the plugin does (``IndexSession``: heartbeating, so its lease
never runs out) and then marks its record busy at epoch 0 forever -- frozen mid-step, or lying.
Engine B, through vLLM 0.33's real Scheduler and worker connector, keeps storing new prompts
into a pool too small for them, so every store evicts a block that is retired, not freed,
while a reader may still see it. Past the hold bound (0.25 s) the stuck reader is passed
over: B's later prompts are stored and load back as hits, bytes checked. The pool grants B
earmarked blocks (``daemon/store/earmarks.py``), whose handover waits for the readers, so
B's first store waits in its worker (parked) until the stuck reader is passed over: B is
stepped as a real engine steps, a step a millisecond, until it is idle.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_helpers import DaemonHandle, run_daemon
from tests.plugin_common import plugin_config
from tests.vllm_harness import vllm_import_error

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonHandle]:
    with run_daemon(tmp_path, pool_bytes=16 * 4096, slot_bytes=4096) as d:
        yield d


def _run_idle(engine: Any, seconds: float = 10.0) -> None:
    """Step ``engine`` until it has nothing left (its stores copied), a millisecond a step."""
    deadline = time.monotonic() + seconds
    while engine.busy():
        assert time.monotonic() < deadline, "engine still busy"
        engine.step()
        time.sleep(0.001)


def test_a_reader_stuck_at_an_old_epoch_does_not_stop_another_engines_stores(
        daemon: DaemonHandle) -> None:
    from kvoffload.bench.vllm_engine import MiniEngine
    from kvoffload.connector.session import IndexSession

    b: Any = MiniEngine(plugin_config(daemon.control, kvoffload_copy_async=False,
                                      kvoffload_store_reserve=2),
                        connector="KVOffloadConnector",
                        connector_module="kvoffload.connector.vllm")
    manager = b.connector.scheduler.manager
    liar = IndexSession(daemon.control, manager.geometry, timeout_ms=2000, name="stuck")
    assert liar.start(10)
    assert liar._record is not None
    liar._record.write(True, 0, 0)  # busy at epoch 0, and it stays so (its heartbeat goes on)
    hits = []
    for i in range(8):  # 8 prompts of 2 keys each through a 16-slot pool: evictions retire
        prompt = list(range(1000 * (i + 1), 1000 * (i + 1) + 30))
        b.add(prompt, f"store-{i}", max_tokens=2)
        _run_idle(b)
        time.sleep(0.3)  # past the hold bound: the stuck reader is passed over from here on
        assert b.scheduler.reset_prefix_cache()
        b.scribble()
        b.add(prompt, f"load-{i}", max_tokens=2)
        b.run()
        hits.append(30 - b.prefill_tokens[f"load-{i}"])
    # Every prompt was stored and loaded back (28 of 30 tokens), the later ones too: the
    # retired slots of the earlier ones were reclaimed despite the stuck record.
    assert hits == [28] * 8, hits
    assert not b.failed_loads
    liar.close()
    b.shutdown()
