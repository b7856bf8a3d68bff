"""Fuzzing: the decoders (hypothesis) and a live daemon (random and mutated frames).

The live run sends ``FUZZ_FRAMES`` frames (100,000 by default; ``KVO_FUZZ_FRAMES``
overrides) over one DEALER, pipelined with a bounded in-flight window, then checks that the
daemon is alive, that every frame was answered (typed errors for every invalid one, counted in
``kvoffload_protocol_errors_total``) and that invalid requests changed nothing in the index.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import urllib.request
from collections import Counter
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvoffload.bench.suites.load import metric_sum, scrape_metrics
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, KeyStatus, make_key
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.server import _salvage_rid
from kvoffload.events import schema

from tests.daemon.test_server import EXAMPLE, H, query, store
from tests.daemon_helpers import run_daemon

FUZZ_FRAMES = int(os.environ.get("KVO_FUZZ_FRAMES", "100000"))
MAX_MESSAGE = 64 << 10  # daemon limit in this test: oversize frames stay cheap to build
MAX_KEYS = 256
WINDOW = 256  # frames in flight

# ------------------------------------------------------------------ decoders (hypothesis)

_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
            | st.text(max_size=20) | st.binary(max_size=40))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=5)
                       | st.dictionaries(st.text(max_size=12), inner, max_size=5),
                       max_leaves=25)
_OPS = ["hello", "register", "lookup", "probe", "prepare_store", "commit_store", "pin_load",
        "complete_load", "touch", "heartbeat", "stats", "reset", "bye", "error", "nope"]
_requestish = st.fixed_dictionaries(
    {"op": st.sampled_from(_OPS), "rid": st.integers(-(2**63), 2**64 - 1) | _scalars},
    optional={k: _values for k in ("engine", "keys", "items", "queries", "geometry", "version",
                                   "wait_ms", "pin", "ok", "rank", "lease_ms", "client")})
_batchish = st.lists(_values, max_size=4) | st.fixed_dictionaries(
    {"ts": _values, "events": st.lists(_values, max_size=4)},
    optional={"schema_version": _values})


def _payloads(structured: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return st.binary(max_size=200) | structured.map(msgspec.msgpack.encode)


_FAST = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))


@_FAST
@given(_payloads(_requestish))
def test_request_and_reply_decoders_raise_only_decode_errors(payload: bytes) -> None:
    for decoder in (p.request_decoder, p.reply_decoder):
        with contextlib.suppress(msgspec.DecodeError):  # ValidationError is a DecodeError
            decoder.decode(payload)
    assert isinstance(_salvage_rid(payload), int)  # the server's rid salvage never raises


@_FAST
@given(_payloads(_batchish))
def test_event_decoders_raise_only_malformed_payload(payload: bytes) -> None:
    for decode in (schema.decode_batch, schema.decode_lookup_batch):
        with contextlib.suppress(schema.MalformedPayload):  # UnsupportedSchemaVersion is one
            decode(payload)


# ------------------------------------------------------------------------ frame mutator

FUZZ_ENGINE = 1
FUZZ_GEOMETRY = msgspec.structs.replace(EXAMPLE, namespace="fuzz")
_K = [make_key(h, g) for h in H for g in (0, 1)]
TEMPLATES: list[p._Msg] = [
    p.Hello(rid=1, version=p.PROTOCOL_VERSION, client="fuzz", lease_ms=60_000),
    p.Register(rid=2, geometry=FUZZ_GEOMETRY),
    p.Lookup(rid=3, engine=FUZZ_ENGINE, queries=[query("a"), query("b", local=16)], pin=True),
    p.Probe(rid=4, engine=FUZZ_ENGINE, keys=_K[:4]),
    p.PrepareStore(rid=5, engine=FUZZ_ENGINE, items=[
        p.StoreItem(key=k, end_token=16, token_ids=[1, 2], block_hashes=[H[0]],
                    parent_hash=H[1], lora_name="l") for k in _K[:3]]),
    p.CommitStore(rid=6, engine=FUZZ_ENGINE, keys=_K[:3]),
    p.CommitStore(rid=7, engine=FUZZ_ENGINE, keys=_K[3:5], ok=False),
    p.PinLoad(rid=8, engine=FUZZ_ENGINE, keys=_K[:3]),
    p.CompleteLoad(rid=9, engine=FUZZ_ENGINE, keys=_K[:3]),
    p.Touch(rid=10, engine=FUZZ_ENGINE, keys=_K[:2]),
    p.Heartbeat(rid=11), p.Stats(rid=12), p.Reset(rid=13, engine=FUZZ_ENGINE),
    p.Bye(rid=14),
    p.Step(rid=15, engine=FUZZ_ENGINE, epoch=3, pins=[p.SlotRef(_K[0], 1, 1)],
           releases=[p.SlotRef(_K[0], 1, 1)], claims=[p.StoreClaim(
               item=p.StoreItem(key=_K[1], end_token=16, token_ids=[1]), slot=2, gen=1)],
           commits=[p.SlotRef(_K[1], 2, 1)], reserve=4, finds=_K[2:4],
           lookups=[p.LookupReport(req_id="r", num_tokens=32, hit_tokens=16)]),
]
_ENCODED = [p.encoder.encode(m) for m in TEMPLATES]
_ODD: list[Any] = [None, True, False, -1, 0, 2**63 - 1, 2**64 - 1, -(2**63), 1.5, float("nan"),
                   "", "x" * 300, b"", b"\x00" * 5, [], [1, 2, 3], {"a": 1}, {"op": "hello"},
                   [[[[[]]]]], "lookup", H[0], make_key(H[0], 2**32 - 1)]


def _slots(obj: Any) -> list[tuple[Any, Any]]:
    """Every (container, key-or-index) inside a decoded message, for structural mutation."""
    out: list[tuple[Any, Any]] = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for k, v in items:
        out.append((obj, k))
        if isinstance(v, (dict, list)) and v:
            out.extend(_slots(v))
    return out


_INTS = [0, 1, -1, 2, 3, 4, 15, 16, 17, 31, 64, 255, 256, 2**16, 2**31 - 1, 2**32 - 1, 2**32,
         2**63 - 1, -(2**63), 2**64 - 1]


def _same_type(rng: random.Random, v: Any) -> Any:
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return rng.choice(_INTS + [v + rng.randrange(-3, 4)])
    if isinstance(v, bytes):
        return rng.choice([b"", v[:-1], v + b"\x00", rng.randbytes(len(v)), make_key(v[:32], 1),
                           make_key(v[:32], rng.choice([2, 2**32 - 1])), v * 5])
    if isinstance(v, str):
        return rng.choice(["", v * 50, "\x00", "\udcff"[:0] + "é" * 3, v.upper()])
    if isinstance(v, list) and v:
        return rng.choice([[], v[::-1], v + v, v[:1] * rng.randrange(2, 40)])
    return v


def _structural(rng: random.Random) -> bytes:
    obj = msgspec.msgpack.decode(rng.choice(_ENCODED))  # a fresh, mutable copy
    container, k = rng.choice(_slots(obj))
    action = rng.randrange(6)
    if action == 0 and isinstance(container, dict):
        del container[k]
    elif action == 1:  # huge lists: over the key limit, or long lists of junk
        n = rng.choice([MAX_KEYS + 1, rng.randrange(1, 2 * MAX_KEYS)])
        v = container[k]
        container[k] = (v * n)[:n] if isinstance(v, list) and v else [v] * n
    elif action == 2 and isinstance(container, dict):
        container[rng.choice(["op", "extra", "rid", "engine"])] = rng.choice(_ODD + _OPS)
    elif action in (3, 4):  # same type, other value: decodes, so handlers see it
        container[k] = _same_type(rng, container[k])
    else:
        container[k] = rng.choice(_ODD)
    try:
        return msgspec.msgpack.encode(obj)
    except (OverflowError, TypeError):
        return rng.choice(_ENCODED)


def _bytewise(rng: random.Random) -> bytes:
    b = bytearray(rng.choice(_ENCODED))
    action = rng.randrange(6)
    if action == 0:  # bit flips
        for _ in range(rng.randrange(1, 8)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif action == 1:  # truncation
        del b[rng.randrange(len(b)):]
    elif action == 2:  # insertion
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randrange(1, 9))
    elif action == 3:  # a length header claiming far more than there is
        i = rng.randrange(len(b))
        b[i:i + 1] = rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdc\xff\xff", b"\xdf\x7f\xff\xff\xff",
                                 b"\xc6\xff\xff\xff\xf0", b"\xcf" + b"\xff" * 8])
    elif action == 4:  # splice two messages
        other = rng.choice(_ENCODED)
        b = b[:rng.randrange(len(b))] + other[rng.randrange(len(other)):]
    else:  # byte substitution
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


_DEPTHS = [2000, 5000, 20_000, 50_000]  # always past the interpreter's recursion limit
_ENGINES = [2, 77, 4096, 2**16, 2**31 - 1, 2**63 - 1, -1, -(2**63)]


def _hostile(rng: random.Random) -> bytes:
    """Frames an attacker builds on purpose (issue 16): deep nesting, huge token_ids in a
    store item, engine ids nobody registered."""
    action = rng.randrange(3)
    if action == 0:  # nested far beyond any real message: in an unknown field, or whole
        depth = rng.choice(_DEPTHS)
        deep = (b"\x91" if rng.random() < 0.5 else b"\x81\xa1k") * depth + b"\xc0"
        if rng.random() < 0.5:
            return deep
        base = rng.choice(_ENCODED)  # a fixmap: one more key holding the nesting
        return bytes([base[0] + 1]) + base[1:] + b"\xa5extra" + deep
    if action == 1:  # one item whose token_ids fill most of the message limit
        n = rng.randrange(MAX_MESSAGE // 4, MAX_MESSAGE - 1024)
        return msgspec.msgpack.encode(p.PrepareStore(rid=21, engine=FUZZ_ENGINE, items=[
            p.StoreItem(key=_K[rng.randrange(len(_K))], end_token=16, token_ids=[7] * n)]))
    obj = msgspec.msgpack.decode(rng.choice([e for e, m in zip(_ENCODED, TEMPLATES,
                                                               strict=True)
                                             if hasattr(m, "engine")]))
    obj["engine"] = rng.choice(_ENGINES)
    return msgspec.msgpack.encode(obj)


def mutated_frames(rng: random.Random) -> list[bytes]:
    """One fuzz message: usually one frame, sometimes extra frames or an oversize one."""
    r = rng.random()
    if r < 0.15:
        frame = rng.randbytes(rng.randrange(0, 64))
    elif r < 0.55:
        frame = _bytewise(rng)
    elif r < 0.94:
        frame = _structural(rng)
    elif r < 0.97:
        frame = _hostile(rng)
    elif r < 0.985:  # over max_message_bytes (under the 2x disconnect cap)
        frame = rng.choice(_ENCODED) + rng.randbytes(MAX_MESSAGE)
    else:
        return [rng.choice(_ENCODED), *[rng.randbytes(4) for _ in range(rng.randrange(1, 4))]]
    # Over MAXMSGSIZE (2x the limit) ZMQ drops the connection and every reply in flight with
    # it; that case has its own test. Longer frames are cut: still answered TOO_LARGE.
    return [frame[:2 * MAX_MESSAGE]]


# ------------------------------------------------------------------------ live daemon


def _classify(frames: list[bytes]) -> tuple[str, p._Msg | None]:
    """What the daemon must do with a message, decided with its own decoder and limits."""
    if len(frames) > 1:
        return "multi", None
    if len(frames[0]) > MAX_MESSAGE:
        return "oversize", None
    try:
        return "decodable", p.request_decoder.decode(frames[0])
    except (msgspec.DecodeError, RecursionError):  # too deep: the daemon says malformed too
        return "undecodable", None


def _skip(msg: p._Msg | None) -> bool:
    """Frames that would legitimately touch the checker's state, or park for a long time."""
    if getattr(msg, "engine", None) == 0:  # the checker's namespace: fuzzing stays out
        return True
    return isinstance(msg, p.Lookup) and msg.wait_ms > 0  # would park until a key resolves


def _fuzz(sock: zmq.Socket[Any], n: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    kinds: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    sent = replies = skipped = 0
    registered: list[Any] = []  # geometries the fuzz frames may have registered
    while sent < n or replies < sent:
        while sent < n and sent - replies < WINDOW:
            frames = mutated_frames(rng)
            kind, msg = _classify(frames)
            if _skip(msg):
                skipped += 1
                continue
            sock.send_multipart(frames)
            if isinstance(msg, p.Register):
                registered.append(msg.geometry)
            kinds[kind] += 1
            sent += 1
        if not sock.poll(30_000):
            raise AssertionError(f"no reply for 30 s: {sent} sent, {replies} answered")
        while sock.poll(0):
            reply = p.reply_decoder.decode(sock.recv())  # a reply always decodes
            replies += 1
            if isinstance(reply, p.Error):
                codes[reply.code.value] += 1
    return {"sent": sent, "replies": replies, "skipped": skipped, "kinds": kinds, "codes": codes,
            "registered": registered}


def _goodbye(sock: zmq.Socket[Any]) -> None:
    """Release what valid fuzz frames took (pins, pending stores), as a client exit would."""
    sock.send(p.encoder.encode(p.Bye(rid=1)))
    assert sock.poll(10_000)
    assert isinstance(p.reply_decoder.decode(sock.recv()), p.Ack)
    sock.close()


def _index_snapshot(c: DaemonClient, keys: list[bytes]) -> dict[str, Any]:
    s = c.stats()
    return {"ready": s["ready"], "pending": s["pending"], "pinned": s["pinned"],
            "free_slots": s["free_slots"], "probe": c.probe(keys)}


def _run_fuzz(tmp_path, frames: int) -> dict[str, Any]:
    env = {"KVOFFLOAD_MAX_MESSAGE_BYTES": str(MAX_MESSAGE),
           "KVOFFLOAD_MAX_KEYS_PER_REQUEST": str(MAX_KEYS)}
    with run_daemon(tmp_path, "--lease-ms", "600000", "--log-level", "info",
                    slot_bytes=1024, env=env) as d:
        checker = DaemonClient(d.control, timeout_ms=10_000)
        assert checker.register(EXAMPLE).engine == 0
        known = [make_key(H[3], 0), make_key(H[3], 1), make_key(H[6], 0)]
        slots = store(checker, known)
        assert checker.pin_load(known[:1]) == slots[:1]  # one pinned block must stay pinned
        before = _index_snapshot(checker, known)
        m0 = scrape_metrics(d.http_url)
        t0 = time.perf_counter()
        sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(d.control)
        try:
            result = _fuzz(sock, frames, seed=frames)
        except AssertionError as exc:
            alive = d.proc is not None and d.proc.poll() is None
            raise AssertionError(f"{exc}; daemon alive: {alive}; log:\n{d.log()[-4000:]}") from None
        result["seconds"] = round(time.perf_counter() - t0, 1)
        m1 = scrape_metrics(d.http_url)
        # Undo what the valid fuzz frames legitimately did in their own namespaces: the
        # goodbye releases their pins and pending stores, then a client registering each
        # namespace (only a namespace's own engines may reset it) drops its blocks.
        _goodbye(sock)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(d.control)
        # Every distinct geometry a fuzz Register sent (many were refused: only the one its
        # namespace holds registers again).
        for geometry in {msgspec.msgpack.encode(g): g for g in result["registered"]}.values():
            sock.send(p.encoder.encode(p.Register(rid=1, geometry=geometry)))
            assert sock.poll(10_000)
            reply = p.reply_decoder.decode(sock.recv())
            if isinstance(reply, p.Registered) and reply.engine != 0:
                sock.send(p.encoder.encode(p.Reset(rid=2, engine=reply.engine)))
                assert sock.poll(10_000)
                sock.recv()
        _goodbye(sock)

        with urllib.request.urlopen(f"{d.http_url}/healthz", timeout=10) as resp:
            assert resp.status == 200
        kinds, codes = result["kinds"], result["codes"]

        def delta(name: str, **labels: str) -> float:
            return metric_sum(m1, name, **labels) - metric_sum(m0, name, **labels)

        assert result["replies"] == result["sent"] == frames
        assert codes["internal"] == 0, d.log()[-3000:]
        assert codes["malformed"] == kinds["undecodable"] + kinds["multi"]
        assert codes["too_large"] > kinds["oversize"] > 0  # size and key-count limits both hit
        assert delta("kvoffload_refused_total", reason="nesting") > 0  # deep frames came
        assert "Traceback" not in d.log()  # every frame answered, none logged as a crash


        assert (delta("kvoffload_requests_total"), delta("kvoffload_protocol_errors_total")) == (
            kinds["decodable"], sum(codes.values())), (kinds, codes)

        # With the valid frames undone, the index must be exactly as before: invalid frames
        # changed nothing.
        assert _index_snapshot(checker, known) == before
        assert before["probe"] == [KeyStatus.HIT] * 3
        assert checker.pin_load(known) == slots  # same blocks, same slots
        assert checker.lookup([query()])[0].hit_tokens == 16
        checker.close()
    return result


def test_frame_over_the_hard_cap_drops_only_that_connection(tmp_path) -> None:
    """Past MAXMSGSIZE (2 x max_message_bytes) ZMQ disconnects the sender without a reply."""
    env = {"KVOFFLOAD_MAX_MESSAGE_BYTES": str(MAX_MESSAGE)}
    with run_daemon(tmp_path, env=env, slot_bytes=1024) as d:
        c = DaemonClient(d.control, timeout_ms=10_000)
        c.register(EXAMPLE)
        sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(d.control)
        sock.send(_ENCODED[0] + bytes(2 * MAX_MESSAGE + 1))
        sock.send(_ENCODED[0])  # may or may not make it onto the reconnected pipe
        assert sock.poll(2000) in (0, zmq.POLLIN)
        sock.close()
        big = p.Probe(rid=c.rid(), engine=0, keys=[make_key(H[0], 0)] * (MAX_MESSAGE // 30))
        reply = c.call(big)  # over the typed limit, under the cap: a typed answer
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.TOO_LARGE
        assert str(MAX_MESSAGE) in reply.message
        assert c.lookup([query()])[0].hit_tokens == 0  # the daemon serves on
        c.close()


def test_live_daemon_survives_fuzzing(tmp_path) -> None:
    result = _run_fuzz(tmp_path, FUZZ_FRAMES)
    print(f"fuzz: {result}")


@pytest.mark.slow
def test_live_daemon_survives_a_million_frames(tmp_path) -> None:
    _run_fuzz(tmp_path, 1_000_000)


def test_mutator_covers_every_message_type() -> None:
    """The mutated frames reach every request type decodably (so handlers get fuzzed too)."""
    rng = random.Random(0)
    seen: set[type] = set()
    for _ in range(20_000):
        kind, msg = _classify(mutated_frames(rng))
        if msg is not None:
            seen.add(type(msg))
    assert seen == {t for t in p.Request.__args__}
    assert isinstance(FUZZ_GEOMETRY, Geometry)


def test_limits_each_have_a_clear_error(tmp_path) -> None:
    env = {"KVOFFLOAD_MAX_CLIENTS": "3", "KVOFFLOAD_MAX_KEYS_PER_REQUEST": "8",
           "KVOFFLOAD_MAX_MESSAGE_BYTES": str(MAX_MESSAGE)}
    with run_daemon(tmp_path, env=env, slot_bytes=1024) as d:
        clients = [DaemonClient(d.control, timeout_ms=10_000) for _ in range(3)]
        for c in clients:
            c.register(EXAMPLE)
        extra = DaemonClient(d.control, timeout_ms=10_000)
        reply = extra.call(p.Hello(rid=1, version=p.PROTOCOL_VERSION))
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.TOO_LARGE
        assert "client limit reached (3)" in reply.message
        clients.pop().close()  # a goodbye frees the place at once
        deadline = time.monotonic() + 10
        while not isinstance(extra.call(p.Heartbeat(rid=2)), p.Ack):
            assert time.monotonic() < deadline, "the freed client place was not reused"
            time.sleep(0.02)
        c = clients[0]
        nine = [make_key(H[0], 0)] * 9
        for msg in (p.Probe(rid=3, engine=0, keys=nine),
                    p.PrepareStore(rid=4, engine=0, items=[p.StoreItem(key=k, end_token=4)
                                                           for k in nine]),
                    p.Lookup(rid=5, engine=0, queries=[query(str(i)) for i in range(9)])):
            err = c.call(msg)
            assert isinstance(err, p.Error) and err.code == p.ErrorCode.TOO_LARGE, err
            assert "the limit is 8" in err.message and err.rid == msg.rid
        assert c.stats()["pending"] == 0  # refused whole, nothing reserved
        big = c.call(p.Probe(rid=6, engine=0, keys=[H[0] * 3] * 8 + [bytes(MAX_MESSAGE)]))
        assert isinstance(big, p.Error) and big.code == p.ErrorCode.TOO_LARGE
        assert big.rid == 6 and f"the limit is {MAX_MESSAGE}" in big.message
        for cl in [*clients, extra]:
            cl.close()
