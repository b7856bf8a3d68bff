"""EventPublisher over real sockets: framing, replay protocol, never-blocking publish, metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq
from kvoffload.events.lookup_publisher import LookupEventPublisher
from kvoffload.events.publisher import END_SEQ, EventPublisher, is_bind_endpoint
from kvoffload.events.schema import (
    AllBlocksCleared,
    EventBatch,
    LookupEvent,
    LookupEventBatch,
    decode_batch,
    decode_lookup_batch,
    encode_batch,
)
from prometheus_client import CollectorRegistry

from tests.events_helpers import (
    arecv,
    batch,
    prime_raw,
    sample,
    stored,
    wait_until,
)

DROPPED = "kvoffload_events_dropped_batches_total"


def raw_sub(endpoint: str) -> zmq.Socket[Any]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    return sock


def raw_dealer(endpoint: str) -> zmq.Socket[Any]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    return sock


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://127.0.0.1:*", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/x", True),
        ("inproc://x", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://router.local:5557", False),
    ],
)
def test_bind_rule_matches_vllm(endpoint: str, binds: bool) -> None:
    assert is_bind_endpoint(endpoint) is binds


async def test_bound_endpoints_report_real_ports(registry: CollectorRegistry) -> None:
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", registry=registry)
    try:
        for ep in (pub.bound_endpoint, pub.bound_replay_endpoint):
            assert ep is not None and ep.startswith("tcp://127.0.0.1:")
            assert int(ep.rsplit(":", 1)[1]) > 0
        assert pub.bound_endpoint != pub.bound_replay_endpoint
    finally:
        await pub.aclose()


async def test_publish_never_blocks_and_counts_drops(registry: CollectorRegistry) -> None:
    pub = EventPublisher("inproc://never-blocks", queue_size=3, registry=registry)
    # No sender runs: a publish that waited for room would never return.
    results = [pub.publish(batch(i)) for i in range(1000)]
    assert results[:3] == [True] * 3 and not any(results[3:])
    assert sample(registry, DROPPED, stream="kv", reason="queue_full") == 997
    assert pub.queued == 3 and pub.next_seq == 0
    await pub.start()  # the queued ones go out once a sender runs
    await wait_until(lambda: pub.next_seq == 3)
    await pub.aclose()
    assert pub.publish(batch(9)) is False
    assert sample(registry, DROPPED, stream="kv", reason="closed") == 1


async def test_live_frames_seq_and_payload(
    ipc: Callable[[str], str], registry: CollectorRegistry
) -> None:
    pub = EventPublisher(ipc("pub"), topic="kv@node1", registry=registry)
    sock = raw_sub(pub.bound_endpoint)
    try:
        await pub.start()
        await prime_raw(pub, sock)
        first = pub.next_seq
        sent = [batch(i, n_events=i + 1) for i in range(3)]
        for b in sent:
            assert pub.publish(b)
        for i, b in enumerate(sent):
            frames = await arecv(sock)
            assert len(frames) == 3
            topic, seq, payload = frames
            assert topic == b"kv@node1"
            assert seq == (first + i).to_bytes(8, "big")
            assert payload == encode_batch(b)
            assert decode_batch(payload) == b
        assert sample(registry, "kvoffload_events_published_events_total", stream="kv") >= 6
    finally:
        sock.close()
        await pub.aclose()


async def test_connect_mode_endpoint(registry: CollectorRegistry) -> None:
    # A SUB that binds and a publisher that connects ("connect:": the broker case).
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    pub = EventPublisher(f"connect:{endpoint}", registry=registry)
    try:
        assert pub.bound_endpoint == endpoint
        await pub.start()
        await prime_raw(pub, sock)
        pub.publish(batch(1))
        assert decode_batch((await arecv(sock))[2]) == batch(1)
    finally:
        sock.close()
        await pub.aclose()


async def test_replay_protocol(ipc: Callable[[str], str], registry: CollectorRegistry) -> None:
    pub = EventPublisher(ipc("p"), ipc("r"), topic="t", buffer_batches=3, registry=registry)
    replay_ep = pub.bound_replay_endpoint
    assert replay_ep is not None
    dealer = raw_dealer(replay_ep)
    try:
        await pub.start()
        for i in range(5):
            pub.publish(batch(i))
        await wait_until(lambda: pub.next_seq == 5)

        async def request(start: int) -> list[list[bytes]]:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                frames = await arecv(dealer)
                out.append(frames)
                if frames[2] == END_SEQ:
                    return out

        got = await request(3)
        assert [f[2] for f in got] == [(3).to_bytes(8, "big"), (4).to_bytes(8, "big"), END_SEQ]
        assert got[-1] == [b"", b"", b"\xff" * 8, b""]
        assert all(f[0] == b"" and f[1] == b"t" for f in got[:-1])
        assert [decode_batch(f[3]) for f in got[:-1]] == [batch(3), batch(4)]
        # Older than the buffer (3 batches): starts silently at the oldest retained.
        got = await request(0)
        assert [int.from_bytes(f[2], "big") for f in got[:-1]] == [2, 3, 4]
        # Beyond the newest: only the end marker.
        assert await request(99) == [[b"", b"", END_SEQ, b""]]
        # A malformed request is ignored; the endpoint keeps serving.
        dealer.send_multipart([b"", b"\x01", b"junk"])
        assert len(await request(4)) == 2
        assert sample(registry, "kvoffload_events_replay_requests_total", stream="kv") == 4
        assert sample(registry, "kvoffload_events_replayed_batches_total", stream="kv") == 6
    finally:
        dealer.close()
        await pub.aclose()


async def test_wraps_events_and_fills_dp_rank(
    ipc: Callable[[str], str], registry: CollectorRegistry
) -> None:
    pub = EventPublisher(ipc("p"), ipc("r"), registry=registry, data_parallel_rank=3)
    replay_ep = pub.bound_replay_endpoint
    assert replay_ep is not None
    dealer = raw_dealer(replay_ep)
    try:
        await pub.start()
        before = time.time()
        pub.publish([stored(1), stored(2)])
        pub.publish(AllBlocksCleared())
        pub.publish(EventBatch(ts=5.0, events=[]))
        pub.publish(EventBatch(ts=6.0, events=[], data_parallel_rank=1))
        await wait_until(lambda: pub.next_seq == 4)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = [decode_batch((await arecv(dealer))[3]) for _ in range(4)]
        assert got[0].events == [stored(1), stored(2)] and before <= got[0].ts <= time.time()
        assert got[1].events == [AllBlocksCleared()]
        assert [b.data_parallel_rank for b in got] == [3, 3, 3, 1]
    finally:
        dealer.close()
        await pub.aclose()


async def test_publish_from_another_thread(registry: CollectorRegistry) -> None:
    pub = EventPublisher("inproc://threads", registry=registry)
    await pub.start()
    try:
        accepted = await asyncio.to_thread(lambda: sum(pub.publish(batch(i)) for i in range(500)))
        assert accepted == 500
        await wait_until(lambda: pub.next_seq == 500)
        assert sample(registry, "kvoffload_events_published_batches_total", stream="kv") == 500
    finally:
        await pub.aclose()


async def test_aclose_flushes_queued_batches(
    ipc: Callable[[str], str], registry: CollectorRegistry
) -> None:
    pub = EventPublisher(ipc("p"), registry=registry, max_drain=16)
    sock = raw_sub(pub.bound_endpoint)
    try:
        await pub.start()
        await prime_raw(pub, sock)
        first = pub.next_seq
        for i in range(300):  # no await in between: all still queued at close
            pub.publish(batch(i))
        assert pub.queued == 300
        await pub.aclose(flush=True)
        seqs = [int.from_bytes(sock.recv_multipart()[1], "big") for _ in range(300)]
        assert seqs == list(range(first, first + 300))
    finally:
        sock.close()


async def test_unencodable_batch_is_dropped_without_consuming_a_seq(
    registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    pub = EventPublisher("inproc://bad-batch", registry=registry)
    await pub.start()
    try:
        with caplog.at_level(logging.WARNING):
            assert pub.publish(EventBatch(ts=0.0, events=[object()]))  # type: ignore[list-item]
            assert not pub.publish(object())  # type: ignore[arg-type]  # not iterable
            pub.publish(batch(1))
            await wait_until(lambda: pub.next_seq == 1)
        assert sample(registry, DROPPED, stream="kv", reason="encode_error") == 1
        assert sample(registry, DROPPED, stream="kv", reason="invalid") == 1
        assert pub.queued == 0
        assert len([r for r in caplog.records if "dropping" in r.getMessage()]) == 2
    finally:
        await pub.aclose()


async def test_lookup_publisher_wraps_lookup_events(
    ipc: Callable[[str], str], registry: CollectorRegistry
) -> None:
    pub = LookupEventPublisher(ipc("lp"), ipc("lr"), registry=registry)
    replay_ep = pub.bound_replay_endpoint
    assert replay_ep is not None
    dealer = raw_dealer(replay_ep)
    ev = LookupEvent(
        request_id="r",
        namespace="n",
        prompt_tokens=10,
        local_tokens=0,
        hit_tokens=0,
        chunk_hit_tokens=0,
        tail_hit_tokens=0,
        tail_boundary=None,
        outcome="miss",
        miss_reason="not_stored",
    )
    try:
        await pub.start()
        pub.publish(ev)
        await wait_until(lambda: pub.next_seq == 1)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = decode_lookup_batch((await arecv(dealer))[3])
        assert isinstance(got, LookupEventBatch) and got.schema_version == 1
        assert got.events == [ev]
        assert sample(registry, "kvoffload_events_published_batches_total", stream="lookup") == 1
    finally:
        dealer.close()
        await pub.aclose()


def test_bench_reports_missing_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvoffload.bench.suites import events as bench

    monkeypatch.setattr(bench, "_load_vllm", lambda: (False, "unavailable: forced by test"))
    res = bench.run_events_bench(quick=True, n_batches=500, rounds=1)
    assert res["baseline"] == "unavailable: forced by test"
    assert res["ratio"] is None and res["vllm_events_per_s"] is None and res["meets"] is False
    assert res["ours_events_per_s"] > 0 and res["lost_events"]["ours"] == 0


async def test_address_in_use_raises_and_releases(registry: CollectorRegistry) -> None:
    first = EventPublisher("tcp://127.0.0.1:*", registry=registry)
    taken = first.bound_endpoint
    probe: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    probe.bind("tcp://127.0.0.1:*")
    port = probe.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    probe.close(linger=0)
    mine = f"tcp://*:{port}"
    try:
        # Keep the traceback (and with it the half-built publisher) alive: the port must be
        # released by the constructor itself, not by garbage collection.
        with pytest.raises(zmq.ZMQError) as info:
            EventPublisher(mine, taken, registry=registry)  # its replay address is taken
    finally:
        await first.aclose()
    # The failed publisher's PUB was closed: its port can be bound again (release is async).
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    try:
        deadline = time.monotonic() + 5
        while True:
            try:
                sock.bind(mine)
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline, "port never released"
                await asyncio.sleep(0.01)
    finally:
        sock.close(linger=0)
    assert info.value.errno == zmq.EADDRINUSE
