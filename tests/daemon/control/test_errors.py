"""Bad input gets a typed error, changes nothing, and the daemon keeps serving."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, make_key
from kvoffload.daemon.control import protocol as p

from tests.daemon.test_server import EXAMPLE, H, query, store
from tests.daemon_helpers import run_daemon


def raw_call(endpoint: str, frames: list[bytes], timeout_ms: int = 5000) -> p._Msg | None:
    ctx: zmq.Context[Any] = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send_multipart(frames)
        if not s.poll(timeout_ms):
            return None
        return p.reply_decoder.decode(s.recv())
    finally:
        s.close()


@pytest.fixture
def daemon(tmp_path):
    with run_daemon(tmp_path) as d:
        yield d


def _error(reply: p._Msg | None) -> p.Error:
    assert isinstance(reply, p.Error), reply
    return reply


def test_garbage_and_unknown_ops_get_typed_errors(daemon) -> None:
    c = DaemonClient(daemon.control, timeout_ms=5000)
    c.register(EXAMPLE)
    store(c, [make_key(H[3], 0), make_key(H[3], 1)])
    before = c.stats()
    assert _error(raw_call(daemon.control, [b"\xff\x00garbage"])).code == p.ErrorCode.MALFORMED
    unknown = msgspec.msgpack.encode({"op": "format_disk", "rid": 7})
    err = _error(raw_call(daemon.control, [unknown]))
    assert (err.code, err.rid) == (p.ErrorCode.MALFORMED, 7)
    wrong_type = msgspec.msgpack.encode({"op": "lookup", "rid": 8, "engine": "zero",
                                         "queries": []})
    assert _error(raw_call(daemon.control, [wrong_type])).rid == 8
    assert _error(raw_call(daemon.control, [b"a", b"b"])).code == p.ErrorCode.MALFORMED
    assert c.stats()["ready"] == before["ready"]
    assert c.lookup([query()])[0].hit_tokens == 16  # still serving, nothing lost
    c.close()


@pytest.mark.parametrize("bad, code", [
    (p.Lookup(rid=1, engine=99, queries=[]), p.ErrorCode.NOT_REGISTERED),
    (p.Probe(rid=1, engine=0, keys=[b"\x01"]), p.ErrorCode.BAD_REQUEST),
    (p.Probe(rid=1, engine=0, keys=[make_key(H[0], 7)]), p.ErrorCode.BAD_REQUEST),
    (p.Lookup(rid=1, engine=0, queries=[p.LookupQuery(
        req_id="x", block_hashes=H, num_tokens=8, num_prompt_tokens=8)]),
     p.ErrorCode.BAD_REQUEST),
    (p.Lookup(rid=1, engine=0, queries=[p.LookupQuery(
        req_id="x", block_hashes=H, num_tokens=30, num_prompt_tokens=30, local_tokens=31)]),
     p.ErrorCode.BAD_REQUEST),
    (p.Hello(rid=1, version=999), p.ErrorCode.UNSUPPORTED_VERSION),
    (p.Register(rid=1, geometry=Geometry(namespace="bad", groups=(GroupSpec(
        kind=GroupKind.FULL_ATTENTION, tokens_per_block=10, bytes_per_block=64),),
        tokens_per_hash=4)), p.ErrorCode.BAD_REQUEST),
    (p.Register(rid=1, geometry=EXAMPLE, rank=3), p.ErrorCode.BAD_REQUEST),
])
def test_out_of_range_requests(daemon, bad: p._Msg, code: p.ErrorCode) -> None:
    c = DaemonClient(daemon.control, timeout_ms=5000)
    c.register(EXAMPLE)
    reply = c.call(bad)
    assert isinstance(reply, p.Error) and reply.code == code, reply
    assert c.lookup([query()])[0].hit_tokens == 0
    c.close()


def test_geometry_conflict_and_too_many_keys(tmp_path) -> None:
    with run_daemon(tmp_path, slot_bytes=1024) as d:
        c = DaemonClient(d.control, timeout_ms=5000)
        c.register(EXAMPLE)
        other = msgspec.structs.replace(EXAMPLE, tokens_per_hash=8)
        with pytest.raises(p.ProtocolError) as exc:
            DaemonClient(d.control).register(other)
        assert exc.value.code == p.ErrorCode.GEOMETRY_MISMATCH
        huge = msgspec.structs.replace(EXAMPLE, namespace="huge", groups=(GroupSpec(
            kind=GroupKind.FULL_ATTENTION, tokens_per_block=16, bytes_per_block=4096),))
        with pytest.raises(p.ProtocolError) as exc:
            DaemonClient(d.control).register(huge)
        assert "bytes" in exc.value.message
        reply = c.call(p.Probe(rid=5, engine=0, keys=[make_key(H[0], 0)] * 70_000))
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.TOO_LARGE
        c.close()


def test_slots_that_do_not_split_among_the_ranks_are_refused_at_registration(tmp_path) -> None:
    # 3 ranks of 256 B pages fit a 1024 B slot, but 1024 does not split into 3 equal pages:
    # the workers would refuse every job, so the engine is refused before its first step.
    three = msgspec.structs.replace(EXAMPLE, namespace="tp3", tp_world_size=3)
    assert three.slot_bytes() <= 1024
    with run_daemon(tmp_path, slot_bytes=1024) as d:
        c = DaemonClient(d.control, timeout_ms=5000)
        with pytest.raises(p.ProtocolError) as exc:
            c.register(three, rank=1)
        assert exc.value.code == p.ErrorCode.GEOMETRY_MISMATCH
        assert "3 equal rank pages" in exc.value.message and "\n" not in exc.value.message
        c.close()
        two = DaemonClient(d.control, timeout_ms=5000)  # an even split registers
        two.register(msgspec.structs.replace(EXAMPLE, namespace="tp2", tp_world_size=2), rank=1)
        two.close()


def test_hashes_that_cannot_cover_the_request(daemon) -> None:
    c = DaemonClient(daemon.control, timeout_ms=5000)
    c.register(EXAMPLE)
    short = p.LookupQuery(req_id="s", block_hashes=H[:2], num_tokens=30, num_prompt_tokens=30)
    with pytest.raises(p.ProtocolError) as exc:
        c.lookup([short])
    assert exc.value.code == p.ErrorCode.BAD_REQUEST and "'s'" in exc.value.message
    assert c.lookup([query()])[0].hit_tokens == 0
    c.close()


def test_an_engine_handle_another_client_registered_is_not_this_clients(daemon) -> None:
    """Handles are per client: one client using another's names that client's namespace
    (another model's blocks, its stores): refused, nothing stored or read there."""
    a, b = (DaemonClient(daemon.control, timeout_ms=5000) for _ in range(2))
    mine = a.register(EXAMPLE).engine
    other = Geometry(namespace="another model", groups=EXAMPLE.groups,
                     tokens_per_hash=EXAMPLE.tokens_per_hash)
    assert b.register(other).engine != mine  # b has a handle of its own, to another namespace
    keys = [make_key(H[5], 0)]
    item = p.StoreItem(key=keys[0], end_token=16)
    for msg in (p.PrepareStore(rid=b.rid(), engine=mine, items=[item]),
                p.Step(rid=b.rid(), engine=mine, epoch=0, reserve=1),
                p.Lookup(rid=b.rid(), engine=mine, queries=[query()])):
        assert _error(b.call(msg)).code == p.ErrorCode.NOT_REGISTERED
    assert a.stats()["pending"] == 0 and a.stats()["ready"] == 0  # nothing stored or held
    a.close()
    b.close()
