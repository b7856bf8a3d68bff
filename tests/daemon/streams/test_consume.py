"""The daemon's consumer of engines' KV-event streams: index, restarts, garbage, completion."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
import time
from array import array
from collections.abc import Callable
from typing import Any

import pytest
import zmq
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, make_key
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.streams.consume import EngineStreams
from kvoffload.events.publisher import SEQ, EventPublisher
from kvoffload.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    hash_to_int,
)
from prometheus_client import CollectorRegistry

from tests.daemon.streams.test_publish import replay_all
from tests.daemon_helpers import run_daemon


def gpu(h: int, tokens: list[int], parent: int | None = None, group: int | None = 0,
        bs: int = 4, medium: str | None = "GPU") -> BlockStored:
    return BlockStored(block_hashes=[h] if len(tokens) == bs else
                       [h + i for i in range(len(tokens) // bs)],
                       parent_block_hash=parent, token_ids=tokens, block_size=bs, lora_id=None,
                       medium=medium, lora_name=None, group_idx=group)


def sample(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0


async def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_index_store_remove_clear_and_budget() -> None:
    reg = CollectorRegistry()
    hub: list[EventBatch] = []
    known: list[int] = []
    s = EngineStreams(["tcp://127.0.0.1:1"], reg, max_tokens=16,
                      on_batch=lambda i, b: hub.append(b), on_block=known.append)
    # One event, two blocks: split per hash, the second's parent is the first.
    s.apply(0, EventBatch(ts=1.0, events=[gpu(10, list(range(8)), parent=9)]))
    assert s.find(11) is not None and s.find(11).parent == 10  # type: ignore[union-attr]
    assert s.find(11, group=1) is not None  # any group: same tokens
    assert list(s.find(10).tokens) == [0, 1, 2, 3] and known == [10, 11]  # type: ignore[union-attr]
    s.apply(0, EventBatch(ts=1.0, events=[gpu(10, [0, 1, 2, 3], group=1)]))
    s.apply(0, EventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[10], medium=None)]))
    assert s.find(10) is None and s.find(11) is not None  # medium None = GPU; group None = all
    # Over budget (16 tokens): the oldest block goes, and the hub hears it.
    s.apply(0, EventBatch(ts=1.0, events=[gpu(20, list(range(16)))]))
    assert s.find(11) is None and s.total_tokens == 16
    assert sample(reg, "kvoffload_engine_events_evicted_blocks_total", engine="0") == 1
    assert isinstance(hub[-1].events[0], BlockRemoved) and hub[-1].events[0].block_hashes == [11]
    # AllBlocksCleared reaches the hub as removals of this engine's blocks only.
    s.apply(0, EventBatch(ts=1.0, events=[AllBlocksCleared()]))
    assert s.total_tokens == 0 and s.resident(0) == 0
    assert not any(isinstance(e, AllBlocksCleared) for b in hub for e in b.events)
    assert sorted(hub[-1].events[0].block_hashes) == [20, 21, 22, 23]
    # Raw-digest hashes meet int ones on vLLM's int form.
    digest = hashlib.sha256(b"x").digest()
    s.apply(0, EventBatch(ts=1.0, events=[BlockStored(
        block_hashes=[digest], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4,
        lora_id=None, medium="GPU", lora_name=None)]))
    assert s.find(hash_to_int(digest)) is not None


async def test_publisher_restart_resets_the_engine_index(tmp_path: Any) -> None:
    reg = CollectorRegistry()
    hub: list[EventBatch] = []
    d = tempfile.mkdtemp(prefix="kvo-")  # ipc: a restarted PUB is rejoined at once
    ep, rep = f"ipc://{d}/e", f"ipc://{d}/r"
    # Own context: as another process would have (closing an asyncio socket of a shared
    # context can cancel other sockets' pending polls).
    pub = EventPublisher(ep, rep, registry=CollectorRegistry(), context=zmq.Context())
    await pub.start()
    for i in range(3):  # before the consumer exists: it must replay them from seq 0
        pub.publish(EventBatch(ts=time.time(), events=[gpu(100 + i, [i] * 4)]))
    s = EngineStreams([f"{ep},{rep}"], reg, on_batch=lambda i, b: hub.append(b))
    await s.start()
    try:
        await wait_for(lambda: s.resident(0) == 3)
        # One live batch too: the subscriber tells a restart from a replay duplicate only
        # by the live seqs it saw (a stream seen only through replay looks like duplicates).
        await asyncio.sleep(0.3)
        pub.publish(EventBatch(ts=time.time(), events=[gpu(103, [3] * 4)]))
        await wait_for(lambda: s.resident(0) == 4)
        await pub.aclose()
        pub = EventPublisher(ep, rep, registry=CollectorRegistry(), context=zmq.Context())
        await pub.start()
        await asyncio.sleep(0.5)  # let the SUB reconnect: seq 0 then reads as a restart
        pub.publish(EventBatch(ts=time.time(), events=[gpu(200, [7] * 4)]))
        await wait_for(lambda: sample(reg, "kvoffload_engine_events_resets_total",
                                      engine="0") == 1 and s.resident(0) == 1)
        assert s.find(200) is not None and s.find(100) is None
        removed = {h for b in hub for e in b.events if isinstance(e, BlockRemoved)
                   for h in e.block_hashes}
        assert removed == {100, 101, 102, 103}
    finally:
        await s.aclose()
        await pub.aclose()
        shutil.rmtree(d, ignore_errors=True)


async def test_malformed_frames_and_events_are_survived() -> None:
    reg = CollectorRegistry()
    ctx: zmq.Context[Any] = zmq.Context.instance()
    xpub = ctx.socket(zmq.XPUB)  # XPUB: we see when the daemon's SUB has joined
    xpub.setsockopt(zmq.LINGER, 0)
    port = xpub.bind_to_random_port("tcp://127.0.0.1")
    s = EngineStreams([f"tcp://127.0.0.1:{port}"], reg)
    await s.start()
    try:
        await wait_for(lambda: bool(xpub.poll(0)))
        xpub.recv()
        bad = EventBatch(ts=time.time(), events=[
            gpu(1, [1, 2, 3]),  # 3 tokens for one 4-token block
            BlockStored(block_hashes=[2], parent_block_hash=None, token_ids=[], block_size=0,
                        lora_id=None, medium="GPU", lora_name=None),
            gpu(3, [-1, 2, 3, 4]),  # not a token id
            gpu(4, [4, 4, 4, 4]),  # the one good event of the batch
        ])
        for frames in ([b"", b"x"], [b"", b"abc", b"x"], [b"", SEQ.pack(0), b"\xc1garbage"],
                       [b"", SEQ.pack(1), encode_batch(bad)],
                       [b"", SEQ.pack(2), encode_batch(EventBatch(ts=time.time(),
                                                                  events=[gpu(5, [5] * 4)]))]):
            xpub.send_multipart(frames)
        await wait_for(lambda: s.resident(0) == 2)
        assert s.find(4) is not None and s.find(5) is not None
        assert sample(reg, "kvoffload_engine_events_malformed_events_total", engine="0") == 3
        assert sample(reg, "kvoffload_events_subscriber_malformed_total", stream="engine-0",
                      kind="payload") == 1
        assert s.engines[0].task is not None and not s.engines[0].task.done()
    finally:
        await s.aclose()
        xpub.close()


# -- completion through the daemon process, fed by vLLM's own publisher ------------------------

GEOM = Geometry(namespace="complete", tokens_per_hash=4, groups=(
    GroupSpec(kind=GroupKind.FULL_ATTENTION, tokens_per_block=16, bytes_per_block=256),
    GroupSpec(kind=GroupKind.MAMBA, tokens_per_block=16, bytes_per_block=256)))


def chain(n_blocks: int, seed: bytes) -> tuple[list[bytes], list[list[int]]]:
    """Block hashes (last fine hash of each 16-token block) and each block's tokens."""
    h, hashes, blocks = seed, [], []
    for b in range(n_blocks):
        toks = [int.from_bytes(hashlib.sha256(seed + bytes([b, i])).digest()[:3], "big")
                for i in range(16)]
        for f in range(4):
            h = hashlib.sha256(h + array("I", toks[f * 4:f * 4 + 4]).tobytes()).digest()
        hashes.append(h)
        blocks.append(toks)
    return hashes, blocks


@pytest.mark.vllm
def test_vllm_publisher_completes_store_payloads(tmp_path: Any) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    kv = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM 0.33.0 is not installed")
    engine = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint="tcp://127.0.0.1:*",
                                  replay_endpoint="tcp://127.0.0.1:*")
    hashes, blocks = chain(3, b"vllm")
    ints = [hash_to_int(h) for h in hashes]

    def publish(i: int) -> None:
        engine.publish(kv.KVEventBatch(ts=time.time(), events=[kv.BlockStored(
            block_hashes=[ints[i]], parent_block_hash=ints[i - 1] if i else None,
            token_ids=blocks[i], block_size=16, lora_id=None, medium="GPU", lora_name="ad",
            group_idx=0, kv_cache_spec_kind="full_attention")]))

    publish(0)
    publish(1)  # before the daemon starts: it replays them from seq 0
    try:
        with run_daemon(tmp_path, "--engine-events",
                        f"{engine._pub.getsockopt_string(zmq.LAST_ENDPOINT)},"
                        f"{engine._replay.getsockopt_string(zmq.LAST_ENDPOINT)}", "--events",
                        "tcp://127.0.0.1:*", "--events-replay", "tcp://127.0.0.1:*",
                        pool_bytes=4 << 20) as d:
            c = DaemonClient(d.control, timeout_ms=5000)
            c.register(GEOM)
            time.sleep(0.5)  # the daemon's replay of blocks 0-1 has landed
            # No token ids: block 1 in both groups (known already), block 2 (not yet).
            keys = [make_key(hashes[1], 0), make_key(hashes[1], 1), make_key(hashes[2], 0)]
            grant = c.prepare_store([p.StoreItem(key=k, end_token=32) for k in keys])
            assert all(o == p.StoreOutcome.GRANTED for o in grant.outcomes)
            assert c.commit_store(keys) == 3
            publish(2)  # the awaiting store of block 2 completes now
            deadline = time.monotonic() + 10
            while True:
                got = [e for pl in replay_all(d.ready["events_replay"])
                       for e in decode_batch(pl).events if isinstance(e, BlockStored)]
                if len(got) == 3 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            c.close()
            by = {(e.block_hashes[0], e.group_idx): e for e in got}
            assert set(by) == {(ints[1], 0), (ints[1], 1), (ints[2], 0)}, d.log()[-3000:]
            for (h, group), e in by.items():
                assert isinstance(h, int), h  # the daemon's default: int hashes
                i = ints.index(h)
                assert e.token_ids == blocks[i] and e.block_size == 16 and e.medium == "CPU"
                assert e.parent_block_hash == ints[i - 1] and e.lora_name == "ad"
                assert e.kv_cache_spec_kind == ("mamba" if group else "full_attention")
    finally:
        engine.shutdown()
