"""Interop with vLLM 0.33 itself: its publisher feeds our subscriber and CLI; its typed decoder
and a vLLM-style DEALER replay client read our publisher."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from kvoffload.events.publisher import END_SEQ, EventPublisher
from kvoffload.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
)
from kvoffload.events.subscriber import EventSubscriber, Received
from prometheus_client import CollectorRegistry

from tests.events_helpers import arecv, prime_raw, take, wait_until

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
try:
    from vllm.distributed import kv_events as vkv
except Exception as exc:  # not installed, or its import chain is incomplete here
    vkv = None  # type: ignore[assignment]  # a module or None: the tests skip on None
    SKIP_REASON = f"vLLM not importable: {type(exc).__name__}: {exc}"
else:
    SKIP_REASON = ""

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(vkv is None, reason=SKIP_REASON)]

# The same events as kwargs, built into vLLM's structs and ours.
EVENTS: list[tuple[str, dict[str, Any]]] = [
    (
        "BlockStored",
        dict(
            block_hashes=[(1 << 64) - 1, 5],
            parent_block_hash=4,
            token_ids=list(range(32)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
    ),
    (
        "BlockStored",
        dict(
            block_hashes=[b"\x01" * 32],
            parent_block_hash=None,
            token_ids=[9, 9, 9, 9],
            block_size=4,
            lora_id=None,
            medium="CPU",
            lora_name="lora-a",
            extra_keys=[("lora-a",)],
            group_idx=2,
            kv_cache_spec_kind="mamba",
            locality="LOCAL",
            session_id="s-1",
            lookahead_token_ids=[[1, 2]],
        ),
    ),
    ("BlockRemoved", dict(block_hashes=[5], medium="GPU", group_idx=0, ownership="t2")),
    ("AllBlocksCleared", {}),
]
OURS = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def vllm_batch(i: int, rank: int | None = 0) -> Any:
    assert vkv is not None
    events = [getattr(vkv, name)(**kw) for name, kw in EVENTS[i % 2 : i % 2 + 3]]
    return vkv.KVEventBatch(ts=1000.0 + i, events=events, data_parallel_rank=rank)


def our_batch(i: int, rank: int | None = 0) -> EventBatch:
    events = [OURS[name](**kw) for name, kw in EVENTS[i % 2 : i % 2 + 3]]
    return EventBatch(ts=1000.0 + i, events=events, data_parallel_rank=rank)


@pytest.fixture
def vllm_pub(ipc: Callable[[str], str]) -> Iterator[Any]:
    assert vkv is not None
    pub = vkv.ZmqEventPublisher(0, endpoint=ipc("vp"), replay_endpoint=ipc("vr"))
    try:
        yield pub
    finally:
        pub.shutdown()


async def wait_vllm_sent(pub: Any, n: int) -> None:
    # vLLM exposes no progress counter; its replay buffer grows as its thread sends.
    await wait_until(lambda: len(pub._buffer) >= n)


def test_vllm_and_our_encoders_agree_on_the_shared_batches() -> None:
    for i in range(4):
        assert encode_batch(our_batch(i)) == msgspec.msgpack.encode(vllm_batch(i))


async def test_our_subscriber_live_from_vllm(vllm_pub: Any) -> None:
    cfg = vllm_pub.get_publisher_config()
    async with EventSubscriber(
        cfg.endpoint, cfg.replay_endpoint, registry=CollectorRegistry()
    ) as sub:
        deadline = time.monotonic() + 10
        probes = 0
        while True:  # slow joiner: publish until the subscription is up
            vllm_pub.publish(vkv.KVEventBatch(ts=-1.0, events=[]))
            probes += 1
            try:
                first = await sub.recv(0.05)
                break
            except TimeoutError:
                assert time.monotonic() < deadline
        assert isinstance(first, Received)
        while sub.next_seq != probes:  # drain the probes still in flight
            await sub.recv(5)
        base = probes
        for i in range(6):
            vllm_pub.publish(vllm_batch(i))
        got = await take(sub, 6)
    assert [(g.seq, g.batch) for g in got if isinstance(g, Received)] == [
        (base + i, our_batch(i)) for i in range(6)
    ]


async def test_our_subscriber_replays_from_vllm(vllm_pub: Any) -> None:
    for i in range(5):
        vllm_pub.publish(vllm_batch(i, rank=None))  # vLLM stamps its own rank (0)
    await wait_vllm_sent(vllm_pub, 5)
    cfg = vllm_pub.get_publisher_config()
    sub = EventSubscriber(
        cfg.endpoint, cfg.replay_endpoint, from_seq=1, registry=CollectorRegistry()
    )
    async with sub:
        got = await take(sub, 4)
    assert all(isinstance(g, Received) and g.replayed for g in got)
    assert [(g.seq, g.batch) for g in got if isinstance(g, Received)] == [
        (i, our_batch(i, rank=0)) for i in range(1, 5)
    ]


async def run_tail(*args: str) -> list[dict[str, Any]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvoffload",
        "events",
        "tail",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, stderr.decode()
    return [json.loads(line) for line in stdout.decode().splitlines()]


async def test_tail_cli_replays_vllm(vllm_pub: Any) -> None:
    for i in range(2):
        vllm_pub.publish(vllm_batch(i))
    await wait_vllm_sent(vllm_pub, 2)
    cfg = vllm_pub.get_publisher_config()
    records = await run_tail(
        "--endpoint",
        cfg.endpoint,
        "--replay",
        cfg.replay_endpoint,
        "--from-seq",
        "0",
        "--json",
        "--count",
        "6",
    )
    assert [(r["seq"], r["type"]) for r in records] == [
        (0, "BlockStored"),
        (0, "BlockStored"),
        (0, "BlockRemoved"),
        (1, "BlockStored"),
        (1, "BlockRemoved"),
        (1, "AllBlocksCleared"),
    ]
    assert records[0]["block_hashes"] == [(1 << 64) - 1, 5] and records[0]["dp_rank"] == 0
    assert records[1]["block_hashes"] == ["01" * 32] and records[1]["extra_keys"] == [["lora-a"]]
    assert records[2]["ownership"] == "t2"


async def test_tail_cli_live_from_vllm(vllm_pub: Any) -> None:
    cfg = vllm_pub.get_publisher_config()
    task = asyncio.create_task(run_tail("--endpoint", cfg.endpoint, "--json", "--count", "3"))
    i = 0
    while not task.done():  # live only: publish until the CLI has seen 3 events and exits
        vllm_pub.publish(vllm_batch(1))
        i += 1
        await asyncio.wait([task], timeout=0.02)
        assert i < 1500
    records = task.result()
    assert [r["type"] for r in records] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert len({r["seq"] for r in records}) == 1


async def test_vllm_decoder_reads_our_publisher(ipc: Callable[[str], str]) -> None:
    assert vkv is not None
    decoder = msgspec.msgpack.Decoder(vkv.KVEventBatch)
    pub = EventPublisher(ipc("p"), ipc("r"), registry=CollectorRegistry())
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pub.bound_endpoint)
    try:
        await pub.start()
        await prime_raw(pub, sock)
        first = pub.next_seq
        for i in range(4):
            pub.publish(our_batch(i))
        for i in range(4):
            topic, seq, payload = await arecv(sock)
            assert topic == b"" and int.from_bytes(seq, "big") == first + i
            assert decoder.decode(payload) == vllm_batch(i)
    finally:
        sock.close()
        await pub.aclose()


async def test_vllm_style_dealer_replay_against_our_publisher(ipc: Callable[[str], str]) -> None:
    assert vkv is not None
    decoder = msgspec.msgpack.Decoder(vkv.KVEventBatch)
    pub = EventPublisher(ipc("p"), ipc("r"), registry=CollectorRegistry())
    replay = pub.bound_replay_endpoint
    assert replay is not None
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay)
    try:
        await pub.start()
        for i in range(4):
            pub.publish(our_batch(i))
        await wait_until(lambda: pub.next_seq == 4)
        # vLLM's replay client: an empty delimiter, then the start seq, 8 bytes big-endian.
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        got = []
        while True:
            frames = await arecv(dealer)
            assert len(frames) == 4 and frames[0] == b""
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", b"\xff" * 8, b""]
                break
            got.append((int.from_bytes(frames[2], "big"), decoder.decode(frames[3])))
        assert got == [(2, vllm_batch(2)), (3, vllm_batch(3))]
    finally:
        dealer.close()
        await pub.aclose()


hashes = st.one_of(st.integers(0, (1 << 64) - 1), st.binary(min_size=32, max_size=32))
maybe = st.none() | st.sampled_from(["GPU", "CPU", "x"])
stored_kw = st.fixed_dictionaries(
    dict(
        block_hashes=st.lists(hashes, max_size=3),
        parent_block_hash=st.none() | hashes,
        token_ids=st.lists(st.integers(0, 1 << 20), max_size=20),
        block_size=st.integers(0, 64),
        lora_id=st.none() | st.integers(0, 9),
        medium=maybe,
        lora_name=st.none() | st.text(max_size=4),
    ),
    optional=dict(
        group_idx=st.none() | st.integers(0, 4),
        kv_cache_spec_kind=st.none() | st.just("mamba"),
        kv_cache_spec_sliding_window=st.none() | st.integers(0, 9),
        locality=st.none() | st.just("REMOTE"),
        ownership=maybe,
        session_id=st.none() | st.text(max_size=4),
        lookahead_token_ids=st.none()
        | st.lists(st.lists(st.integers(0, 9), max_size=2), max_size=2),
    ),
)
removed_kw = st.fixed_dictionaries(
    dict(block_hashes=st.lists(hashes, max_size=3), medium=maybe),
    optional=dict(group_idx=st.none() | st.integers(0, 4), locality=maybe, ownership=maybe),
)
event_kw: st.SearchStrategy[tuple[str, dict[str, Any]]] = st.one_of(
    st.tuples(st.just("BlockStored"), stored_kw),
    st.tuples(st.just("BlockRemoved"), removed_kw),
    st.tuples(st.just("AllBlocksCleared"), st.just({})),
)


@settings(max_examples=80, deadline=None)
@given(
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(event_kw, max_size=4),
    st.none() | st.integers(0, 8),
)
def test_byte_identical_to_vllm_and_cross_decodable(
    ts: float, events: list[tuple[str, dict[str, Any]]], rank: int | None
) -> None:
    assert vkv is not None
    theirs = vkv.KVEventBatch(ts, [getattr(vkv, n)(**kw) for n, kw in events], rank)
    ours = EventBatch(ts, [OURS[n](**kw) for n, kw in events], rank)
    raw = encode_batch(ours)
    assert raw == msgspec.msgpack.encode(theirs)
    assert msgspec.msgpack.Decoder(vkv.KVEventBatch).decode(raw) == theirs


def test_bench_smoke() -> None:
    from kvoffload.bench.suites.events import run_events_bench

    res = run_events_bench(quick=True, n_batches=2000, rounds=1)
    for key in ("ratio", "target", "meets", "ours_events_per_s", "vllm_events_per_s", "ratio_8"):
        assert key in res
    assert res["target"] == 4.0 and res["ours_events_per_s"] > 0 and res["vllm_events_per_s"] > 0
    assert res["lost_events"] == {"ours": 0, "vllm": 0}
