"""An engine that freezes at the worst moment never writes or reads another writer's block.

Through vLLM 0.33's real Scheduler and worker connector with our ``KVOffloadConnector``
(MiniEngine) against a daemon process with a 300 ms lease. Engine A is frozen at a chosen point
of its worker's job -- a SIGSTOP or a stuck CUDA stream there -- and stops heartbeating, so its
lease runs out and the daemon revokes what it held. Another writer then fills the pool and
commits blocks with known bytes; then A goes on.

* Store held after the lock and the pre-check: the revoked slots must stay quarantined while A
  may still write them (the lock), or A's late copy overwrites the other writer's block.
* Store held before the lock: the slots are re-granted at once (no writer holds the lock), so
  A's pre-check must see their new generation and write nothing.
* Load held mid-copy: its pins were released with its lease and the other writer reused the
  slot; the post-copy check must fail the load (vLLM recomputes), or the model reads the other
  writer's bytes as this prompt's KV.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_helpers import run_daemon
from tests.plugin_common import (
    connect,
    flood,
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

SLOT = 4096
PROMPT = list(range(500, 530))


def _engine(control: str) -> Any:
    from kvoffload.bench.vllm_engine import MiniEngine

    return MiniEngine(plugin_config(control, kvoffload_copy_async=False,
                                    kvoffload_liveness_ms=60_000),
                      connector="KVOffloadConnector", connector_module="kvoffload.connector.vllm")


def _freeze(e: Any) -> None:
    session = e.connector.scheduler.manager.session
    session._stop.set()  # no heartbeat; its step thread is stuck in the held job
    session._kick.set()


@pytest.mark.parametrize("where", ["copy", "submit"])
def test_a_frozen_writers_late_store_never_overwrites_another_writers_block(
        tmp_path: Path, where: str) -> None:
    with run_daemon(tmp_path, "--lease-ms", "300", pool_bytes=32 * SLOT, slot_bytes=SLOT) as d:
        a = _engine(d.control)
        ours = a.worker._handover.worker
        entered, release = hold_first(ours, where)
        a.add(PROMPT, "a", max_tokens=2)
        runner = run_held(a, entered)
        _freeze(a)
        other = connect(d.control, a.connector.scheduler.manager.geometry)
        # Its lease runs out: its grants are revoked (and quarantined while it holds the lock).
        assert wait_until(lambda: other.stats()["clients"] == 1)
        with open(d.pool_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as pool:
            written = flood(other, pool, where, SLOT)
            assert written
            release.set()  # A goes on
            runner.join(30)
            assert not runner.is_alive()
            for slot, data in written.items():
                assert pool[slot * SLOT:(slot + 1) * SLOT] == data, f"slot {slot} overwritten"
        other.close()
        a.shutdown()


def test_a_load_whose_slot_went_to_another_writer_mid_copy_is_recomputed(
        tmp_path: Path) -> None:
    with run_daemon(tmp_path, "--lease-ms", "300", pool_bytes=32 * SLOT, slot_bytes=SLOT) as d:
        a = _engine(d.control)
        a.add(PROMPT, "first", max_tokens=2)
        a.run()
        assert a.scheduler.reset_prefix_cache()
        a.scribble()
        ours = a.worker._handover.worker
        entered, release = hold_first(ours, "load")
        seen: dict[str, bool] = {}

        def on_loaded(req_id: str) -> None:  # what the model reads once the load is done
            seen["correct"] = kv_matches(a, req_id, PROMPT)

        a.on_loaded = on_loaded
        a.add(PROMPT, "second", max_tokens=2)
        runner = run_held(a, entered)
        _freeze(a)
        other = connect(d.control, a.connector.scheduler.manager.geometry)
        assert wait_until(lambda: other.stats()["clients"] == 1)  # its pins went with its lease
        with open(d.pool_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as pool:
            assert flood(other, pool, "load", SLOT)  # evicts its blocks and reuses their slots
            release.set()
            runner.join(30)
            assert not runner.is_alive()
        # Either the copy failed its check and vLLM recomputed the prompt, or (had the slots
        # survived) it read the right bytes: never the other writer's as a hit.
        # The copy failed its check: vLLM was told, and recomputed the prompt; the model never
        # saw the other writer's bytes as this prompt's KV.
        assert seen.get("correct", True), "the model read another writer's bytes as this KV"
        assert a.failed_loads == {"second"} and a.prefill_tokens["second"] == 30
        other.close()
        a.shutdown()
