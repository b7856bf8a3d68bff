"""The control clients (connector/client.py) against a real daemon process: the identity an
engine registers with, kept across a daemon restart; endpoints checked when a client is made."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kvoffload.connector.client import (
    AsyncDaemonClient,
    BadEndpoint,
    DaemonClient,
    DaemonUnavailable,
    check_endpoint,
)
from kvoffload.daemon.control import protocol as p

from tests.daemon_helpers import run_daemon
from tests.events.test_profiles import GEOM

AUTO = "events=tcp://127.0.0.1:0,replay=tcp://127.0.0.1:0"


def _views_logged(log: str, rank: int, engine: str) -> int:
    return log.count(f"event view of DP rank {rank} (engine '{engine}')")


def _wait(cond: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(what)


def test_sync_client_registers_its_identity_and_keeps_it_across_a_restart(
        tmp_path: Path) -> None:
    """`register(..., instance=, data_parallel_rank=)` sends what the plugin sends; after a
    kill -9 and restart the client's re-register sends it again, so the new daemon opens the
    engine's view again."""
    with run_daemon(tmp_path, "--engine-views-auto", AUTO) as d:
        c = DaemonClient(d.control, timeout_ms=2000)
        try:
            reg = c.register(GEOM, instance="engine-x", data_parallel_rank=1)
            assert isinstance(reg, p.Registered)
            _wait(lambda: _views_logged(d.log(), 1, "engine-x") == 1, d.log())
            d.restart()
            for _ in range(100):
                try:
                    c.probe([])
                    break
                except DaemonUnavailable:
                    time.sleep(0.05)
            assert c.registered is not None and c.registered.daemon_id != reg.daemon_id
            _wait(lambda: _views_logged(d.log(), 1, "engine-x") == 2, d.log())
        finally:
            c.close()


@pytest.mark.parametrize("endpoint", ["/run/kvoffload/control.sock", "localhost:5555",
                                      "tcp://localhost", "tcp://:5555", "tcp://h:99999",
                                      "ipc://", "udp://x:1", ""])
def test_a_bad_endpoint_is_one_typed_line_when_a_client_is_made(endpoint: str) -> None:
    for make in (DaemonClient, AsyncDaemonClient):
        with pytest.raises(BadEndpoint) as exc:
            make(endpoint)
        text = str(exc.value)
        assert "\n" not in text and repr(endpoint) in text and "ipc://PATH" in text
        assert isinstance(exc.value, ValueError)  # callers that catch ValueError still do
    if endpoint.startswith("/"):
        assert f"ipc://{endpoint}" in text  # the fix, spelled out


@pytest.mark.parametrize("endpoint", ["ipc:///tmp/x.sock", "tcp://127.0.0.1:5555",
                                      "tcp://[::1]:5555", "tcp://node-7:1", "inproc://x"])
def test_good_endpoints_pass(endpoint: str) -> None:
    assert check_endpoint(endpoint) == endpoint
