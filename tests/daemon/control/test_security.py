"""CURVE on the control socket (allow-list, rejections counted), key files, ipc permissions."""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from kvoffload.bench.suites.load import metric_sum, scrape_metrics
from kvoffload.connector.client import DaemonClient, DaemonUnavailable
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, make_key
from kvoffload.daemon.config import Config
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.control import security as sec
from kvoffload.daemon.control.security import generate_keypair as generate
from kvoffload.events.publisher import SEQ

from kvoffload.cli.keys import add_parser as add_keys_parser
from tests.daemon.test_server import EXAMPLE, query
from tests.daemon_helpers import run_daemon

WIRED = any(f.name == "curve_server_key" for f in msgspec.structs.fields(Config))
needs_wiring = pytest.mark.skipif(not WIRED, reason="CURVE settings not wired into config.py "
                                  "yet (issue 8 wiring, docs/security.md)")


# ------------------------------------------------------------------------- key files


def test_keys_command_writes_a_private_pair(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_keys_parser(parser.add_subparsers())
    out, allow = tmp_path / "keys", tmp_path / "allow"
    args = parser.parse_args(["keys", "--out", str(out), "--name", "engine-a", "--allow",
                              str(allow)])
    assert args.handler(args) == 0
    secret, public = out / "engine-a.key_secret", out / "engine-a.key"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    pair = sec.load_keypair(secret)
    assert sec.load_public_key(public) == pair.public == zmq.curve_public(pair.secret)
    assert sec.load_allow_list(allow) == {pair.public}
    assert args.handler(args) == 1  # never overwrites a pair without --force
    assert sec.load_keypair(secret) == pair
    with pytest.raises(ValueError):
        generate(out, "../escape")


def test_key_file_formats_and_refusals(tmp_path: Path) -> None:
    public, secret = zmq.curve_keypair()
    plain = tmp_path / "plain.secret"
    plain.write_bytes(secret + b"\n")
    plain.chmod(0o600)
    assert sec.load_keypair(plain) == sec.KeyPair(public=public, secret=secret)
    plain.chmod(0o640)
    with pytest.raises(sec.SecurityConfigError, match="chmod 600"):
        sec.load_keypair(plain)
    listing = tmp_path / "allowed.txt"
    other = zmq.curve_keypair()[0]
    listing.write_bytes(b"# engines on this node\n" + public + b"  # engine a\n\n" + other + b"\n")
    assert sec.load_allow_list(listing) == {public, other}
    listing.write_bytes(b"not-a-key\n")
    with pytest.raises(sec.SecurityConfigError, match="line 1"):
        sec.load_allow_list(listing)
    assert sec.load_public_key(public.decode()) == public
    with pytest.raises(sec.SecurityConfigError):
        sec.load_keypair(tmp_path / "missing")
    with pytest.raises(sec.SecurityConfigError, match="both"):
        sec.CurveGuard.from_files(str(plain), None, None)  # type: ignore[arg-type]
    with pytest.raises(sec.SecurityConfigError, match="both"):
        sec.CurveClientKeys.from_settings({"kvoffload_curve_client_key": str(plain)}, env={})
    assert sec.CurveClientKeys.from_settings({}, env={}) is None


# ---------------------------------------------------------------------- live daemon


def _wait_metric(http_url: str, name: str, at_least: float, **labels: str) -> float:
    """Poll /metrics until a counter reaches ``at_least`` (handshakes are asynchronous)."""
    deadline = time.monotonic() + 20
    while True:
        value = metric_sum(scrape_metrics(http_url), name, **labels)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


@pytest.fixture
def curve_daemon(tmp_path: Path):
    keys = tmp_path / "keys"
    allow = tmp_path / "allow"
    generate(keys, "server")
    generate(keys, "engine")
    generate(keys, "stranger")
    allow.mkdir()
    shutil.copy(keys / "engine.key", allow / "engine.key")
    with run_daemon(tmp_path, "--control", "tcp://127.0.0.1:0", "--curve-server-key",
                    str(keys / "server.key_secret"), "--curve-client-keys", str(allow)) as d:
        yield d, keys, allow


def _client(d, keys: Path, name: str, server: str = "server") -> DaemonClient:
    curve = sec.CurveClientKeys.from_files(keys / f"{name}.key_secret", keys / f"{server}.key")
    return DaemonClient(d.ready["control"], timeout_ms=1500, curve=curve)


@needs_wiring
def test_curve_admits_only_allowed_keys_and_counts_the_rest(curve_daemon, monkeypatch) -> None:
    d, keys, allow = curve_daemon
    assert d.ready["control"].startswith("tcp://127.0.0.1:")
    ok = _client(d, keys, "engine")
    ok.register(EXAMPLE)
    assert ok.lookup([query()])[0].hit_tokens == 0  # full service over CURVE
    assert _wait_metric(d.http_url, "kvoffload_auth_accepted_total", 1) >= 1

    stranger = _client(d, keys, "stranger")
    with pytest.raises(DaemonUnavailable):
        stranger.connect()
    assert _wait_metric(d.http_url, "kvoffload_auth_rejected_total", 1,
                        reason="unknown_key") >= 1

    plain = DaemonClient(d.ready["control"], timeout_ms=1500)  # NULL mechanism, no keys
    with pytest.raises(DaemonUnavailable):
        plain.connect()
    impostor = _client(d, keys, "engine", server="stranger")  # wrong daemon public key
    with pytest.raises(DaemonUnavailable):
        impostor.connect()
    assert _wait_metric(d.http_url, "kvoffload_auth_rejected_total", 1,
                        reason="handshake") >= 1

    # The client environment variables reach every socket the connector makes.
    monkeypatch.setenv(sec.ENV_CLIENT_KEY, str(keys / "engine.key_secret"))
    monkeypatch.setenv(sec.ENV_SERVER_PUBLIC_KEY, str(keys / "server.key"))
    by_env = DaemonClient(d.ready["control"], timeout_ms=5000)
    assert by_env.stats()["clients"] >= 1
    # Revocation needs no restart: the allow-list is re-read when it changes.
    (allow / "engine.key").unlink()
    with pytest.raises(DaemonUnavailable):
        _client(d, keys, "engine").connect()
    assert ok.lookup([query()])[0].hit_tokens == 0  # established sessions stay (documented)
    for c in (ok, stranger, plain, impostor, by_env):
        c.close()


@needs_wiring
def test_curve_startup_refuses_an_open_secret_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate(keys, "server")
    (keys / "server.key_secret").chmod(0o644)
    with pytest.raises(RuntimeError, match="chmod 600"), run_daemon(
            tmp_path, "--control", "tcp://127.0.0.1:0", "--curve-server-key",
            str(keys / "server.key_secret"), "--curve-client-keys", str(keys / "server.key")):
        pass


# ------------------------------------------------------------------- ipc permissions


def test_ipc_socket_is_0600_in_a_0700_dir(tmp_path: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="kvo-perm-"))
    try:
        sock = base / "fresh" / "control.sock"  # the daemon creates the directory
        with run_daemon(tmp_path, "--control", f"ipc://{sock}") as d:
            assert stat.S_ISSOCK(sock.stat().st_mode)
            assert stat.S_IMODE(sock.stat().st_mode) == 0o600
            assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
            assert stat.S_IMODE(Path(f"{sock}.lock").stat().st_mode) == 0o600
            assert stat.S_IMODE(os.stat(d.pool_path).st_mode) == 0o600
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_ipc_refuses_a_control_dir_open_to_others(tmp_path: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="kvo-perm-"))
    try:
        shared = base / "shared"
        shared.mkdir()
        shared.chmod(0o777)  # e.g. a /tmp path another user created first
        cmd = [sys.executable, "-m", "kvoffload", "serve", "--control",
               f"ipc://{shared}/control.sock", "--http", "127.0.0.1:0", "--pool-path",
               f"/dev/shm/kvoffload-test-perm-{os.getpid()}", "--pool-bytes", "1MiB"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 20
            while proc.poll() is None and not (shared / "control.sock").exists():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            refused = proc.poll() is not None and proc.returncode != 0
            fixed = stat.S_IMODE(shared.stat().st_mode) == 0o700
        finally:
            proc.kill()
            proc.wait()
            Path(f"/dev/shm/kvoffload-test-perm-{os.getpid()}").unlink(missing_ok=True)
        assert refused or fixed
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_allow_list_reload_fails_closed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A deleted directory, a bad file or an empty list admits nobody (before: the last good
    list stayed in force); fixing the list admits again, without a restart."""
    keys, allow = tmp_path / "keys", tmp_path / "allow"
    generate(keys, "engine")
    generate(keys, "other")
    allow.mkdir()
    shutil.copy(keys / "engine.key", allow / "engine.key")
    engine = sec.load_public_key(keys / "engine.key")
    other = sec.load_public_key(keys / "other.key")
    guard = sec.AllowList(allow)
    assert guard.allowed(engine) and not guard.allowed(other)
    caplog.set_level("ERROR", logger="kvoffload.daemon")
    saved = tmp_path / "saved"
    allow.rename(saved)  # the whole directory gone
    assert not guard.allowed(engine)
    assert "refusing every client" in caplog.text
    saved.rename(allow)
    assert guard.allowed(engine)
    (allow / "broken.key").write_text("not a key\n")  # one bad file
    assert not guard.allowed(engine) and guard.failed is not None
    (allow / "broken.key").write_text(f"{other.decode()} the other engine\n")
    assert guard.allowed(engine) and guard.allowed(other) and guard.failed is None
    (allow / "engine.key").unlink()
    (allow / "broken.key").unlink()  # an empty list: nobody
    assert not guard.allowed(engine) and not guard.allowed(other)
    one = tmp_path / "one.txt"  # a single-file list, deleted
    one.write_text(engine.decode() + "\n")
    single = sec.AllowList(one)
    assert single.allowed(engine)
    one.unlink()
    assert not single.allowed(engine)


# ------------------------------------------------------------------------- event sockets


EVENT_GEOM = Geometry(namespace="curve-events", tokens_per_hash=16, groups=(
    GroupSpec(kind=GroupKind.FULL_ATTENTION, tokens_per_block=16, bytes_per_block=256),))


def _sub(ctx: zmq.Context, endpoint: str, curve: sec.CurveClientKeys | None) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(s)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(endpoint)
    return s


def test_event_sockets_speak_curve_with_the_control_allow_list(tmp_path: Path) -> None:
    keys, allow = tmp_path / "keys", tmp_path / "allow"
    for name in ("server", "engine", "stranger"):
        generate(keys, name)
    allow.mkdir()
    shutil.copy(keys / "engine.key", allow / "engine.key")
    engine = sec.CurveClientKeys.from_files(keys / "engine.key_secret", keys / "server.key")
    stranger = sec.CurveClientKeys.from_files(keys / "stranger.key_secret", keys / "server.key")
    with run_daemon(tmp_path, "--control", "tcp://127.0.0.1:0", "--curve-server-key",
                    str(keys / "server.key_secret"), "--curve-client-keys", str(allow),
                    "--events", "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0",
                    env={"KVOFFLOAD_EVENTS_CURVE": "1"}) as d:
        ctx = zmq.Context()
        allowed = _sub(ctx, d.ready["events"], engine)
        plain = _sub(ctx, d.ready["events"], None)
        other = _sub(ctx, d.ready["events"], stranger)
        writer = DaemonClient(d.ready["control"], timeout_ms=5000, curve=engine)
        writer.register(EVENT_GEOM)
        try:
            # Store new blocks until the allowed subscriber hears one (it joins late).
            got = 0
            deadline = time.monotonic() + 20
            i = 0
            while got < 2 and time.monotonic() < deadline:
                key = make_key(hashlib.sha256(b"ev%d" % i).digest(), 0)
                i += 1
                writer.prepare_store([p.StoreItem(key=key, end_token=16,
                                                  token_ids=list(range(i, i + 16)))])
                writer.commit_store([key])
                while allowed.poll(50):
                    allowed.recv_multipart()
                    got += 1
            assert got >= 2, "the allow-listed subscriber got no events"
            # The same stream never reached a plain or a stranger's subscriber.
            assert plain.poll(200) == 0 and other.poll(0) == 0
            assert _wait_metric(d.http_url, "kvoffload_auth_rejected_total", 1,
                                reason="unknown_key") >= 1
            # Replay: answered for the allowed key, nothing for a plain client.
            for curve, answered in ((engine, True), (None, False)):
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                if curve is not None:
                    curve.apply(dealer)
                dealer.connect(d.ready["events_replay"])
                dealer.send_multipart([b"", SEQ.pack(0)])
                assert bool(dealer.poll(3000 if answered else 1000)) is answered
                dealer.close(linger=0)
        finally:
            writer.close()
            for s in (allowed, plain, other):
                s.close(linger=0)
            ctx.term()


def test_events_curve_without_keys_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="events_curve"):
        Config(events_curve=True)
