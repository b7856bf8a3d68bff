"""Every common mistake of issue 14 ends in one line naming the setting, the cause and the
fix, a non-zero exit code, no traceback and nothing left behind (the real CLI, as a process).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvoffload.daemon.control.security import generate_keypair as generate

from tests.daemon_helpers import run_daemon
from tests.mistake_helpers import cli, one_line, pool_path, serve_args


def _port(url: str) -> str:
    return url.rsplit(":", 1)[1]


# -- the pool and its filesystem -----------------------------------------------------------


def test_pool_larger_than_free_space(workdir: Path) -> None:
    pool = pool_path()
    proc = cli(*serve_args(workdir, pool, pool_bytes="100000TiB"))
    line = one_line(proc, 1, "pool_bytes", "does not fit", "/dev/shm", "half of RAM",
                    "--pool-bytes", "emptyDir")
    assert "free)" in line
    assert not os.path.exists(pool)


@contextlib.contextmanager
def _tmpfs(size: str) -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="kvo-fs-"))
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip()}): needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)
        where.rmdir()


@pytest.mark.parametrize("prefault", [True, False])
def test_pool_on_a_small_tmpfs_is_refused_not_a_bus_error(workdir: Path, prefault: bool) -> None:
    # The reproduction of issue 14: a 64 MiB pool on a 16 MiB tmpfs was SIGBUS (exit 135)
    # with the file system left 100 % full.
    with _tmpfs("16m") as fs:
        pool = str(fs / "pool")
        env = {} if prefault else {"KVOFFLOAD_PREFAULT": "false"}
        proc = cli(*serve_args(workdir, pool, pool_bytes="64MiB"), env=env)
        one_line(proc, 1, "pool_bytes 64.0 MiB", f"filesystem of {pool}", "16.0 MiB free")
        assert list(fs.iterdir()) == []
        vfs = os.statvfs(fs)
        assert vfs.f_bfree == vfs.f_blocks  # nothing allocated


# -- a second daemon ----------------------------------------------------------------------


def test_second_daemon_on_the_same_http_port(tmp_path: Path, workdir: Path) -> None:
    with run_daemon(tmp_path) as first:
        pool = pool_path()
        proc = cli("serve", "--control", f"ipc://{workdir}/control.sock", "--http",
                   f"127.0.0.1:{_port(first.http_url)}", "--pool-path", pool,
                   "--pool-bytes", "8MiB")
        one_line(proc, 1, f"http 127.0.0.1:{_port(first.http_url)}", "in use", "--http")
        assert not os.path.exists(pool)  # its own pool file is gone again
        assert first.proc is not None and first.proc.poll() is None


def test_second_daemon_on_the_same_pool_names_the_holder(tmp_path: Path, workdir: Path) -> None:
    with run_daemon(tmp_path) as first:
        assert first.proc is not None
        proc = cli(*serve_args(workdir, first.pool_path))
        one_line(proc, 1, f"pool_path {first.pool_path}", f"locked by pid {first.proc.pid}",
                 "--pool-path")
        assert os.path.exists(first.pool_path)  # the first daemon's file is untouched
        assert first.proc.poll() is None


def test_second_daemon_on_the_same_control_says_nothing_misleading(tmp_path: Path) -> None:
    with run_daemon(tmp_path) as first:
        assert first.proc is not None
        pool = pool_path()
        proc = cli("serve", "--control", first.control, "--http", "127.0.0.1:0",
                   "--pool-path", pool, "--pool-bytes", "8MiB")
        line = one_line(proc, 1, f"control {first.control}", f"pid {first.proc.pid}",
                        "--control")
        assert "stopped" not in proc.stderr, line
        assert not os.path.exists(pool)


# -- settings ----------------------------------------------------------------------------


def test_event_socket_in_a_missing_folder(workdir: Path) -> None:
    pool = pool_path()
    proc = cli(*serve_args(workdir, pool, "--events", f"ipc://{workdir}/nope/events.sock"))
    one_line(proc, 1, "--events", f"folder {workdir}/nope does not exist")
    assert not os.path.exists(pool)
    assert sorted(p.name for p in workdir.iterdir()) == []


def test_unknown_policy_in_the_config_file(workdir: Path) -> None:
    conf = workdir / "kvoffload.toml"
    conf.write_text('policy = "fifo"\n')
    pool = pool_path()
    proc = cli(*serve_args(workdir, pool, "--config", str(conf)))
    one_line(proc, 2, f"config file {conf}", "policy", "fifo", "arc, lru")
    assert not os.path.exists(pool)


def test_unknown_policy_flag_is_one_line_too(workdir: Path) -> None:
    proc = cli(*serve_args(workdir, pool_path(), "--policy", "fifo"))
    one_line(proc, 2, "flag --policy", "arc, lru")


def test_unknown_preset_lists_the_choices() -> None:
    proc = cli("demo", "--preset", "llama-70b", "--requests", "1")
    one_line(proc, 2, "--preset llama-70b", "qwen3.6-27b-tp1", "qwen3-next-80b-tp4")


@pytest.mark.parametrize("command", ["demo", "stats"])
def test_connect_without_a_scheme(workdir: Path, command: str) -> None:
    path = f"{workdir}/control.sock"
    proc = cli(command, "--connect", path)
    one_line(proc, 2, f"--connect {path}", "ipc://", "tcp://", f"ipc://{path}")


@pytest.mark.parametrize("command", ["demo", "stats"])
def test_connect_to_no_daemon(workdir: Path, command: str) -> None:
    ep = f"ipc://{workdir}/control.sock"
    proc = cli(command, "--connect", ep, "--timeout-ms" if command == "stats" else "--seed",
               "300" if command == "stats" else "0")
    one_line(proc, 1, f"no kvoffload daemon answers at --connect {ep}", "kvoffload serve")


def test_curve_refused_client_is_told_about_keys(tmp_path: Path) -> None:
    keys, allow = tmp_path / "keys", tmp_path / "allow"
    generate(keys, "server")
    generate(keys, "engine")
    allow.mkdir()
    shutil.copy(keys / "engine.key", allow / "engine.key")
    with run_daemon(tmp_path, "--control", "tcp://127.0.0.1:0", "--curve-server-key",
                    str(keys / "server.key_secret"), "--curve-client-keys", str(allow)) as d:
        ep = d.ready["control"]
        for proc in (cli("demo", "--connect", ep, "--requests", "1"),
                     cli("stats", "--connect", ep, "--timeout-ms", "500")):
            one_line(proc, 1, f"--connect {ep}", "CURVE", "KVOFFLOAD_CURVE_CLIENT_KEY",
                     "KVOFFLOAD_CURVE_SERVER_PUBLIC_KEY")
        # With the right keys the same command works: the hint was about keys, not the address.
        env = {"KVOFFLOAD_CURVE_CLIENT_KEY": str(keys / "engine.key_secret"),
               "KVOFFLOAD_CURVE_SERVER_PUBLIC_KEY": str(keys / "server.key")}
        ok = cli("stats", "--connect", ep, env=env)
        assert ok.returncode == 0, ok.stderr
