"""A daemon that reuses a pool file waits for the previous daemon's writers before granting.

kill -9 leaves the previous daemon's engines mapping the same pool file (kept with
``--state-dir``), and a worker of one of them may still be copying into a slot that daemon had
granted. The new daemon finds that engine's session file and hands out no slot that was not
committed until its writers' lock is free; then it removes the file.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from kvoffload.connector.session import IndexSession
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec

from tests.daemon_helpers import run_daemon

GEO = Geometry(namespace="restart-writers",
               groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16, 1024),), tokens_per_hash=16)
HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
time.sleep(600)
"""


def _granted(control: str) -> tuple[IndexSession, int]:
    s = IndexSession(control, GEO, timeout_ms=2000, reserve=4, name="restart-writers")
    assert s.start(10)
    replies = s.begin() or []
    s.end_idle()
    return s, sum(len(r.granted) for r in replies)


def test_no_slot_is_granted_while_a_previous_daemons_writer_may_copy(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with run_daemon(tmp_path, "--state-dir", str(state), pool_bytes=64 * 16384,
                    slot_bytes=16384) as d:
        old, n = _granted(d.control)
        assert n == 4 and old.reg is not None
        session_file = old.reg.readers_path
        holder = subprocess.Popen([sys.executable, "-c", HOLD, session_file],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            d.kill()  # kill -9: its session file stays, and so does the pool file
            d.start()  # same pool path and state dir: the pool is reused in place
            new, n = _granted(d.control)
            assert n == 0  # nothing granted: the old worker may still be copying
            assert Path(session_file).exists()
            holder.kill()
            holder.wait()
            deadline = time.monotonic() + 10
            while Path(session_file).exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # the sweeper removes it once its lock is free
            assert not Path(session_file).exists()
            again, n = _granted(d.control)
            assert n == 4  # grants resume
            for s in (old, new, again):
                s.close()
        finally:
            holder.kill()
            holder.wait()
