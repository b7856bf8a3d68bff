"""The store pre-check: a worker that opened its session's lock file before the daemon revoked
the session, and takes the lock only after the daemon's test found no writer, must read the
new generation and write nothing into slots already re-granted to another writer.

Through vLLM 0.33's real Scheduler and worker connector (MiniEngine) against a daemon process
with a 300 ms lease. Engine A's first store is held between the worker's ``open`` of the lock
file and its ``flock`` (the narrow window the generation check closes: the lock alone cannot,
since the daemon's ``LOCK_EX`` test saw no holder). A stops heartbeating, its lease runs out,
the daemon revokes its grants (a new generation), unlinks the file, finds no writer and hands
the slots to another writer, which fills the pool with known bytes; then A goes on.
"""

from __future__ import annotations

import fcntl
import mmap
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_helpers import run_daemon
from tests.plugin_common import connect, flood, plugin_config, wait_until
from tests.vllm_harness import vllm_import_error

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]

SLOT = 4096
PROMPT = list(range(500, 530))


class _FlockHeldOnce:
    """``fcntl`` for the worker's writer lock: the first shared lock waits for ``release``
    (the file is open already), every other call is the real one."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(fcntl, name)

    def flock(self, fd: int, op: int) -> None:
        if op & fcntl.LOCK_SH and not self.entered.is_set():
            self.entered.set()
            self.release.wait(30)
        fcntl.flock(fd, op)


def test_a_store_locked_after_its_grants_were_re_granted_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvoffload.bench.vllm_engine import MiniEngine
    from kvoffload.connector import writer_lock

    held = _FlockHeldOnce()
    monkeypatch.setattr(writer_lock, "fcntl", held)
    with run_daemon(tmp_path, "--lease-ms", "300", pool_bytes=32 * SLOT, slot_bytes=SLOT) as d:
        a = MiniEngine(plugin_config(d.control, kvoffload_copy_async=False,
                                     kvoffload_liveness_ms=60_000),
                       connector="KVOffloadConnector",
                       connector_module="kvoffload.connector.vllm")
        worker = a.worker._handover.worker
        slots: list[int] = []
        submit_store = worker.submit_store

        def recording(job_id: int, src: Any, dst: Any) -> bool:
            if not slots:  # the first (held) job's slots
                slots.extend(dst.slots)
            return bool(submit_store(job_id, src, dst))

        worker.submit_store = recording
        a.add(PROMPT, "a", max_tokens=2)
        runner = threading.Thread(target=a.run, daemon=True)
        runner.start()
        assert held.entered.wait(30), "the held store was never reached"
        session = a.connector.scheduler.manager.session
        session._stop.set()  # no heartbeat: its lease runs out; its step thread is held
        session._kick.set()
        other = connect(d.control, a.connector.scheduler.manager.geometry)
        assert wait_until(lambda: other.stats()["clients"] == 1)  # A's session is gone
        with open(d.pool_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as pool:
            written = flood(other, pool, "precheck", SLOT)
            # The held job's slots went to the other writer: the check below means something.
            assert slots and set(slots) <= set(written), (slots, sorted(written))
            held.release.set()  # A takes its lock now, after the daemon's test
            runner.join(30)
            assert not runner.is_alive()
            for slot, data in written.items():
                assert pool[slot * SLOT:(slot + 1) * SLOT] == data, f"slot {slot} overwritten"
        other.close()
        a.shutdown()
