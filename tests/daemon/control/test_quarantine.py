"""Revoked grants: a new generation at once, and no second writer while the first may live.

Against a real daemon process with a 300 ms lease, engines attached as the vLLM plugin attaches
(``IndexSession``, its workers taking the session's writers' lock). A "worker" is another
process holding ``flock(LOCK_SH)`` on the session file, as ours does from its generation
pre-check to the end of its copy: frozen (SIGSTOP) it keeps the slots quarantined, killed
(SIGKILL) it releases them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvoffload.connector.index_view import SlotGenerations
from kvoffload.connector.session import IndexSession
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec

from tests.daemon_helpers import DaemonHandle, run_daemon
from tests.plugin_common import wait_until

GEO = Geometry(namespace="quarantine", groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16, 1024),),
               tokens_per_hash=16)
HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonHandle]:
    with run_daemon(tmp_path, "--lease-ms", "300", pool_bytes=64 * 16384,
                    slot_bytes=16384) as d:
        yield d


def _session(control: str, reserve: int = 8, retry_ms: int = 1000
             ) -> tuple[IndexSession, list[tuple[int, int]]]:
    s = IndexSession(control, GEO, timeout_ms=2000, reserve=reserve, name="quarantine-test",
                     retry_ms=retry_ms)
    assert s.start(10)
    replies = s.begin() or []
    s.end_idle()
    granted = [tuple(g) for r in replies for g in r.granted]
    assert len(granted) == reserve, replies
    return s, granted  # type: ignore[return-value]


def _freeze(s: IndexSession) -> None:
    """What SIGSTOP does to an engine: no heartbeat, no step (the socket stays open)."""
    s._stop.set()
    s._kick.set()
    s._heartbeat.join()


def _stats(d: DaemonHandle) -> dict[str, int]:
    from kvoffload.connector.client import DaemonClient

    c = DaemonClient(d.control, timeout_ms=2000)
    try:
        return c.stats()
    finally:
        c.close()


def test_an_idle_engine_keeps_its_grants(daemon: DaemonHandle) -> None:
    """vLLM does not step an idle engine: its heartbeat alone keeps its lease."""
    s, granted = _session(daemon.control)
    time.sleep(1.2)  # four leases without a single message
    assert _stats(daemon)["clients"] >= 2  # it is still a client (and so is the stats one)
    gens = SlotGenerations(s.reg.index_path, s.reg.daemon_id)  # type: ignore[union-attr]
    assert all(gens.intact(slot, gen, key_bound=False) for slot, gen in granted)
    gens.close()
    s.close()


def test_a_frozen_engines_grants_stay_quarantined_while_its_writer_lives(
        daemon: DaemonHandle) -> None:
    a, granted = _session(daemon.control)
    assert a.reg is not None
    gens = SlotGenerations(a.reg.index_path, a.reg.daemon_id)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, a.reg.readers_path],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGSTOP)  # the worker is frozen mid-copy
        _freeze(a)
        # Its lease runs out: every grant gets a new generation at once (a late commit or a
        # late pre-check of it fails) and is quarantined, not handed on.
        assert wait_until(lambda: _stats(daemon)["quarantined"] == len(granted))
        assert not any(gens.intact(slot, gen, key_bound=False) for slot, gen in granted)
        mine = {slot for slot, _ in granted}
        b, b_granted = _session(daemon.control, reserve=8)
        c, c_granted = _session(daemon.control, reserve=8)
        assert not mine & {slot for slot, _ in b_granted + c_granted}
        time.sleep(0.5)
        assert _stats(daemon)["quarantined"] == len(granted)  # a stopped writer still counts
        holder.kill()  # the kernel drops a dead process's lock: the slots come back
        holder.wait()
        assert wait_until(lambda: _stats(daemon)["quarantined"] == 0)
        b.close()
        c.close()
    finally:
        holder.kill()
        holder.wait()
        gens.close()
        a.close()


def test_a_re_attached_engine_releases_its_earlier_session_at_once(daemon: DaemonHandle) -> None:
    a, granted = _session(daemon.control, retry_ms=0)  # back before its old lease ends
    old = a.reg
    assert old is not None
    a._lost("test: the daemon looked slow")  # as after a liveness stall
    assert wait_until(lambda: a.settle(), 10)
    assert a.reg is not None and a.reg.readers_path != old.readers_path
    # The earlier session's grants were revoked when the new one registered, not a lease
    # later, and with no writer holding its lock they are free again already.
    gens = SlotGenerations(old.index_path, old.daemon_id)
    assert not any(gens.intact(slot, gen, key_bound=False) for slot, gen in granted)
    assert not Path(old.readers_path).exists()
    stats = _stats(daemon)
    assert stats["sessions_superseded"] == 1 and stats["quarantined"] == 0
    gens.close()
    a.close()


def test_a_clean_close_releases_everything_now(daemon: DaemonHandle) -> None:
    a, _ = _session(daemon.control)
    assert a.reg is not None
    path = a.reg.readers_path
    a.close()
    assert wait_until(lambda: _stats(daemon)["clients"] == 1)  # only the stats client: Bye arrived
    assert not Path(path).exists()


def test_a_stopped_daemon_leaves_no_session_file(tmp_path: Path) -> None:
    with run_daemon(tmp_path, pool_bytes=64 * 16384, slot_bytes=16384) as d:
        a, _ = _session(d.control)
        assert a.reg is not None
        path = Path(a.reg.readers_path)
        assert path.exists()
        assert d.stop() == 0  # SIGTERM: drain, then shut down with the engine still attached
        assert not path.exists()
        a.close()
