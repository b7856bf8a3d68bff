"""Shared helpers for the events tests (plain functions: fixtures live in the test files)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import zmq
from kvoffload.events.publisher import EventPublisher
from kvoffload.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    LookupEvent,
)
from kvoffload.events.subscriber import Gap, Received, Reset, _Subscriber
from prometheus_client import CollectorRegistry

Item = Received[Any] | Gap | Reset


def lookup_event(**kw: Any) -> LookupEvent:
    """A partial-tail lookup event (28 of 30 prompt tokens: a 16-token chunk and a 12-token
    tail); ``kw`` overrides fields."""
    base: dict[str, Any] = dict(
        request_id="r1",
        namespace="engine-a",
        prompt_tokens=30,
        local_tokens=0,
        hit_tokens=28,
        chunk_hit_tokens=16,
        tail_hit_tokens=12,
        tail_boundary=28,
        outcome="partial",
    )
    base.update(kw)
    return LookupEvent(**base)


def ipc_endpoints() -> Iterator[Callable[[str], str]]:
    """Yield a factory of ipc:// endpoints in a short private dir (ipc paths max ~107 chars)."""
    d = tempfile.mkdtemp(prefix="kvo-", dir="/tmp")
    try:
        yield lambda name: f"ipc://{d}/{name}"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def stored(i: int, n_tokens: int = 4, *, as_bytes: bool = False, **extra: Any) -> BlockStored:
    h: int | bytes = i.to_bytes(32, "big") if as_bytes else 1000 + i
    return BlockStored(
        block_hashes=[h],
        parent_block_hash=None,
        token_ids=list(range(i * n_tokens, (i + 1) * n_tokens)),
        block_size=n_tokens,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        **extra,
    )


def batch(i: int, n_events: int = 1) -> EventBatch:
    return EventBatch(ts=1_764_400_000.0 + i, events=[stored(i * 100 + j) for j in range(n_events)])


def mixed_batch(i: int) -> EventBatch:
    return EventBatch(
        ts=float(i),
        events=[
            stored(i, as_bytes=True, group_idx=1, kv_cache_spec_kind="full_attention"),
            BlockRemoved(block_hashes=[7, 8], medium="CPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=2,
    )


def block_events(events: Iterable[KVEvent]) -> list[BlockStored | BlockRemoved]:
    """The events, every one a store or a removal: for tests where nothing is reset, so an
    ``AllBlocksCleared`` is a failure (it has no medium or hashes to read), never skipped."""
    out: list[BlockStored | BlockRemoved] = []
    for ev in events:
        assert not isinstance(ev, AllBlocksCleared), ev
        out.append(ev)
    return out


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Bounded wait for a condition that has no event to await (e.g. a sender's progress)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.002)


async def take(sub: _Subscriber[Any], n: int, timeout: float = 5.0) -> list[Item]:
    """The next `n` items, each within `timeout`."""
    return [await sub.recv(timeout) for _ in range(n)]


async def prime(pub: EventPublisher, sub: _Subscriber[Any], timeout: float = 5.0) -> None:
    """Publish probes until `sub` receives one, then drain every probe sent (slow joiner)."""
    deadline = time.monotonic() + timeout
    while True:
        pub.publish(EventBatch(ts=-1.0, events=[]))
        try:
            item = await sub.recv(0.05)
            break
        except TimeoutError:
            if time.monotonic() > deadline:
                raise
    last = pub.next_seq - 1
    while not (isinstance(item, Received) and item.seq >= last):
        item = await sub.recv(timeout)
        last = pub.next_seq - 1


async def prime_raw(pub: EventPublisher, sock: zmq.Socket[Any], timeout: float = 5.0) -> None:
    """Same for a raw SUB socket: afterwards the socket holds no probe."""
    deadline = time.monotonic() + timeout
    while True:
        pub.publish(EventBatch(ts=-1.0, events=[]))
        await wait_until(lambda: pub.queued == 0)
        if sock.poll(50):
            break
        if time.monotonic() > deadline:
            raise TimeoutError("raw SUB never received a probe")
    last = pub.next_seq - 1
    while True:
        frames = sock.recv_multipart()
        if int.from_bytes(frames[1], "big") >= last:
            return


async def arecv(sock: zmq.Socket[Any], timeout: float = 5.0) -> list[bytes]:
    """Receive from a plain socket without blocking the loop (publishers run on it)."""
    await wait_until(lambda: bool(sock.poll(0)), timeout)
    return sock.recv_multipart()
