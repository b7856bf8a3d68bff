"""EventSubscriber over real sockets: live, late join, gaps, restarts, garbage, dead replay."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq
from kvoffload.events.lookup_publisher import LookupEventPublisher
from kvoffload.events.publisher import EventPublisher
from kvoffload.events.schema import EventBatch, LookupEventBatch, encode_batch
from kvoffload.events.subscriber import (
    EventSubscriber,
    Gap,
    LookupEventSubscriber,
    Received,
    Reset,
)
from prometheus_client import CollectorRegistry

from tests.events_helpers import (
    arecv,
    batch,
    lookup_event,
    prime,
    sample,
    take,
    wait_until,
)

M = "kvoffload_events_subscriber_"


def seqs(items: list[Any]) -> list[int]:
    return [i.seq for i in items if isinstance(i, Received)]


async def test_live_delivery_in_order(
    ipc: Callable[[str], str], registry: CollectorRegistry
) -> None:
    pub = EventPublisher(ipc("p"), registry=registry)
    sub = EventSubscriber(pub.bound_endpoint, registry=registry)
    async with pub, sub:
        await prime(pub, sub)
        first = pub.next_seq
        sent = [batch(i, n_events=2) for i in range(50)]
        for b in sent:
            pub.publish(b)
        got = await take(sub, 50)
        assert all(isinstance(i, Received) and not i.replayed for i in got)
        assert seqs(got) == list(range(first, first + 50))
        assert [i.batch for i in got if isinstance(i, Received)] == sent
        assert sample(registry, M + "received_batches_total", stream="kv", source="live") >= 50
        assert sample(registry, M + "gaps_total", stream="kv") == 0


async def test_late_join_replays_history_then_goes_live(
    ipc: Callable[[str], str], registry: CollectorRegistry
) -> None:
    pub = EventPublisher(ipc("p"), ipc("r"), registry=registry)
    replay_ep = pub.bound_replay_endpoint
    async with pub:
        for i in range(10):
            pub.publish(batch(i))
        await wait_until(lambda: pub.next_seq == 10)
        async with EventSubscriber(
            pub.bound_endpoint, replay_ep, from_seq=0, registry=registry
        ) as sub:
            history = await take(sub, 10)
            assert seqs(history) == list(range(10))
            assert all(isinstance(i, Received) and i.replayed for i in history)
            assert [i.batch for i in history if isinstance(i, Received)] == [
                batch(i) for i in range(10)
            ]
            for i in range(10, 15):
                pub.publish(batch(i))
            # Whether 10.. arrive live or (slow joiner) through a gap replay, each comes once.
            live = await take(sub, 5)
            assert seqs(live) == list(range(10, 15))
        async with EventSubscriber(
            pub.bound_endpoint, replay_ep, from_seq=12, registry=registry
        ) as sub2:
            assert seqs(await take(sub2, 3)) == [12, 13, 14]
        assert sample(registry, M + "missed_batches_total", stream="kv") == 0


async def test_forced_gap_is_recovered_by_replay(
    ipc: Callable[[str], str], registry: CollectorRegistry
) -> None:
    withheld: set[int] = set()
    pub = EventPublisher(
        ipc("p"), ipc("r"), registry=registry, live_filter=lambda s: s not in withheld
    )
    sub = EventSubscriber(pub.bound_endpoint, pub.bound_replay_endpoint, registry=registry)
    async with pub, sub:
        await prime(pub, sub)
        base = pub.next_seq
        withheld.update({base + 2, base + 3})  # never sent live, still replayable
        for i in range(6):
            pub.publish(batch(i))
        got = await take(sub, 6)
        assert seqs(got) == list(range(base, base + 6))
        replayed = {i.seq for i in got if isinstance(i, Received) and i.replayed}
        assert {base + 2, base + 3} <= replayed and base not in replayed
        assert [i.batch for i in got if isinstance(i, Received)] == [batch(i) for i in range(6)]
        assert sample(registry, M + "gaps_total", stream="kv") == 1
        assert sample(registry, M + "missed_batches_total", stream="kv") == 0


async def test_gap_without_replay_is_reported(
    ipc: Callable[[str], str], registry: CollectorRegistry
) -> None:
    withheld: set[int] = set()
    pub = EventPublisher(ipc("p"), registry=registry, live_filter=lambda s: s not in withheld)
    sub = EventSubscriber(pub.bound_endpoint, registry=registry)
    async with pub, sub:
        await prime(pub, sub)
        base = pub.next_seq
        withheld.update({base + 1, base + 2})
        for i in range(4):
            pub.publish(batch(i))
        got = await take(sub, 3)
        assert got[0] == Received(base, batch(0))
        assert got[1] == Gap(base + 1, base + 3) and got[1].count == 2
        assert got[2] == Received(base + 3, batch(3))
        assert sample(registry, M + "missed_batches_total", stream="kv") == 2


async def test_gap_older_than_replay_buffer(
    ipc: Callable[[str], str], registry: CollectorRegistry
) -> None:
    withheld: set[int] = set()
    pub = EventPublisher(
        ipc("p"),
        ipc("r"),
        buffer_batches=3,
        registry=registry,
        live_filter=lambda s: s not in withheld,
    )
    sub = EventSubscriber(pub.bound_endpoint, pub.bound_replay_endpoint, registry=registry)
    async with pub, sub:
        await prime(pub, sub)
        base = pub.next_seq
        withheld.update(range(base, base + 4))
        for i in range(5):
            pub.publish(batch(i))
        got = await take(sub, 4)
        # The buffer only holds base+2..base+4 by the time the gap is seen.
        assert got[0] == Gap(base, base + 2)
        assert seqs(got) == [base + 2, base + 3, base + 4]
        assert sample(registry, M + "missed_batches_total", stream="kv") == 2


async def test_publisher_restart_is_reported_as_reset(
    ipc: Callable[[str], str], registry: CollectorRegistry
) -> None:
    ep, rep = ipc("p"), ipc("r")
    pub = EventPublisher(ep, rep, registry=registry)
    sub = EventSubscriber(ep, rep, registry=registry)
    async with sub:
        async with pub:
            await prime(pub, sub)
            # A long old stream, so the new one is still below it when the SUB reconnects (a
            # restarted publisher that outruns the old seq first is indistinguishable: no epoch
            # on the wire).
            for i in range(100):
                pub.publish(batch(i))
            await take(sub, 100)
            expected = pub.next_seq
        pub2 = EventPublisher(ep, rep, registry=registry)  # same endpoints, seq starts at 0
        async with pub2:
            item: Any = None
            deadline = time.monotonic() + 5
            while item is None:  # the SUB reconnects on its own; keep publishing until then
                pub2.publish(batch(100 + pub2.next_seq))
                try:
                    item = await sub.recv(0.05)
                except TimeoutError:
                    assert time.monotonic() < deadline
            assert isinstance(item, Reset) and item.expected == expected
            # The new stream follows from its seq 0 (older ones fetched by replay).
            n = pub2.next_seq
            got = await take(sub, n)
            assert seqs(got) == list(range(n))
            assert [i.batch for i in got if isinstance(i, Received)] == [
                batch(100 + s) for s in range(n)
            ]
        assert sample(registry, M + "resets_total", stream="kv") == 1


async def test_garbage_frames_are_survived(
    ipc: Callable[[str], str], registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    ep = ipc("raw")
    pub.bind(ep)

    def send(seq: int, payload: bytes) -> None:
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    sub = EventSubscriber(ep, registry=registry)
    try:
        async with sub:
            seq = 100
            while True:  # slow joiner: probe until the subscription is up
                send(seq, encode_batch(EventBatch(ts=0.0, events=[])))
                try:
                    first = await sub.recv(0.05)
                    break
                except TimeoutError:
                    seq += 1
            assert isinstance(first, Received)
            while sub.next_seq != seq + 1:  # drain the other probes
                await sub.recv(5)
            with caplog.at_level(logging.WARNING, logger="kvoffload.events.subscriber"):
                pub.send(b"just one frame")
                pub.send_multipart([b"", b"abc", encode_batch(batch(0))])  # short seq
                pub.send_multipart([b"", b"\xff" * 8, b""])  # stray end marker
                pub.send_multipart([b"", (seq + 1).to_bytes(8, "big"), b"\xc1garbage"])
                pub.send_multipart([b"", (seq + 2).to_bytes(8, "big"), b"\x92\x01\x02"])
                pub.send_multipart([b"a", b"b", b"c", b"d"])
                send(seq + 3, encode_batch(batch(7)))
                item = await sub.recv(5)
            assert item == Received(seq + 3, batch(7))  # bad payloads consumed their seqs
            count = sample
            assert count(registry, M + "malformed_total", stream="kv", kind="frames") == 2
            assert count(registry, M + "malformed_total", stream="kv", kind="seq") == 2
            assert count(registry, M + "malformed_total", stream="kv", kind="payload") == 2
            assert count(registry, M + "gaps_total", stream="kv") == 0
            warnings = [r for r in caplog.records if "malformed" in r.getMessage()]
            assert len(warnings) == 3  # once per kind
    finally:
        pub.close()


async def test_dead_replay_endpoint_is_bounded(
    ipc: Callable[[str], str], registry: CollectorRegistry
) -> None:
    pub = EventPublisher(ipc("p"), registry=registry)
    sub = EventSubscriber(
        pub.bound_endpoint, ipc("nobody"), from_seq=0, registry=registry, replay_timeout=0.2
    )
    async with pub:
        # The initial replay from 0 gives up after replay_timeout instead of hanging (the
        # outer bound only turns a hang into a failure).
        await asyncio.wait_for(sub.start(), 30)
        try:
            await prime(pub, sub)
            pub.publish(batch(1))
            item = await sub.recv(5)
            assert isinstance(item, Received) and item.batch == batch(1)
        finally:
            await sub.aclose()


async def test_aclose_ends_iteration(
    ipc: Callable[[str], str], registry: CollectorRegistry
) -> None:
    sub = EventSubscriber(ipc("nothing-here"), registry=registry)
    await sub.start()
    items: list[Any] = []

    async def consume() -> None:
        async for item in sub:
            items.append(item)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0)  # let it block on the empty socket
    await sub.aclose()
    await asyncio.wait_for(task, 2)  # ends with StopAsyncIteration, not a cancellation
    assert items == []


async def test_lookup_stream_round_trip(
    ipc: Callable[[str], str], registry: CollectorRegistry
) -> None:
    pub = LookupEventPublisher(ipc("lp"), ipc("lr"), registry=registry)
    ev = lookup_event(request_id="r", namespace="n")
    async with pub:
        pub.publish([ev])
        await wait_until(lambda: pub.next_seq == 1)
        sub = LookupEventSubscriber(
            pub.bound_endpoint, pub.bound_replay_endpoint, from_seq=0, registry=registry
        )
        async with sub:
            item = await sub.recv(5)
        assert isinstance(item, Received) and isinstance(item.batch, LookupEventBatch)
        assert item.batch.events == [ev]


async def test_bind_mode_for_connecting_publishers(registry: CollectorRegistry) -> None:
    sub = EventSubscriber("tcp://127.0.0.1:*", bind=True, registry=registry)
    async with sub:
        endpoint = sub.bound_endpoint
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith("*")
        async with EventPublisher(f"connect:{endpoint}", registry=registry) as pub:
            await prime(pub, sub)
            pub.publish(batch(3))
            item = await sub.recv(5)
            assert isinstance(item, Received) and item.batch == batch(3)


async def test_consumer_timeout_does_not_abort_a_replay(
    ipc: Callable[[str], str], registry: CollectorRegistry
) -> None:
    # A replay endpoint the test answers by hand, late: the consumer times out meanwhile.
    router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(ipc("slow-replay"))
    withheld: set[int] = set()
    pub = EventPublisher(ipc("p"), registry=registry, live_filter=lambda s: s not in withheld)
    sub = EventSubscriber(pub.bound_endpoint, ipc("slow-replay"), registry=registry)
    try:
        async with pub, sub:
            await prime(pub, sub)
            base = pub.next_seq
            withheld.add(base + 1)
            for i in range(3):
                pub.publish(batch(i))
            assert await sub.recv(5) == Received(base, batch(0))
            with pytest.raises(TimeoutError):
                await sub.recv(0.1)  # base+2 arrived, the replay of base+1 is pending
            client, empty, start = await arecv(router)
            assert empty == b"" and int.from_bytes(start, "big") == base + 1
            router.send_multipart(
                [client, b"", b"", (base + 1).to_bytes(8, "big"), encode_batch(batch(1))]
            )
            router.send_multipart([client, b"", b"", b"\xff" * 8, b""])
            got = await take(sub, 2)
            assert got == [
                Received(base + 1, batch(1), replayed=True),
                Received(base + 2, batch(2)),
            ]
    finally:
        router.close()
