"""Clients that die mid-store or mid-load leave nothing behind once their lease runs out.

In-process: 10,000 client lifetimes on raw DEALER sockets that hold pending stores and load
pins, then vanish without a goodbye (socket closed, as a SIGKILLed process's would be), in
batches. Out of process: real clients SIGKILLed mid-store and mid-load. After each batch the
pool is exactly where it was: no pending slot, no stray pin, the same free and ready counts.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from kvoffload.bench.suites.load import metric_sum, scrape_metrics
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import make_key
from kvoffload.daemon.config import load_config
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.ops.loop_health import has_unread

from tests.daemon.test_server import EXAMPLE, store
from tests.daemon_helpers import run_daemon, server_in_thread

CYCLES = int(os.environ.get("KVO_DEATH_CYCLES", "10000"))
BATCH = 500  # clients alive at once (max_clients is 1024)
LEASE_MS = 100  # the shortest lease the daemon grants: dead clients expire fast


def _usage(c: DaemonClient) -> dict[str, Any]:
    s = c.stats()
    return {k: s[k] for k in ("ready", "pending", "pinned", "free_slots", "clients")}


def _settled(c: DaemonClient, want: dict[str, Any], timeout: float = 20.0) -> dict[str, Any]:
    """Poll until usage is back to ``want`` (leases expire on the sweeper's clock)."""
    deadline = time.monotonic() + timeout
    while True:
        now = _usage(c)
        if now == want or time.monotonic() > deadline:
            return now
        time.sleep(0.02)


def _die_in_batch(endpoint: str, first: int, n: int, ready_keys: list[bytes]) -> dict[str, int]:
    """``n`` clients each prepare 2 new keys and pin 2 ready ones, then vanish."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    socks = []
    for i in range(first, first + n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        new = [make_key(hashlib.sha256(f"dead-{i}".encode()).digest(), g) for g in (0, 1)]
        pins = [ready_keys[i % len(ready_keys)], ready_keys[(i + 1) % len(ready_keys)]]
        # Pipelined on one connection: the daemon handles them in order.
        for msg in (p.Hello(rid=1, version=p.PROTOCOL_VERSION, client=f"doomed {i}",
                            lease_ms=LEASE_MS),
                    p.Register(rid=4, geometry=EXAMPLE),  # handles are per client
                    p.PrepareStore(rid=2, engine=0, items=[p.StoreItem(key=k, end_token=16)
                                                           for k in new]),
                    p.PinLoad(rid=3, engine=0, keys=pins)):
            s.send(p.encoder.encode(msg))
        socks.append(s)
    held = {"granted": 0, "pinned": 0}
    for s in socks:
        for _ in range(4):
            assert s.poll(20_000), "the daemon stopped answering"
            reply = p.reply_decoder.decode(s.recv())
            if isinstance(reply, p.StoreGrant):
                held["granted"] += reply.outcomes.count(p.StoreOutcome.GRANTED)
            elif isinstance(reply, p.LoadGrant):
                held["pinned"] += sum(slot >= 0 for slot in reply.slots)
            else:
                # Its frames were sent at once, inside its 100 ms lease, but the daemon reads
                # them a round of its 500 peers apart (ROUTER fair-queues), more than a lease
                # apart on a loaded box: the sweeper must judge it on what it sent, not on
                # what is still unread, so no lease runs out inside the pipeline (an Error
                # here is ``not_registered``: its handle went with an expired lease).
                assert isinstance(reply, (p.Welcome, p.Registered)), reply
        s.close(linger=0)  # death: no Bye, no commit, no complete_load
    return held


def test_ten_thousand_dead_clients_leak_nothing(tmp_path) -> None:
    with run_daemon(tmp_path, "--lease-ms", "400", pool_bytes=64 << 20, slot_bytes=1024) as d:
        c = DaemonClient(d.control, timeout_ms=10_000, lease_ms=60_000)
        c.register(EXAMPLE)
        ready_keys = [make_key(hashlib.sha256(f"kept-{i}".encode()).digest(), 0)
                      for i in range(64)]
        slots = store(c, ready_keys)
        baseline = _usage(c)
        m0 = scrape_metrics(d.http_url)
        granted = pinned = 0
        for first in range(0, CYCLES, BATCH):
            held = _die_in_batch(d.control, first, min(BATCH, CYCLES - first), ready_keys)
            assert held["granted"] > 0 and held["pinned"] > 0  # they died holding things
            granted += held["granted"]
            pinned += held["pinned"]
            assert _settled(c, baseline) == baseline, f"leak after {first + BATCH} cycles"
        m1 = scrape_metrics(d.http_url)

        def delta(name: str, **labels: str) -> float:
            return metric_sum(m1, name, **labels) - metric_sum(m0, name, **labels)

        assert granted == 2 * CYCLES and pinned == 2 * CYCLES
        assert delta("kvoffload_leases_expired_total") == CYCLES
        assert delta("kvoffload_expired_pins_total") == pinned
        assert delta("kvoffload_stores_total", outcome="expired") == granted
        assert c.pin_load(ready_keys) == slots  # the kept blocks are intact
        c.close()


_DOOMED = """
import hashlib, sys, time
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.base import make_key
sys.path.insert(0, {root!r})
from tests.daemon.test_server import EXAMPLE
c = DaemonClient({endpoint!r}, timeout_ms=10_000, lease_ms=1000)
c.register(EXAMPLE)
new = [make_key(hashlib.sha256(b"killed-%d" % {n}).digest(), 0)]
grant = c.prepare_store([p.StoreItem(key=k, end_token=16) for k in new])
slots = c.pin_load({pins!r})
assert grant.outcomes == [p.StoreOutcome.GRANTED] and min(slots) >= 0, (grant, slots)
print("holding", flush=True)
while True:  # alive until killed, as an engine is: its lease must not run out by itself
    c.heartbeat()
    time.sleep(0.1)
"""


def test_sigkilled_clients_mid_store_and_mid_load(tmp_path) -> None:
    with run_daemon(tmp_path, "--lease-ms", "400", slot_bytes=1024) as d:
        c = DaemonClient(d.control, timeout_ms=10_000, lease_ms=60_000)
        c.register(EXAMPLE)
        ready_keys = [make_key(hashlib.sha256(f"kept-{i}".encode()).digest(), 0)
                      for i in range(4)]
        store(c, ready_keys)
        baseline = _usage(c)
        root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
        procs = [subprocess.Popen([sys.executable, "-c", _DOOMED.format(
            root=root, endpoint=d.control, n=n, pins=ready_keys[n % 4:n % 4 + 1])],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in range(4)]
        try:
            for proc in procs:
                assert proc.stdout is not None
                line = proc.stdout.readline()
                assert line == b"holding\n", (line, proc.stderr.read() if proc.stderr else b"")
            during = _usage(c)
            assert (during["pending"], during["pinned"]) == (4, 4)
            for proc in procs:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert _settled(c, baseline) == baseline
        c.close()



def _until(cond: Callable[[], Any], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_unread_frames_keep_a_lease_until_read(tmp_path) -> None:
    """The receive loop is stopped, so a client's heartbeat waits unread in the socket while
    its lease runs out by the clock: the sweeper does not judge it before the frame is read,
    and once read the heartbeat renews it. An unread socket defers expiry only so long (10 x
    the daemon's lease, the bound for a flood): then the client expires, its pin released."""
    work = Path(tempfile.mkdtemp(prefix="kvo-"))  # ipc paths stay short
    config = load_config(flags={
        "control": f"ipc://{work}/c.sock", "pool_path": f"/dev/shm/kvoffload-test-{work.name}",
        "pool_bytes": 1 << 20, "slot_bytes": 1024, "http": "127.0.0.1:0", "prefault": False,
        "lease_ms": 400})  # clients ask for 100 ms; the flood bound is 4 s
    try:
        with server_in_thread(config) as (server, loop):
            _unread_frames(server, loop, config)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _unread_frames(server: Any, loop: Any, config: Any) -> None:
    def on_loop(fn: Callable[[], Any]) -> Any:
        async def call() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), loop).result(10)

    def reading(on: bool) -> None:
        if on:
            on_loop(lambda: server._loops.__setitem__(
                0, asyncio.get_running_loop().create_task(server._serve_control())))
        else:
            on_loop(lambda: server._loops[0].cancel())
            _until(lambda: on_loop(lambda: server._loops[0].done()))

    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(config.control)
    key = make_key(hashlib.sha256(b"held").digest(), 0)

    def ask(msg: Any) -> Any:
        sock.send(p.encoder.encode(msg))
        assert sock.poll(10_000), msg
        return p.reply_decoder.decode(sock.recv())

    try:
        assert isinstance(ask(p.Hello(rid=1, version=p.PROTOCOL_VERSION, client="slow",
                                      lease_ms=100)), p.Welcome)
        engine = ask(p.Register(rid=2, geometry=EXAMPLE)).engine
        grant = ask(p.PrepareStore(rid=3, engine=engine,
                                   items=[p.StoreItem(key=key, end_token=16)]))
        assert grant.outcomes == [p.StoreOutcome.GRANTED]
        (client,) = server.service.leases.clients.values()
        reading(False)
        sock.send(p.encoder.encode(p.Heartbeat(rid=4)))  # sent inside its lease
        _until(lambda: on_loop(lambda: has_unread(server._sock)))
        _until(lambda: time.monotonic() > client.expires_at())
        # Its lease ran out by the clock, but a frame of its waits unread: not judged yet.
        assert on_loop(lambda: server.service.expire_leases(server.lease_cutoff())) == 0
        reading(True)
        assert sock.poll(10_000)
        assert isinstance(p.reply_decoder.decode(sock.recv()), p.Ack)
        assert server.service.leases.clients.get(client.identity) is client  # renewed
        assert ask(p.CommitStore(rid=5, engine=engine, keys=[key], ok=True)).count == 1
        assert ask(p.PinLoad(rid=6, engine=engine, keys=[key])).slots[0] >= 0

        # Unread for longer than the flood bound: expired after all, its pin released.
        reading(False)
        sock.send(p.encoder.encode(p.Heartbeat(rid=7)))
        _until(lambda: client.identity not in server.service.leases.clients)
        assert server.service.index.n_pinned == 0
        assert metric_sum(scrape_metrics(server.http.url),
                          "kvoffload_leases_expired_total") == 1
        reading(True)
    finally:
        sock.close(linger=0)
