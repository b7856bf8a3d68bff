"""Files next to the pool, against real daemon processes (issue 23 item 5, issue 26): a file the
daemon did not create at ``<pool>.index`` or the pool path stops the start in one line and is
left as it was, with nothing half-started behind; a pool file of ours that someone could hold
open is not reused; /readyz says not ready, and why, when engines cannot attach.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, make_key
from kvoffload.daemon.control import protocol as p

from tests.daemon_helpers import DaemonHandle, run_daemon
from tests.mistake_helpers import cli, one_line, serve_args

SLOT = 4096
GEOM = Geometry(namespace="files", groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16, SLOT),),
                tokens_per_hash=16)


def readyz(d: DaemonHandle) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{d.http_url}/readyz", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("kind", ["unmarked", "symlink"])
def test_a_planted_index_file_stops_the_start_and_is_left_alone(workdir: Path, pool: str,
                                                                kind: str) -> None:
    index = Path(f"{pool}.index")
    target = workdir / "target"
    target.write_bytes(b"precious")
    if kind == "symlink":
        index.symlink_to(target)
    else:
        index.write_bytes(b"someone else's file")
    proc = cli(*serve_args(workdir, pool))
    one_line(proc, 1, f"pool_path {index}", "symlink" if kind == "symlink" else
             "not created by a kvoffload daemon")
    assert target.read_bytes() == b"precious"
    if kind == "unmarked":
        assert index.read_bytes() == b"someone else's file"
    assert not os.path.exists(pool)  # the pool this start created is gone again
    assert sorted(x.name for x in workdir.iterdir()) == ["target"]  # and its control lock


def test_a_pool_file_with_another_name_is_refused(tmp_path: Path, workdir: Path) -> None:
    with run_daemon(tmp_path) as d:
        d.kill()
        other = f"{d.pool_path}-second-name"  # the same filesystem: a hard link
        os.link(d.pool_path, other)
        try:
            proc = cli(*serve_args(workdir, d.pool_path))
            one_line(proc, 1, f"pool_path {d.pool_path}", "2 hard links")
            assert os.stat(d.pool_path).st_nlink == 2
        finally:
            os.unlink(other)


def test_a_pool_file_someone_could_hold_open_is_not_reused(tmp_path: Path) -> None:
    """Issue 26: a pool file of ours whose mode was widened may be open elsewhere; narrowing
    the mode would leave that descriptor reading every block stored from then on."""
    with run_daemon(tmp_path, slot_bytes=SLOT) as d:
        d.kill()  # the pool file stays
        os.chmod(d.pool_path, 0o666)
        spy = os.open(d.pool_path, os.O_RDONLY)  # another user's descriptor, opened now
        try:
            d.start()
            st = os.stat(d.pool_path)
            assert st.st_ino != os.fstat(spy).st_ino and st.st_mode & 0o777 == 0o600
            assert "may hold it open" in d.log()
            c = DaemonClient(d.control, timeout_ms=5000)
            c.register(GEOM)
            key = make_key(b"s" * 32, 0)
            grant = c.prepare_store([p.StoreItem(key=key, end_token=16)])
            slot = grant.slots[0]
            data = np.full(SLOT, 0x5A, dtype=np.uint8).tobytes()
            with open(d.pool_path, "r+b") as f:
                f.seek(slot * SLOT)
                f.write(data)
            assert c.commit_store([key]) == 1
            c.close()
            assert os.pread(spy, SLOT, slot * SLOT) != data  # the spy sees none of it
        finally:
            os.close(spy)


def test_readyz_is_not_ready_when_the_index_is_gone(tmp_path: Path) -> None:
    with run_daemon(tmp_path, slot_bytes=SLOT) as d:  # the index is made at start
        status, body = readyz(d)
        assert status == 200 and body["checks"]["engines_can_attach"] is True
        os.unlink(f"{d.pool_path}.index")  # /dev/shm cleaned under the daemon
        status, body = readyz(d)
        assert status == 503 and body["checks"]["engines_can_attach"] is False
        assert "does not exist" in body["reasons"]["engines_can_attach"]


def test_readyz_is_not_ready_when_the_index_cannot_be_created(tmp_path: Path) -> None:
    with run_daemon(tmp_path) as d:  # the index is made when the first engine registers
        assert readyz(d)[0] == 200
        os.mkdir(f"{d.pool_path}.index")  # something takes its path meanwhile
        try:
            c = DaemonClient(d.control, timeout_ms=5000)
            with contextlib.suppress(p.ProtocolError):
                c.register(GEOM)
            c.close()
            status, body = readyz(d)
            assert status == 503 and body["checks"]["engines_can_attach"] is False
            assert "not a regular file" in body["reasons"]["engines_can_attach"]
        finally:
            os.rmdir(f"{d.pool_path}.index")


def test_readyz_is_not_ready_when_the_pool_file_is_replaced(tmp_path: Path) -> None:
    with run_daemon(tmp_path) as d:
        os.unlink(d.pool_path)
        Path(d.pool_path).write_bytes(b"x")  # engines would map this, not the daemon's pool
        status, body = readyz(d)
        assert status == 503 and "removed or replaced" in body["reasons"]["engines_can_attach"]
