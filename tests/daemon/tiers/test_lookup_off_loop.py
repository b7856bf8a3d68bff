"""Issue 16: a long lookup on a daemon with a tier is scanned off the event loop.

The disk tier's membership check is made controllable (it blocks until the test opens a
gate), so the order of events shows where the scan runs: another client is answered while
the long query is still being scanned, and the long query is answered only once the gate
opens. On the loop, the other client would get no answer until then.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

import zmq
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec
from kvoffload.daemon.config import load_config
from kvoffload.daemon.control import protocol as p

from tests.daemon_helpers import server_in_thread

GEOM = Geometry(namespace="off-loop", groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16, 1024),),
                tokens_per_hash=16)
HASHES = 20_000  # over the slicing bar and the thread bar (lookups.py)


def test_a_long_query_on_a_tier_daemon_does_not_hold_the_loop() -> None:
    work = Path(tempfile.mkdtemp(prefix="kvo-"))
    pool = f"/dev/shm/kvoffload-test-{uuid.uuid4().hex[:12]}"
    config = load_config(flags={
        "control": f"ipc://{work}/control.sock", "pool_path": pool, "pool_bytes": 1 << 20,
        "slot_bytes": 1024, "http": "127.0.0.1:0", "prefault": False,
        "disk_dir": str(work / "disk"), "disk_bytes": 1 << 20})
    try:
        with server_in_thread(config) as (server, _loop):
            _check_off_loop(server, config)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for suffix in ("", ".index", ".index.readers"):
            Path(pool + suffix).unlink(missing_ok=True)


def _check_off_loop(server: Any, config: Any) -> None:
    assert server.tiers is not None
    disk: Any = server.tiers.tiers[0]
    gate, asked = threading.Event(), threading.Event()
    real_contains = disk.contains

    def slow_contains(ns: Any, key: bytes) -> bool:
        if not asked.is_set():  # the first question to the tier waits for the gate
            asked.set()
            gate.wait(20)
        return bool(real_contains(ns, key))

    disk.contains = slow_contains
    ctx: zmq.Context[Any] = zmq.Context.instance()
    long_sock = ctx.socket(zmq.DEALER)
    long_sock.setsockopt(zmq.LINGER, 0)
    other = DaemonClient(config.control, timeout_ms=5000, name="other")
    try:
        long_sock.connect(config.control)
        blob = b"".join(hashlib.sha256(b"%d" % i).digest() for i in range(HASHES))
        for msg in (p.Hello(rid=1, version=p.PROTOCOL_VERSION, client="long"),
                    p.Register(rid=2, geometry=GEOM)):
            long_sock.send(p.encoder.encode(msg))
            assert long_sock.poll(10_000)
            reply = p.reply_decoder.decode(long_sock.recv())
            assert not isinstance(reply, p.Error), reply
        assert isinstance(reply, p.Registered)
        long_sock.send(p.encoder.encode(p.Lookup(rid=3, engine=reply.engine, queries=[
            p.LookupQuery(req_id="long", hash_blob=blob, hash_bytes=32, num_tokens=16 * HASHES,
                          num_prompt_tokens=16 * HASHES)])))
        assert asked.wait(20), "the tier was never asked"
        # The tier is blocked inside the long query's scan; another client is answered now.
        other.register(GEOM)
        assert other.stats()["namespaces"] == 1
        assert long_sock.poll(0) == 0  # ... and the long query is still not answered
        gate.set()
        assert long_sock.poll(20_000)
        answer = p.reply_decoder.decode(long_sock.recv())
        assert isinstance(answer, p.LookupReply), answer
        assert answer.answers[0].hit_tokens == 0  # nothing stored: a miss, same as on the loop
    finally:
        gate.set()
        other.close()
        long_sock.close(linger=0)
