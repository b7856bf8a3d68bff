"""Start-up faults (issue 16 items 2 and 10, issue 14 items 4 and 5, issue 23 item 5),
against real daemon processes: the daemon's files and folders are its own; a refused start
leaves nothing behind; a bad state dir starts cold (or refuses) without a traceback; every
endpoint given is bound and reported; recovered state is in the first scrape after a warm
restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from kvoffload.bench.suites.load import metric_sum, scrape_metrics

from tests.daemon_helpers import run_daemon
from tests.mistake_helpers import cli, one_line, serve_args

OTHER_UID = 65534  # "nobody": a local user who is not the daemon's

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file that another user "
                                "owns needs root")


# -- the pool file -------------------------------------------------------------------------


@needs_root
def test_pool_file_another_user_created_is_refused(workdir: Path, pool: str) -> None:
    with open(pool, "wb") as f:
        f.write(b"planted by someone else")
    os.chown(pool, OTHER_UID, OTHER_UID)
    os.chmod(pool, 0o666)
    proc = cli(*serve_args(workdir, pool))
    one_line(proc, 1, f"pool_path {pool}", f"uid {OTHER_UID}", "remove it")
    st = os.stat(pool)  # left exactly as it was: not resized, not re-owned, not chmodded
    assert (st.st_uid, st.st_size, st.st_mode & 0o777) == (OTHER_UID, 23, 0o666)


def test_pool_path_that_is_a_symlink_is_refused(workdir: Path, pool: str) -> None:
    target = workdir / "target"
    target.write_bytes(b"x")
    os.symlink(target, pool)
    proc = cli(*serve_args(workdir, pool))
    one_line(proc, 1, f"pool_path {pool}", "symlink")
    assert target.read_bytes() == b"x"


def test_own_file_the_daemon_did_not_create_is_refused_not_adopted(workdir: Path,
                                                                    pool: str) -> None:
    """Issue 26: a file of this user at the pool path, open to others (0666) and perhaps held
    open by one of them, was kept with its mode narrowed: their descriptor still read every
    stored block. Now only a file a kvoffload daemon created (its mark) is used."""
    with open(pool, "wb") as f:
        f.write(b"not a pool")
    os.chmod(pool, 0o666)
    proc = cli(*serve_args(workdir, pool))
    one_line(proc, 1, f"pool_path {pool}", "not created by a kvoffload daemon", "remove it")
    st = os.stat(pool)
    assert (st.st_size, st.st_mode & 0o777) == (10, 0o666)  # left exactly as it was
    assert sorted(p.name for p in workdir.iterdir()) == []  # no control lock left either


def test_lock_holder_is_named(workdir: Path, pool: str) -> None:
    fd = os.open(pool, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # not a daemon: any local process
        proc = cli(*serve_args(workdir, pool))
        one_line(proc, 1, f"pool_path {pool} is locked by pid {os.getpid()}")
    finally:
        os.close(fd)


# -- a refused start leaves nothing behind -----------------------------------------------------


def test_refused_start_removes_the_control_folder_and_lock_it_created(workdir: Path,
                                                                      pool: str) -> None:
    with socket.socket() as taken:  # the HTTP port is in use: refused after lock and pool
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = cli("serve", "--control", f"ipc://{workdir}/run/kvo/control.sock", "--http",
                   f"127.0.0.1:{port}", "--pool-path", pool, "--pool-bytes", "8MiB")
    one_line(proc, 1, f"http 127.0.0.1:{port}", "in use")
    assert sorted(p.name for p in workdir.iterdir()) == []  # run/kvo/ and its .lock are gone
    assert not os.path.exists(pool)


def test_refused_start_keeps_what_was_there_before(workdir: Path, pool: str) -> None:
    """A state dir keeps the pool at stop, not a pool a refused start created; a control
    folder that existed stays (only its lock file, made by this start, goes)."""
    ctl = workdir / "ctl"
    ctl.mkdir(mode=0o700)
    (ctl / "keep").write_text("an operator's file")
    state = workdir / "state"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = cli("serve", "--control", f"ipc://{ctl}/control.sock", "--http",
                   f"127.0.0.1:{port}", "--pool-path", pool, "--pool-bytes", "8MiB",
                   "--state-dir", str(state))
    one_line(proc, 1, f"http 127.0.0.1:{port}", "in use")
    assert sorted(p.name for p in ctl.iterdir()) == ["keep"]
    assert not os.path.exists(pool)


def test_refused_start_on_a_locked_pool_leaves_the_holders_file(workdir: Path,
                                                                pool: str) -> None:
    with run_daemon(workdir / "first") as first:
        assert first.proc is not None
        proc = cli(*serve_args(workdir / "second", first.pool_path))
        one_line(proc, 1, f"pool_path {first.pool_path}", f"locked by pid {first.proc.pid}")
        assert not (workdir / "second").exists()  # the folder it made for its socket
        assert os.path.exists(first.pool_path) and first.proc.poll() is None


# -- the control folder ----------------------------------------------------------------------


@needs_root
def test_control_folder_another_user_owns_is_refused(workdir: Path, pool: str) -> None:
    planted = workdir / "planted"
    planted.mkdir(mode=0o700)
    os.chown(planted, OTHER_UID, OTHER_UID)
    proc = cli("serve", "--control", f"ipc://{planted}/control.sock", "--http", "127.0.0.1:0",
               "--pool-path", pool, "--pool-bytes", "8MiB")
    one_line(proc, 1, "control", str(planted), f"uid {OTHER_UID}")
    assert list(planted.iterdir()) == []
    assert not os.path.exists(pool)


@pytest.mark.parametrize("kind", ["open_to_others", "symlink"])
def test_control_folder_others_could_replace_is_refused(workdir: Path, pool: str,
                                                       kind: str) -> None:
    real = workdir / "real"
    real.mkdir(mode=0o700)
    folder = workdir / "ctl"
    if kind == "symlink":
        folder.symlink_to(real)
    else:
        folder.mkdir()
        folder.chmod(0o777)
    proc = cli("serve", "--control", f"ipc://{folder}/control.sock", "--http", "127.0.0.1:0",
               "--pool-path", pool, "--pool-bytes", "8MiB")
    one_line(proc, 1, "control", str(folder), "symlink" if kind == "symlink" else "chmod 700")
    assert list(real.iterdir()) == []


# -- the state dir -------------------------------------------------------------------------


@contextlib.contextmanager
def _mounted(*options: str) -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="kvo-fs-"))
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs",
                           str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}): needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)
        where.rmdir()


@contextlib.contextmanager
def _bad_state_dir(kind: str, base: Path) -> Iterator[Path]:
    if kind == "not_a_folder":
        path = base / "state"
        path.write_text("a file where the state dir should be")
        yield path
    elif kind == "read_only":
        with _mounted("size=4m", "ro") as fs:
            yield fs
    else:  # full
        with _mounted("size=512k") as fs:
            with open(fs / "filler", "wb") as f, contextlib.suppress(OSError):
                f.write(b"\0" * (1 << 20))  # ENOSPC once the 512 KiB are taken
            yield fs


@pytest.mark.parametrize(("kind", "why"), [("not_a_folder", "not a folder"),
                                           ("read_only", "read-only"), ("full", "full")])
def test_bad_state_dir_starts_cold_loudly(tmp_path: Path, kind: str, why: str) -> None:
    with _bad_state_dir(kind, tmp_path) as state, \
            run_daemon(tmp_path, "--state-dir", str(state)) as d:
        assert "Traceback" not in d.log()
        warning = [ln for ln in d.log().splitlines() if "STATE DIR UNUSABLE" in ln]
        assert len(warning) == 1 and why in warning[0] and "COLD" in warning[0]
        assert metric_sum(scrape_metrics(d.http_url), "kvoffload_state_dir_faulty") == 1
        stats = cli("stats", "--connect", d.control)  # and it serves
        assert stats.returncode == 0, stats.stderr


@pytest.mark.parametrize("kind", ["not_a_folder", "read_only"])
def test_bad_state_dir_can_refuse_instead(workdir: Path, pool: str, kind: str) -> None:
    with _bad_state_dir(kind, workdir) as state:
        proc = cli(*serve_args(workdir, pool, "--state-dir", str(state),
                               "--state-dir-errors", "refuse"))
        one_line(proc, 1, f"state_dir {state}", 'state_dir_errors = "cold"')


def test_good_state_dir_is_not_faulty(tmp_path: Path) -> None:
    with run_daemon(tmp_path, "--state-dir", str(tmp_path / "state")) as d:
        assert metric_sum(scrape_metrics(d.http_url), "kvoffload_state_dir_faulty") == 0


# -- endpoints -------------------------------------------------------------------------------


def test_tcp_port_zero_binds_and_is_reported(tmp_path: Path) -> None:
    args = ["--events", "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0",
            "--lookup-events", "tcp://127.0.0.1:0"]
    with run_daemon(tmp_path, *args) as d:
        body = json.loads(urllib.request.urlopen(f"{d.http_url}/readyz", timeout=5).read())
        eps = body["endpoints"]
        assert body["ready"] is True and eps["control"] == d.control
        assert eps["http"] == d.http_url
        for name in ("events", "events_replay", "lookup_events"):
            assert eps[name].startswith("tcp://127.0.0.1:") and not eps[name].endswith(":0")
            assert eps[name] in d.log()  # and the log says it
        # Bound, not connected: a router that connects (as Dynamo or llm-d do) gets events.
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 20_000)
        sub.connect(eps["events"])
        try:
            deadline = time.monotonic() + 30
            got = None
            while got is None and time.monotonic() < deadline:
                out = cli("demo", "--connect", d.control, "--requests", "3")
                assert out.returncode == 0, out.stderr
                with contextlib.suppress(zmq.Again):
                    got = sub.recv_multipart()
            assert got is not None and len(got) == 3  # topic, seq, payload
        finally:
            sub.close(linger=0)
            ctx.term()


# -- warm restart: recovered state in the first scrape -----------------------------------------


def test_recovered_state_is_in_the_first_scrape(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with run_daemon(tmp_path, "--state-dir", str(state), pool_bytes=16 << 20) as d:
        out = cli("demo", "--connect", d.control, "--requests", "20", "--json")
        assert out.returncode == 0, out.stderr
        before = json.loads(cli("stats", "--connect", d.control, "--json").stdout)
        assert before["blocks_resident"] > 0
        assert d.stop() == 0
        d.start()
        # No client has spoken to the new daemon: only recovery can have set these.
        m = scrape_metrics(d.http_url)
        assert metric_sum(m, "kvoffload_pool_slots", state="ready") == before["blocks_resident"]
        assert metric_sum(m, "kvoffload_namespaces") == before["namespaces"] == 1
        assert metric_sum(m, "kvoffload_pool_bytes", state="used") > 0
        human = cli("stats", "--http", d.http_url)
        assert human.returncode == 0 and "None" not in human.stdout, human.stdout
        assert f"{before['blocks_resident']:,} resident" in human.stdout
