"""Run the real ``kvoffload`` CLI as a user would and check how it fails: one line on stderr
that names the setting, the cause and the fix; a non-zero exit (never a signal); no
traceback; nothing left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> \
        subprocess.CompletedProcess[str]:
    # The daemon's settings stay out (each test names its own); a mutant run's scratch copy
    # (scripts/mutants.py) stays in, or the CLI would run the unmutated checkout.
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("KVOFFLOAD_") or k == "KVOFFLOAD_MUTANT_ROOT"}
    return subprocess.run([sys.executable, "-m", "kvoffload", *args], capture_output=True,
                          text=True, timeout=timeout, env={**clean, **(env or {})})


def one_line(proc: subprocess.CompletedProcess[str], rc: int, *needles: str) -> str:
    """The single stderr line of a failed command; checks its exit code and contents."""
    assert proc.returncode == rc, (proc.returncode, proc.stderr)  # < 0 would be a signal
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def pool_path() -> str:
    return f"/dev/shm/kvoffload-test-{uuid.uuid4().hex[:12]}"


def serve_args(workdir: Path, pool: str, *extra: str, pool_bytes: str = "8MiB") -> list[str]:
    return ["serve", "--control", f"ipc://{workdir}/control.sock", "--http", "127.0.0.1:0",
            "--pool-path", pool, "--pool-bytes", pool_bytes, *extra]
