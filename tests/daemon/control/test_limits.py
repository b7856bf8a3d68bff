"""Issue 26: what one peer can make the daemon hold, measured on a real daemon process.

The daemon's peak resident memory (``VmHWM``, reset through ``/proc/PID/clear_refs`` before
each attack) may grow by at most the bound docs/security.md states: the frames libzmq keeps
unread for one connection (``RCVHWM + 1`` of at most ``MAXMSGSIZE``), the one frame being
served and its decoded form, and the parked lookups' byte budget. Then the caps on
``PrepareStore`` items (``token_ids`` as in a ``Step``).
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
from kvoffload.bench.suites.load import metric_sum, scrape_metrics
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import KeyStatus, make_key
from kvoffload.daemon.config import Config
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.control.frames import (
    PARKED_BYTES_PER_CLIENT,
    RCVHWM_FRAMES,
    TYPED_BAND_BYTES,
    socket_limits,
)
from kvoffload.daemon.control.steps import MAX_ITEM_TOKENS

from tests.daemon.test_server import EXAMPLE, H, query
from tests.daemon_helpers import DaemonHandle, run_daemon

MiB = 1 << 20
# Decoded size of a frame, at most, per byte (measured: 38x for a list of 1-byte negative
# ints, each a 32-byte Python int behind an 8-byte pointer; 12-14x for the worst of the rest).
DECODE_PER_BYTE = 40
SLACK = 16 * MiB  # allocator rounding, the reply being encoded, metrics: not per frame


def _status(pid: int, field: str) -> int:
    """A memory figure of /proc/PID/status, in bytes."""
    found = re.search(rf"{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    assert found is not None, field
    return int(found.group(1)) << 10


def _peak(d: DaemonHandle) -> int:
    assert d.proc is not None
    return _status(d.proc.pid, "VmHWM")


def _reset_peak(d: DaemonHandle) -> int:
    assert d.proc is not None
    Path(f"/proc/{d.proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS now
    return _peak(d)


def _bound(limit: int) -> int:
    """docs/security.md's bound for one connection, parked lookups aside."""
    frame = limit + min(limit, TYPED_BAND_BYTES)  # MAXMSGSIZE
    return (RCVHWM_FRAMES + 1) * frame + frame + DECODE_PER_BYTE * limit + SLACK


def _dealer(d: DaemonHandle) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # the attacker queues everything at once
    sock.connect(d.control)
    return sock


def _replies(sock: zmq.Socket[Any], n: int) -> list[p._Msg]:
    out: list[p._Msg] = []
    for _ in range(n):
        assert sock.poll(120_000), f"{len(out)} of {n} replies came back"
        out.append(p.reply_decoder.decode(sock.recv()))
    return out


def _zmtp_flood(endpoint: str, frames: list[bytes]) -> int:
    """Send ``frames`` as a ZMTP 3.0 DEALER on the ipc socket, byte by byte as libzmq would,
    reconnecting when the daemon drops the connection. Blocking sends: when this returns,
    the daemon's I/O thread has read or refused every byte. Returns the connections dropped.

    A raw socket, not a DEALER: a DEALER's queued frames may be discarded, sent later, or
    sent on a new connection, and nothing tells when they are gone."""
    greeting = (b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0")
                + b"\0" + bytes(31))
    ready = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    handshake = greeting + b"\x04" + bytes([len(ready)]) + ready
    dropped, pending = 0, list(frames)
    while pending:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            try:
                sock.connect(endpoint[len("ipc://"):])
            except OSError:  # the peer is gone (the test ended it)
                return dropped
            try:
                sock.sendall(handshake)
                while pending:
                    body = pending[0]
                    sock.sendall(b"\x02" + len(body).to_bytes(8, "big"))  # last frame, long
                    sock.sendall(body)
                    pending.pop(0)
            except (BrokenPipeError, ConnectionResetError):
                dropped += 1
                pending.pop(0)  # libzmq dropped the connection at this frame
    return dropped


def test_frames_over_the_socket_cap_cost_the_daemon_nothing(tmp_path: Path) -> None:
    """The issue's eight 100 MB frames (the default 64 MiB limit): libzmq drops the
    connection at each frame's header instead of buffering several of them whole."""
    with run_daemon(tmp_path) as d:
        before = _reset_peak(d)
        body = b"\x81\xa3rid\x01" + bytes(100_000_000)
        dropped = _zmtp_flood(d.control, [body] * 8)
        c = DaemonClient(d.control, timeout_ms=60_000)
        c.register(EXAMPLE)  # and it serves
        grown = _peak(d) - before
        c.close()
        assert "Traceback" not in d.log()
    print(f"eight 100 MB frames: {dropped} connections dropped, peak +{grown / MiB:.1f} MiB")
    assert dropped == 8
    assert grown < SLACK, f"the daemon's peak grew by {grown / MiB:.0f} MiB"


def test_libzmq_keeps_rcvhwm_plus_one_unread_frames_per_connection() -> None:
    """The bound's first term, checked on libzmq itself: a ROUTER with the daemon's socket
    options that reads nothing holds RCVHWM + 1 frames of a peer that sends twelve."""
    limit = 8 * MiB
    options = socket_limits(Config(max_message_bytes=limit, pool_bytes=1 << 30))
    with tempfile.TemporaryDirectory(prefix="kvo-hwm-") as tmp:
        endpoint = f"ipc://{tmp}/s"
        router = subprocess.Popen([sys.executable, "-c", (
            "import sys, zmq\n"
            "s = zmq.Context().socket(zmq.ROUTER)\n"
            f"for k, v in { {int(k): v for k, v in options.items()} !r}.items(): "
            "s.setsockopt(k, v)\n"
            f"s.bind({endpoint!r}); print('bound', flush=True); sys.stdin.read()\n")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert router.stdout is not None and router.stdout.readline() == "bound\n"
            before = _status(router.pid, "VmRSS")
            sender = threading.Thread(target=_zmtp_flood, args=(endpoint, [bytes(limit)] * 12),
                                      daemon=True)
            sender.start()  # blocks once libzmq stops reading; ends with the router
            samples = [before]
            while len(samples) < 20 or samples[-20] != samples[-1]:  # until it settled
                time.sleep(0.05)
                samples.append(_status(router.pid, "VmRSS"))
                assert len(samples) < 2000, "the router's memory never settled"
            held = samples[-1] - before
        finally:
            router.kill()
            router.wait()
    print(f"RCVHWM {RCVHWM_FRAMES}: twelve unread 8 MiB frames held {held / MiB:.1f} MiB")
    assert held <= (RCVHWM_FRAMES + 1) * limit + 4 * MiB
    assert held >= RCVHWM_FRAMES * limit  # it does buffer: the measurement sees frames


def test_worst_frames_under_the_limit_stay_within_the_documented_bound(
        tmp_path: Path) -> None:
    """Frames a little under max_message_bytes whose decoded form is the largest per byte,
    sixteen of them queued at once by one peer: the daemon's peak grows by at most the
    bound (and by far less than sixteen frames' decoded forms)."""
    limit = 2 * MiB

    def frame(rid: int, n: int) -> bytes:
        return msgspec.msgpack.encode(p.PrepareStore(rid=rid, engine=0, items=[
            p.StoreItem(key=make_key(H[0], 0), end_token=16, token_ids=[-32] * n)]))

    n = limit - len(frame(15, 0)) - 8  # every byte but the envelope: one negative int
    frames = [frame(i, n) for i in range(16)]
    assert all(limit - 1024 < len(f) <= limit for f in frames)
    with run_daemon(tmp_path, env={"KVOFFLOAD_MAX_MESSAGE_BYTES": str(limit)}) as d:
        before = _reset_peak(d)
        sock = _dealer(d)
        for f in frames:
            sock.send(f, copy=False)
        replies = _replies(sock, len(frames))
        grown = _peak(d) - before
        sock.close()
    print(f"16 worst 2 MiB frames: peak +{grown / MiB:.1f} MiB, bound {_bound(limit) / MiB:.0f}")
    assert all(isinstance(r, p.Error) and r.code == p.ErrorCode.NOT_REGISTERED
               for r in replies), replies[:2]
    assert grown <= _bound(limit), f"grew {grown / MiB:.0f} MiB, bound {_bound(limit) / MiB:.0f}"
    assert grown < 4 * DECODE_PER_BYTE * limit  # never several decoded frames at once


def _big_parking_lookup(rid: int, engine: int) -> p.Lookup:
    """A lookup of ~2 MiB that parks: every query's first chunk is pending."""
    q = query()
    queries = [msgspec.structs.replace(q, req_id=f"r{i}") for i in range(6400)]
    return p.Lookup(rid=rid, engine=engine, queries=queries, wait_ms=120_000)


def test_parked_lookups_hold_at_most_their_byte_budget(tmp_path: Path) -> None:
    with run_daemon(tmp_path, "--lease-ms", "60000", slot_bytes=1024) as d:
        writer = DaemonClient(d.control, timeout_ms=20_000)
        writer.register(EXAMPLE)
        chunk = [make_key(H[3], 0), make_key(H[3], 1)]  # what query() hits first
        assert writer.prepare_store([p.StoreItem(key=k, end_token=16) for k in chunk]
                                    ).outcomes == [p.StoreOutcome.GRANTED] * 2
        sock = _dealer(d)
        sock.send(p.encoder.encode(p.Register(rid=1, geometry=EXAMPLE)))
        (registered,) = _replies(sock, 1)
        assert isinstance(registered, p.Registered)
        lookups = [p.encoder.encode(_big_parking_lookup(100 + i, registered.engine))
                   for i in range(32)]
        size = len(lookups[0])
        parks = 1 + (PARKED_BYTES_PER_CLIENT - size) // size  # the first one always parks
        before = _reset_peak(d)
        for f in lookups:
            sock.send(f, copy=False)
        refused = _replies(sock, len(lookups) - parks)  # at once; the parked ones wait
        grown = _peak(d) - before
        assert all(isinstance(r, p.Error) and r.code == p.ErrorCode.TOO_LARGE
                   and "parked" in r.message for r in refused), refused[:1]
        assert metric_sum(scrape_metrics(d.http_url), "kvoffload_refused_total",
                          reason="parked_bytes") == len(lookups) - parks
        assert writer.commit_store(chunk) == 2  # the parked ones are answered now
        answered = _replies(sock, parks)
        assert all(isinstance(r, p.LookupReply) and r.answers[0].hit_tokens == 16
                   for r in answered)
        writer.close()
        sock.close()
    held = parks * size * 13 + SLACK  # decoded lookups take up to 13x their frames
    print(f"32 lookups of {size / MiB:.1f} MiB, {parks} parked: peak +{grown / MiB:.1f} MiB")
    assert grown <= held, f"grew {grown / MiB:.0f} MiB with {parks} of 32 lookups parked"


def test_prepare_store_caps_token_ids_as_a_step_does(tmp_path: Path) -> None:
    """An item with more token ids than MAX_ITEM_TOKENS (a client held +486 MB through
    them, kept until the commit for events) is refused before anything is prepared."""
    with run_daemon(tmp_path, slot_bytes=1024) as d:
        c = DaemonClient(d.control, timeout_ms=60_000)
        engine = c.register(EXAMPLE).engine
        key, other = make_key(H[0], 0), make_key(H[1], 0)
        too_many = c.call(p.PrepareStore(rid=c.rid(), engine=engine, items=[
            p.StoreItem(key=other, end_token=16),
            p.StoreItem(key=key, end_token=16, token_ids=[1] * (MAX_ITEM_TOKENS + 1))]))
        assert isinstance(too_many, p.Error) and too_many.code == p.ErrorCode.BAD_REQUEST
        assert str(MAX_ITEM_TOKENS) in too_many.message
        assert c.probe([key, other]) == [KeyStatus.MISS] * 2  # a bad request changed nothing
        assert metric_sum(scrape_metrics(d.http_url), "kvoffload_refused_total",
                          reason="token_ids") == 1
        grant = c.prepare_store([p.StoreItem(key=key, end_token=16,
                                             token_ids=[1] * MAX_ITEM_TOKENS)])
        assert grant.outcomes == [p.StoreOutcome.GRANTED]  # at the cap: accepted
        c.close()
