"""The engine's index session (connector/session.py) against a daemon process: what its
reader record says, read the way the daemon reads it (``SessionFile.read``), because the
daemon frees retired slots by it (``daemon/store/reclaim.py``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvoffload.connector.client import DaemonClient
from kvoffload.connector.session import IndexSession
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, make_key
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.store.session_file import SessionFile

from tests.daemon_helpers import run_daemon

SLOT = 4096
GEOMETRY = Geometry(namespace="session", groups=(
    GroupSpec(kind=GroupKind.FULL_ATTENTION, tokens_per_block=16, bytes_per_block=SLOT),),
    tokens_per_hash=16)


def _read(record: SessionFile) -> tuple[int, int, int]:
    got = record.read()
    assert got is not None  # only a record mid-write reads None, and nobody writes it now
    return got


def test_a_step_is_busy_in_the_reader_record_at_the_epoch_it_read_until_its_step_goes(
        tmp_path: Path) -> None:
    """Busy while the step decides from the index (what it answered HIT may be loaded), at
    the epoch it read; idle once its Step is sent. A record left idle mid-step would let the
    daemon free and re-grant a slot this step is about to load."""
    with run_daemon(tmp_path, pool_bytes=16 * SLOT, slot_bytes=SLOT) as d:
        engine = IndexSession(d.control, GEOMETRY, timeout_ms=2000, name="engine")
        other = DaemonClient(d.control, timeout_ms=5000, name="other engine")
        try:
            assert engine.start(10) and engine.reg is not None and engine.view is not None
            record = SessionFile(engine.reg.index_path, path=engine.reg.readers_path)
            other.register(GEOMETRY)
            keys = [make_key(hashlib.sha256(b"k%d" % i).digest(), 0) for i in range(3)]
            grant = other.prepare_store([p.StoreItem(key=k, end_token=16) for k in keys])
            assert grant.outcomes == [p.StoreOutcome.GRANTED] * 3
            assert other.commit_store(keys) == 3
            busy, epoch, _ = _read(record)
            assert busy == 0 and epoch < engine.view.head()  # idle, the commits not read yet

            assert engine.begin() is not None  # the step's first lookup
            view = engine.view
            assert all(view.ready.get(k) is not None for k in keys)  # it reads them READY
            busy, epoch, sent = _read(record)
            assert busy == 1 and epoch == view.applied

            def step(rid: int, eng: int, ep: int) -> p.Step:
                return p.Step(rid=rid, engine=eng, epoch=ep)

            # A message mid-step (a reservation top-up) leaves the step busy: its pins, sent
            # at its end, are still protected by the epoch it read.
            assert engine.send(step, end_of_step=False, sync=True) is not None
            busy, epoch, sent2 = _read(record)
            assert busy == 1 and epoch == view.applied and sent2 == sent + 1
            assert engine.send(step, end_of_step=True) is not None
            busy, epoch, sent3 = _read(record)
            assert busy == 0 and epoch == view.applied and sent3 == sent + 2
            record.close(remove=False)
        finally:
            other.close()
            engine.close()
