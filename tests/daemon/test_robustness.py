"""No client can stall or crash the daemon (issue 16): one test per defect, real processes.

Deep nesting, parked lookups of departed clients, SIGTERM with thousands of parked lookups,
a SIGSTOP freeze, a flood from one client, half-open HTTP connections under a small
descriptor limit, and the per-client and per-query bounds. Timing is never asserted: every
wait is a generous client timeout or a deadline on something that must happen.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from kvoffload.bench.suites.load import metric_sum, scrape_metrics
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, make_key
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.lookup.handler import MAX_QUERY_HASHES, THREAD_HASHES
from kvoffload.daemon.ops.loop_health import MAX_PARKED_PER_CLIENT

from tests.daemon.test_server import EXAMPLE, H, query
from tests.daemon_helpers import DaemonHandle, run_daemon

CHUNK = [make_key(H[3], 0), make_key(H[3], 1)]  # what query() hits first: 16 tokens


class Raw:
    """One DEALER that speaks the protocol without DaemonClient's timeouts and resets."""

    def __init__(self, endpoint: str) -> None:
        self.sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.rid = 1000

    def send(self, msg: p._Msg) -> None:
        self.sock.send(p.encoder.encode(msg))

    def recv(self, timeout_ms: int = 20_000) -> p._Msg | None:
        if not self.sock.poll(timeout_ms):
            return None
        return p.reply_decoder.decode(self.sock.recv())

    def call(self, msg: p._Msg, timeout_ms: int = 20_000) -> p._Msg:
        self.send(msg)
        deadline = time.monotonic() + timeout_ms / 1000
        while time.monotonic() < deadline:
            reply = self.recv(max(1, int((deadline - time.monotonic()) * 1000)))
            if reply is not None and reply.rid == msg.rid:
                return reply
        raise AssertionError(f"no reply to {type(msg).__name__}")

    def next_rid(self) -> int:
        self.rid += 1
        return self.rid

    def hello(self, lease_ms: int | None = None) -> None:
        assert isinstance(self.call(p.Hello(rid=1, version=p.PROTOCOL_VERSION,
                                            lease_ms=lease_ms)), p.Welcome)

    def register(self) -> int:
        reply = self.call(p.Register(rid=2, geometry=EXAMPLE))
        assert isinstance(reply, p.Registered), reply
        return reply.engine

    def park(self, engine: int, wait_ms: int = 60_000) -> int:
        rid = self.next_rid()
        self.send(p.Lookup(rid=rid, engine=engine, queries=[query()], wait_ms=wait_ms, pin=True))
        return rid

    def close(self) -> None:
        self.sock.close()


def _until(what: str, check: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _metric(d: DaemonHandle, name: str, **labels: str) -> float:
    return metric_sum(scrape_metrics(d.http_url), name, **labels)


@pytest.fixture
def daemon(tmp_path) -> Iterator[DaemonHandle]:
    # Resets here are about pins, not consent: any registrant may drop the namespace.
    # 64 MiB messages: one test here sends a 32 MiB lookup (the default is 8 MiB).
    with run_daemon(tmp_path, "--lease-ms", "60000", slot_bytes=1024,
                    env={"KVOFFLOAD_RESET_NAMESPACE": "any",
                         "KVOFFLOAD_MAX_MESSAGE_BYTES": "64MiB"}) as d:
        yield d


def _pending_writer(d: DaemonHandle) -> DaemonClient:
    w = DaemonClient(d.control, timeout_ms=20_000)
    w.register(EXAMPLE)
    grant = w.prepare_store([p.StoreItem(key=k, end_token=16) for k in CHUNK])
    assert grant.outcomes == [p.StoreOutcome.GRANTED] * 2
    return w


# ------------------------------------------------------------------------------ bad input


def test_deep_nesting_is_answered_malformed_and_counted(daemon: DaemonHandle) -> None:
    raw = Raw(daemon.control)
    deep = b"\x91" * 5000 + b"\xc0"  # a 5 KB frame nested 5,000 levels
    frames = [b"\x83\xa2op\xa5hello\xa3rid\x07\xa1x" + deep,  # in an unknown field
              b"\x81\xa1x" * 3000 + b"\xc0"]  # maps all the way down
    for frame in frames:
        raw.sock.send(frame)
        reply = raw.recv()
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.MALFORMED, reply
    assert _metric(daemon, "kvoffload_refused_total", reason="nesting") == 2
    assert _metric(daemon, "kvoffload_protocol_errors_total", code="malformed") == 2
    assert "Traceback" not in daemon.log() and "RecursionError" not in daemon.log()
    assert isinstance(raw.call(p.Heartbeat(rid=9)), p.Ack)  # the same client is served on
    raw.close()


def test_bad_registers_are_typed_errors_and_create_nothing(tmp_path) -> None:
    """NaN / inf rates are refused before the namespace exists; a first engine whose block
    cannot size the pool gets a typed error, not ``internal``."""
    with run_daemon(tmp_path, pool_bytes=16 << 20) as d:  # no --slot-bytes: Register sizes
        raw = Raw(d.control)
        for rate in (float("nan"), float("inf"), -1.0):
            err = raw.call(p.Register(rid=3, geometry=EXAMPLE, prefill_tokens_per_s=rate,
                                      copy_bytes_per_s=1e9))
            assert isinstance(err, p.Error) and err.code == p.ErrorCode.BAD_REQUEST, err
        huge = msgspec.structs.replace(EXAMPLE, namespace="huge", groups=tuple(
            msgspec.structs.replace(g, bytes_per_block=64 << 20) for g in EXAMPLE.groups))
        err = raw.call(p.Register(rid=4, geometry=huge))
        assert isinstance(err, p.Error) and err.code == p.ErrorCode.GEOMETRY_MISMATCH, err
        stats = raw.call(p.Stats(rid=5))
        assert isinstance(stats, p.StatsReply) and stats.stats["namespaces"] == 0
        assert _metric(d, "kvoffload_protocol_errors_total", code="internal") == 0
        raw.close()


def test_per_query_hash_limit_and_parked_lookups_per_client(daemon: DaemonHandle) -> None:
    raw = Raw(daemon.control)
    engine = raw.register()
    n = MAX_QUERY_HASHES + 1
    huge = p.LookupQuery(req_id="huge", hash_blob=bytes(32 * n), hash_bytes=32,
                         num_tokens=4 * n, num_prompt_tokens=4 * n)
    err = raw.call(p.Lookup(rid=5, engine=engine, queries=[huge]))
    assert isinstance(err, p.Error) and err.code == p.ErrorCode.TOO_LARGE, err
    assert _metric(daemon, "kvoffload_refused_total", reason="query_hashes") == 1
    writer = _pending_writer(daemon)
    rids = [raw.park(engine) for _ in range(MAX_PARKED_PER_CLIENT + 1)]
    refused = raw.recv()
    assert isinstance(refused, p.Error) and refused.code == p.ErrorCode.TOO_LARGE, refused
    assert refused.rid == rids[-1] and "parked" in refused.message
    assert _metric(daemon, "kvoffload_refused_total", reason="parked_lookups") == 1
    other = Raw(daemon.control)  # the bound is per client: another one still parks
    other_rid = other.park(other.register())
    writer.commit_store(CHUNK)
    replies = [raw.recv() for _ in range(MAX_PARKED_PER_CLIENT)]
    assert {r.rid for r in replies if isinstance(r, p.LookupReply)} == set(rids[:-1])
    late = other.recv()
    assert isinstance(late, p.LookupReply) and late.rid == other_rid
    assert late.answers[0].hit_tokens == 16
    for c in (raw, other):
        c.close()
    writer.close()


def test_many_queries_in_slices_answer_like_one_pass(daemon: DaemonHandle) -> None:
    c = DaemonClient(daemon.control, timeout_ms=30_000)
    c.register(EXAMPLE)
    grant = c.prepare_store([p.StoreItem(key=k, end_token=16) for k in CHUNK])
    assert grant.outcomes == [p.StoreOutcome.GRANTED] * 2
    c.commit_store(CHUNK)
    misses = [p.LookupQuery(req_id=f"m{i}", hash_blob=os.urandom(32 * 2000), hash_bytes=32,
                            num_tokens=8000, num_prompt_tokens=8000) for i in range(20)]
    queries = [*misses[:10], query("hit"), *misses[10:]]  # 40,000 hashes: several slices
    answers = c.lookup(queries)
    assert [a.req_id for a in answers] == [q.req_id for q in queries]
    assert [a.hit_tokens for a in answers] == [0] * 10 + [16] + [0] * 10
    c.close()


MAMBA = Geometry(namespace="mamba-only", groups=(
    GroupSpec(kind=GroupKind.MAMBA, tokens_per_block=16, bytes_per_block=256),),
    tokens_per_hash=16)


def test_long_queries_are_scanned_off_the_loop_and_answer_the_same(
        daemon: DaemonHandle) -> None:
    """A Mamba-only miss probes every chunk: 16 queries of 65,536 hashes (a 32 MiB message)
    take seconds of lookup work, yet /healthz answers while they run; and a long query
    that hits answers exactly like a short one."""
    c = DaemonClient(daemon.control, timeout_ms=120_000)
    c.register(MAMBA)
    n = THREAD_HASHES + 100
    hashes = [os.urandom(32) for _ in range(n)]
    key = make_key(hashes[n // 2], 0)  # the Mamba state at token 16 * (n/2 + 1)
    assert c.prepare_store([p.StoreItem(key=key, end_token=16 * (n // 2 + 1))]).slots[0] >= 0
    c.commit_store([key])
    long_q = p.LookupQuery(req_id="long", block_hashes=hashes, num_tokens=16 * n + 1,
                           num_prompt_tokens=16 * n + 1)
    short = p.LookupQuery(req_id="short", block_hashes=hashes[:n // 2 + 1],
                          num_tokens=16 * (n // 2 + 1) + 1,
                          num_prompt_tokens=16 * (n // 2 + 1) + 1)
    got = c.lookup([long_q])[0]
    assert got.hit_tokens == 16 * (n // 2 + 1) == c.lookup([short])[0].hit_tokens
    assert got.load_keys == [key]
    raw = Raw(daemon.control)
    engine = raw.call(p.Register(rid=2, geometry=MAMBA)).engine  # type: ignore[attr-defined]
    big = [p.LookupQuery(req_id=f"q{i}", hash_blob=os.urandom(32 * 65_536), hash_bytes=32,
                         num_tokens=16 * 65_536 + 1, num_prompt_tokens=16 * 65_536 + 1)
           for i in range(16)]
    raw.send(p.Lookup(rid=77, engine=engine, queries=big))
    with urllib.request.urlopen(f"{daemon.http_url}/healthz", timeout=60) as resp:
        assert resp.status == 200
    assert not raw.sock.poll(0)  # answered while the big lookup was still being worked out
    reply = raw.recv(120_000)
    assert isinstance(reply, p.LookupReply) and [a.hit_tokens for a in reply.answers] == [0] * 16
    raw.close()
    c.close()


# ------------------------------------------------------------------------ leases and pins


def test_parked_pin_lookups_of_departed_clients_take_no_pins(daemon: DaemonHandle) -> None:
    """20 clients park Lookup(pin=True) on pending keys, then leave: 10 by Bye, 10 by lease
    expiry. When the keys commit nobody may hold a pin (before: 20 of 20 leaked)."""
    writer = _pending_writer(daemon)
    leavers = [Raw(daemon.control) for _ in range(20)]
    for i, r in enumerate(leavers):
        r.hello(lease_ms=None if i < 10 else 300)
        r.park(r.register())
    _until("20 parked lookups", lambda: _metric(daemon, "kvoffload_futures_waiting") == 20)
    for r in leavers[:10]:
        assert isinstance(r.call(p.Bye(rid=3)), p.Ack)
    _until("10 leases expired",
           lambda: _metric(daemon, "kvoffload_leases_expired_total") >= 10)
    assert writer.commit_store(CHUNK) == 2
    # An expired client that is still there learns it got nothing: a miss, no slots.
    for r in leavers[10:]:
        reply = r.recv()
        assert isinstance(reply, p.LookupReply), reply
        assert reply.answers[0].hit_tokens == 0 and not reply.answers[0].slots
        assert reply.answers[0].miss_reason == "client_gone"
    _until("parked lookups settled", lambda: _metric(daemon, "kvoffload_futures_waiting") == 0)
    checker = DaemonClient(daemon.control, timeout_ms=20_000)
    checker.register(EXAMPLE)
    assert checker.stats()["pinned"] == 0
    assert checker.reset() == 2  # nothing pinned: the namespace can be dropped whole
    for r in leavers:
        r.close()
    checker.close()
    writer.close()


def test_a_freeze_does_not_expire_clients_that_kept_sending(tmp_path) -> None:
    """SIGSTOP for longer than a lease while a client keeps heart-beating: on SIGCONT the
    heartbeats queued meanwhile are read before any lease is judged; its pin survives."""
    with run_daemon(tmp_path, "--lease-ms", "1000", slot_bytes=1024) as d:
        w = DaemonClient(d.control, timeout_ms=20_000, lease_ms=10_000)  # outlives the freeze
        w.register(EXAMPLE)
        grant = w.prepare_store([p.StoreItem(key=k, end_token=16) for k in CHUNK])
        assert grant.outcomes == [p.StoreOutcome.GRANTED] * 2
        w.commit_store(CHUNK)
        holder = Raw(d.control)
        holder.hello(lease_ms=1000)
        engine = holder.register()
        grant_pin = holder.call(p.PinLoad(rid=4, engine=engine, keys=CHUNK))
        assert isinstance(grant_pin, p.LoadGrant) and min(grant_pin.slots) >= 0
        stop = threading.Event()

        def beat() -> None:  # fire and forget: replies are drained, never awaited
            while not stop.is_set():
                holder.send(p.Heartbeat(rid=5))
                while holder.sock.poll(0):
                    holder.sock.recv()
                time.sleep(0.05)

        t = threading.Thread(target=beat, daemon=True)
        t.start()
        assert d.proc is not None
        time.sleep(0.3)
        d.proc.send_signal(signal.SIGSTOP)
        time.sleep(3.0)  # three leases long
        d.proc.send_signal(signal.SIGCONT)
        time.sleep(1.5)  # several sweeps after the resume, heartbeats going on
        checker = DaemonClient(d.control, timeout_ms=20_000)
        checker.register(EXAMPLE)
        assert checker.stats()["pinned"] == 2
        assert _metric(d, "kvoffload_leases_expired_total") == 0
        stop.set()
        t.join()
        holder.close()
        checker.close()
        w.close()


def test_sigterm_answers_two_thousand_parked_lookups(daemon: DaemonHandle) -> None:
    writer = _pending_writer(daemon)
    clients = [Raw(daemon.control) for _ in range(4)]
    rids: list[set[int]] = []
    for c in clients:
        engine = c.register()
        rids.append({c.park(engine) for _ in range(500)})
    _until("2,000 parked lookups",
           lambda: _metric(daemon, "kvoffload_futures_waiting") == 2000, timeout=60)
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)
    answered = 0
    for c, want in zip(clients, rids, strict=True):
        got: set[int] = set()
        while len(got) < len(want):
            reply = c.recv(30_000)
            assert reply is not None, f"{len(got)} of {len(want)} answered"
            if isinstance(reply, p.Error):
                assert reply.code == p.ErrorCode.SHUTTING_DOWN
            else:
                assert isinstance(reply, p.LookupReply)
                assert reply.answers[0].hit_tokens == 0  # still pending: a miss
            got.add(reply.rid)
        assert got == want
        answered += len(got)
    assert answered == 2000
    assert daemon.proc.wait(30) == 0
    for c in clients:
        c.close()
    writer.close()


# ------------------------------------------------------------------------ a loop that breathes


def test_healthz_answers_while_one_client_floods(daemon: DaemonHandle) -> None:
    flooder = Raw(daemon.control)
    flooder.register()
    # Each frame costs the daemon far more than the flooder (4,096 keys to probe), so the
    # daemon always has frames waiting: before, it answered nothing else until the end.
    total, window = 3000, 200  # under the send HWM: a reply is never dropped
    state = {"sent": 0, "answered": 0}

    def flood() -> None:
        msg = p.encoder.encode(p.Probe(rid=7, engine=0, keys=CHUNK * 2048))
        while state["answered"] < total:
            while state["sent"] < total and state["sent"] - state["answered"] < window:
                flooder.sock.send(msg)
                state["sent"] += 1
            if flooder.sock.poll(20_000):
                while flooder.sock.poll(0):
                    flooder.sock.recv()
                    state["answered"] += 1
            else:
                raise AssertionError("flood replies stopped")

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    _until("the flood under way", lambda: state["answered"] > 100)
    during: list[int] = []
    while t.is_alive() and len(during) < 20:
        with urllib.request.urlopen(f"{daemon.http_url}/healthz", timeout=20) as resp:
            assert resp.status == 200
        during.append(state["answered"])
    other = DaemonClient(daemon.control, timeout_ms=20_000)  # a fair share for others
    other.register(EXAMPLE)
    assert other.stats()["namespaces"] >= 1
    served_at = state["answered"]  # flood replies seen when the other client was served
    t.join(60)
    other.close()
    # Answers arrived while flood frames were still being answered, not only after.
    assert [n for n in during if n < total], during
    assert served_at < total
    assert state["answered"] == total
    flooder.close()


class _LimitedDaemon(DaemonHandle):
    """A daemon started under RLIMIT_NOFILE = NOFILE (soft and hard: it cannot raise it)."""

    NOFILE = 256

    def command(self) -> list[str]:
        cmd = super().command()
        assert cmd[0] == sys.executable
        return ["prlimit", f"--nofile={self.NOFILE}:{self.NOFILE}", *cmd]


def test_half_open_http_connections_cannot_exhaust_descriptors() -> None:
    """1,000 half-sent requests against a 256-descriptor daemon (before: libzmq aborted)."""
    short = Path(tempfile.mkdtemp(prefix="kvo-"))  # ipc paths must stay short
    d = _LimitedDaemon(short, ("--lease-ms", "60000"), 64 << 20, 1024, None)
    d.start()
    try:
        host, port = d.http_url.removeprefix("http://").rsplit(":", 1)
        stalled = []
        for _ in range(1000):
            s = socket.create_connection((host, int(port)), timeout=20)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never finished
            stalled.append(s)
        c = DaemonClient(d.control, timeout_ms=20_000)  # an engine connects ...
        c.register(EXAMPLE)
        assert c.lookup([query()])[0].hit_tokens == 0  # ... and is served
        with urllib.request.urlopen(f"{d.http_url}/healthz", timeout=20) as resp:
            assert resp.status == 200  # a prober still gets in
        assert d.proc is not None and d.proc.poll() is None
        assert len(os.listdir(f"/proc/{d.proc.pid}/fd")) < _LimitedDaemon.NOFILE
        for s in stalled:  # every stalled one is closed by the daemon (bound or timeout)
            s.settimeout(30)
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(1) == b""
            s.close()
        assert _metric(d, "kvoffload_refused_total", reason="http_connections") > 0
        c.close()
    finally:
        d.cleanup()
        shutil.rmtree(short, ignore_errors=True)
