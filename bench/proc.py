"""A ``kvoffload serve`` subprocess for benchmarks that measure the daemon from outside."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def daemon_process(*args: str, pool_bytes: int = 64 << 20, slot_bytes: int = 1024,
                   env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen[bytes],
                                                                         dict[str, Any]]]:
    """A ``kvoffload serve`` subprocess on a private ipc endpoint; yields (proc, ready info)."""
    with tempfile.TemporaryDirectory(prefix="kvo-bench-") as tmp:
        ready = Path(tmp) / "ready.json"
        pool_path = f"/dev/shm/kvoffload-bench-{os.getpid()}-{random.getrandbits(32):08x}"
        cmd = [sys.executable, "-m", "kvoffload", "serve", "--control",
               f"ipc://{tmp}/control.sock", "--http", "127.0.0.1:0", "--pool-path", pool_path,
               "--pool-bytes", str(pool_bytes), "--slot-bytes", str(slot_bytes),
               "--log-level", "warning", "--ready-file", str(ready), *args]
        log = open(Path(tmp) / "daemon.log", "wb")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env={**os.environ, **(env or {})})
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("daemon did not start: "
                                       f"{(Path(tmp) / 'daemon.log').read_text()[-2000:]}")
                time.sleep(0.02)
            yield proc, {"pool_path": pool_path, **json.loads(ready.read_text())}
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            with contextlib.suppress(FileNotFoundError):  # a killed daemon leaves its pool
                os.unlink(pool_path)
