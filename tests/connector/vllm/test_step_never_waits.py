"""The scheduler's step never waits on the daemon: frozen, gone, or restarting.

Through vLLM 0.33's real Scheduler with our plugin. Every call that can block on a socket
(``zmq.Socket.poll``, ``DaemonClient.call``, joining the session's threads) is recorded with its
thread and its timeout; on the engine's own thread none may wait longer than ``sync_ms`` (1 ms)
while the daemon is SIGSTOPped, killed, or restarted -- registering, mapping the index, the
rescan and the first reservation run on the session's attach thread.
"""

from __future__ import annotations

import os
import signal
import threading
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
    with run_daemon(tmp_path, pool_bytes=64 * 4096, slot_bytes=4096) as d:
        yield d


class Waits:
    """Blocking socket calls made on one thread: (what, timeout in ms)."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread
        self.seen: list[tuple[str, float]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import zmq
        from kvoffload.connector.client import DaemonClient

        poll, call, join = zmq.Socket.poll, DaemonClient.call, threading.Thread.join

        def rec_poll(sock: Any, timeout: int | None = None, flags: int = zmq.POLLIN) -> int:
            if threading.current_thread() is self.thread:
                self.seen.append(("poll", float("inf") if timeout is None else timeout))
            return int(poll(sock, timeout, flags))

        def rec_call(client: Any, msg: Any, timeout_ms: int | None = None) -> Any:
            if threading.current_thread() is self.thread:
                self.seen.append(("call", timeout_ms or client.timeout_ms))
            return call(client, msg, timeout_ms)

        def rec_join(thread: threading.Thread, timeout: float | None = None) -> None:
            # The session's own threads (attach, heartbeat): the worker joining its local
            # copy threads when its pool changes waits on copies, not on the daemon.
            if threading.current_thread() is self.thread and thread.name in (
                    "kvoffload-attach", "kvoffload-heartbeat"):
                self.seen.append(("join", float("inf") if timeout is None else timeout * 1000))
            join(thread, timeout)

        monkeypatch.setattr(threading.Thread, "join", rec_join)
        monkeypatch.setattr(zmq.Socket, "poll", rec_poll)
        monkeypatch.setattr(DaemonClient, "call", rec_call)

    def longest(self) -> float:
        return max((t for _, t in self.seen), default=0.0)


def test_no_step_waits_while_the_daemon_is_frozen_gone_or_restarting(
        daemon: DaemonHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvoffload.bench.vllm_engine import MiniEngine

    e = MiniEngine(plugin_config(daemon.control, kvoffload_copy_async=False, kvoffload_sync_ms=1,
                                 kvoffload_liveness_ms=200, kvoffload_retry_ms=50,
                                 kvoffload_timeout_ms=300),
                   connector="KVOffloadConnector", connector_module="kvoffload.connector.vllm")
    manager = e.connector.scheduler.manager
    assert manager.session.attached  # attached at start (allowed to wait: not serving yet)
    waits = Waits(threading.current_thread())
    waits.install(monkeypatch)

    def serve(req: str) -> int:
        e.add(list(range(700, 730)), req, max_tokens=2)
        e.run()
        return int(e.prefill_tokens[req])

    assert serve("warm") == 30
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)  # frozen: its heartbeat goes stale
    try:
        time.sleep(0.3)
        serve("frozen")
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    daemon.kill()  # gone
    serve("gone")
    daemon.start()  # back, on the same endpoint: the engine re-attaches by itself
    deadline = time.monotonic() + 30
    steps = 0
    while not manager.session.attached and time.monotonic() < deadline:
        e.step()
        steps += 1
        time.sleep(0.01)
    assert manager.session.attached and manager.session.counters["attaches"] >= 2
    serve("back")
    assert steps > 0 and manager.session.counters["offline_events"] >= 1
    # Nothing on the engine's thread waited longer than sync_ms for the daemon.
    assert waits.seen and waits.longest() <= 1, waits.seen
    e.shutdown()
