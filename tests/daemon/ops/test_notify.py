"""systemd notify protocol: READY=1, WATCHDOG=1 and STOPPING=1 reach a fake NOTIFY_SOCKET."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvoffload.daemon.ops.notify import Notifier

from tests.daemon_helpers import run_daemon

Message = dict[str, str]


class FakeSystemd:
    """A bound AF_UNIX datagram socket, as systemd's notify socket; a thread collects messages.

    Reading continuously matters: a unix datagram queue holds only ~10 messages, and a
    watchdog pinging into a full queue would push STOPPING=1 out.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(0.1)
        self.messages: list[Message] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    @property
    def env_value(self) -> str:
        return "@" + self.address[1:] if self.address.startswith("\0") else self.address

    def _read(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if line)
            with self._cond:
                self.messages.append(fields)
                self._cond.notify_all()

    def wait_for(self, pred: Callable[[Message], bool], timeout: float = 30.0) -> int:
        """Index of the first message matching ``pred``; fails after ``timeout`` (a deadline)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i, m in enumerate(self.messages):
                    if pred(m):
                        return i
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no matching notification; got {self.messages}")
                self._cond.wait(left)

    def wait_count(self, key: str, n: int, timeout: float = 30.0) -> None:
        """Wait until ``n`` messages carry ``key``; fails after ``timeout`` (a deadline)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while sum(1 for m in self.messages if key in m) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"fewer than {n} {key}; got {self.messages}")
                self._cond.wait(left)

    def count(self, key: str) -> int:
        with self._cond:
            return sum(1 for m in self.messages if key in m)

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def fake_systemd() -> Iterator[FakeSystemd]:
    # A short private dir: AF_UNIX paths are limited to ~108 bytes, pytest's tmp_path is long.
    workdir = tempfile.mkdtemp(prefix="kvo-notify-")
    fake = FakeSystemd(os.path.join(workdir, "notify.sock"))
    try:
        yield fake
    finally:
        fake.close()
        shutil.rmtree(workdir, ignore_errors=True)


def test_without_notify_socket_everything_is_a_noop() -> None:
    n = Notifier.from_env({"WATCHDOG_USEC": "1000000"})
    assert not n.enabled
    assert n.watchdog_interval is None
    assert n.ready("serving") is False
    assert n.watchdog() is False
    assert n.stopping() is False
    assert not n.watchdog_running


def test_ready_carries_status_and_mainpid_then_stopping(fake_systemd: FakeSystemd) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": fake_systemd.env_value})
    assert n.enabled and n.watchdog_interval is None
    assert n.ready("serving ipc:///run/kvoffload/control.sock") is True
    assert n.status("still serving") is True
    assert n.stopping() is True
    i_ready = fake_systemd.wait_for(lambda m: m.get("READY") == "1")
    i_status = fake_systemd.wait_for(lambda m: m.get("STATUS") == "still serving")
    i_stop = fake_systemd.wait_for(lambda m: m.get("STOPPING") == "1")
    assert i_ready < i_status < i_stop
    ready = fake_systemd.messages[i_ready]
    assert ready["MAINPID"] == str(os.getpid())
    assert ready["STATUS"] == "serving ipc:///run/kvoffload/control.sock"
    assert fake_systemd.count("WATCHDOG") == 0  # no WATCHDOG_USEC: no pings


def test_abstract_namespace_socket() -> None:
    fake = FakeSystemd("\0kvoffload-test-" + uuid.uuid4().hex)
    try:
        assert fake.env_value.startswith("@")
        n = Notifier.from_env({"NOTIFY_SOCKET": fake.env_value})
        assert n.ready() is True
        fake.wait_for(lambda m: m.get("READY") == "1")
        n.close()
    finally:
        fake.close()


async def test_watchdog_pings_from_the_loop_until_stopping(fake_systemd: FakeSystemd) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": fake_systemd.env_value, "WATCHDOG_USEC": "40000"})
    assert n.watchdog_interval == pytest.approx(0.01)  # a quarter of WATCHDOG_USEC
    assert not n.watchdog_running  # systemd arms the watchdog at READY=1, so do we
    n.ready()
    assert n.watchdog_running
    await asyncio.to_thread(fake_systemd.wait_count, "WATCHDOG", 3)
    task = n._watchdog
    assert task is not None
    n.stopping()
    await asyncio.sleep(0)  # let the cancellation land
    assert task.done() and not n.watchdog_running
    i_stop = fake_systemd.wait_for(lambda m: m.get("STOPPING") == "1")
    assert fake_systemd.wait_for(lambda m: m.get("WATCHDOG") == "1") < i_stop


def test_watchdog_pid_and_usec_are_honoured(fake_systemd: FakeSystemd) -> None:
    base = {"NOTIFY_SOCKET": fake_systemd.env_value, "WATCHDOG_USEC": "30000000"}
    assert Notifier.from_env(base).watchdog_interval == pytest.approx(7.5)
    assert Notifier.from_env({**base, "WATCHDOG_PID": str(os.getpid())}).watchdog_interval
    # Meant for another process (we inherited the environment): stay quiet.
    assert Notifier.from_env({**base, "WATCHDOG_PID": "1"}).watchdog_interval is None
    assert Notifier.from_env({**base, "WATCHDOG_USEC": "soon"}).watchdog_interval is None
    assert Notifier.from_env({**base, "WATCHDOG_USEC": "0"}).watchdog_interval is None


def test_unusable_notify_socket_never_raises(tmp_path: Path) -> None:
    gone = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
    assert gone.enabled
    assert gone.ready() is False and gone.watchdog() is False and gone.stopping() is False
    relative = Notifier.from_env({"NOTIFY_SOCKET": "relative/notify.sock"})
    assert not relative.enabled and relative.ready() is False


def test_real_daemon_sends_ready_watchdog_and_stopping(tmp_path: Path,
                                                       fake_systemd: FakeSystemd) -> None:
    """Needs the wiring in Server.start() / shutdown() (see daemon/ops/notify.py's callers)."""
    env = {"NOTIFY_SOCKET": fake_systemd.env_value, "WATCHDOG_USEC": "200000",
           "WATCHDOG_PID": ""}  # never inherit a WATCHDOG_PID from whoever runs the tests
    with run_daemon(tmp_path, env=env) as d:
        assert d.proc is not None
        i_ready = fake_systemd.wait_for(lambda m: m.get("READY") == "1")
        assert fake_systemd.messages[i_ready]["MAINPID"] == str(d.proc.pid)
        i_ping = fake_systemd.wait_for(lambda m: m.get("WATCHDOG") == "1")
        assert fake_systemd.count("STOPPING") == 0  # still serving
        assert d.stop() == 0
        i_stop = fake_systemd.wait_for(lambda m: m.get("STOPPING") == "1")
        assert i_ready < i_ping < i_stop
