"""Start the real daemon as a process for tests: ``with run_daemon(tmp_path) as d: ...``.

The daemon writes a ready file (JSON with its control endpoint and HTTP URL) once it serves;
the fixture waits for that file, so no test guesses ports or sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DaemonHandle:
    def __init__(self, workdir: Path, args: tuple[str, ...], pool_bytes: int,
                 slot_bytes: int | None, env: dict[str, str] | None) -> None:
        self.workdir = workdir
        self.control = f"ipc://{workdir}/control.sock"
        self.pool_path = f"/dev/shm/kvoffload-test-{uuid.uuid4().hex[:12]}"
        self.ready_file = workdir / "ready.json"
        self.log_path = workdir / "daemon.log"
        self.args = args
        self.pool_bytes = pool_bytes
        self.slot_bytes = slot_bytes
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.http_url = ""

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "kvoffload", "serve", "--control", self.control,
               "--pool-path", self.pool_path, "--pool-bytes", str(self.pool_bytes),
               "--http", "127.0.0.1:0", "--ready-file", str(self.ready_file),
               "--log-level", "debug"]
        if self.slot_bytes:
            cmd += ["--slot-bytes", str(self.slot_bytes)]
        return cmd + list(self.args)

    def start(self, timeout: float = 30.0) -> None:
        self.ready_file.unlink(missing_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child process
        env = {**os.environ, **(self.env or {})}
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=log, env=env)
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon not ready in {timeout}s:\n{self.log()}")
            time.sleep(0.02)
        self.ready = json.loads(self.ready_file.read_text())
        self.http_url = self.ready["http"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as after a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.ready_file.unlink(missing_ok=True)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def restart(self) -> None:
        self.kill()
        self.start()

    def cleanup(self) -> None:
        self.kill()
        # A killed daemon leaves its pool and its shared index (and readers file) behind.
        sessions = Path(self.pool_path).parent.glob(Path(self.pool_path).name + ".index.s-*")
        for path in (self.pool_path, f"{self.pool_path}.index", f"{self.pool_path}.index.readers",
                     *map(str, sessions)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@contextlib.contextmanager
def run_daemon(tmp_path: Path, *extra_args: str, pool_bytes: int = 64 << 20,
               slot_bytes: int | None = None,
               env: dict[str, str] | None = None) -> Iterator[DaemonHandle]:
    """A started daemon process, killed and its pool file removed afterwards."""
    # ipc paths must stay under ~100 characters: a short private dir, not pytest's tmp_path.
    workdir = Path(tempfile.mkdtemp(prefix="kvo-"))
    handle = DaemonHandle(workdir, extra_args, pool_bytes, slot_bytes, env)
    handle.start()
    try:
        yield handle
    finally:
        handle.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def server_in_thread(config: Any) -> Iterator[tuple[Any, Any]]:
    """The daemon's ``Server`` on its own event loop in a thread of this process, for tests that
    reach into it (its sockets, sweeper, tiers): yields ``(server, loop)``; stopped on exit."""
    import asyncio
    import threading

    from kvoffload.daemon.server import Server

    server = Server(config)
    loop = asyncio.new_event_loop()
    started = threading.Event()

    async def main() -> None:
        await server.start()
        started.set()
        await server.wait_stopped()
        await server.shutdown()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    try:
        assert started.wait(30), "the daemon did not start"
        yield server, loop
    finally:
        loop.call_soon_threadsafe(server.request_stop)
        thread.join(30)
