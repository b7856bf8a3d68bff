"""Router profiles, ownership, topics, per-engine views, and the replay buffer in events.

The daemon runs as a process; a simulated engine stores chunks (two engine blocks each) and
tails in an attention group and a Mamba group; the stream is read back through vLLM's replay
protocol. The llm-d wire check decodes with plain msgpack and reads fields by the positions
llm-d's parser uses (fixture below, from llm-d-kv-cache v0.8.1,
pkg/kvevents/engineadapter/vllm_adapter.go, commit 7be76e1, 2026-06-12).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from array import array
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, make_key
from kvoffload.daemon.config import Config
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.streams.publish import event_options
from kvoffload.events.profiles import make_profile, parse_view_spec
from kvoffload.events.publisher import EventPublisher
from kvoffload.events.schema import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch_positional,
    hash_to_int,
)
from kvoffload.events.subscriber import EventSubscriber, Received
from prometheus_client import CollectorRegistry

from tests.daemon.streams.test_publish import replay_all
from tests.daemon_helpers import run_daemon
from tests.events_helpers import block_events, stored

TPH, BLOCK, BPC = 4, 8, 2  # tokens per hash, per engine block, engine blocks per chunk
GEOM = Geometry(namespace="profiles", tokens_per_hash=TPH, blocks_per_chunk=BPC, groups=(
    GroupSpec(kind=GroupKind.FULL_ATTENTION, tokens_per_block=BLOCK, bytes_per_block=256),
    GroupSpec(kind=GroupKind.MAMBA, tokens_per_block=BLOCK, bytes_per_block=256)))
CHUNK = BLOCK * BPC

# llm-d-kv-cache v0.8.1: positions its vLLM adapter reads (tag at 0; later ones ignored).
LLMD_STORED = {"tag": 0, "block_hashes": 1, "parent_block_hash": 2, "token_ids": 3,
               "block_size": 4, "lora_id": 5, "medium": 6, "lora_name": 7, "extra_keys": 8,
               "group_idx": 9, "kv_cache_spec_kind": 10, "kv_cache_spec_sliding_window": 11}
LLMD_REMOVED = {"tag": 0, "block_hashes": 1, "medium": 2, "group_idx": 3}


def fine_chain(tokens: list[int]) -> list[bytes]:
    h, out = b"seed", []
    for i in range(len(tokens) // TPH):
        h = hashlib.sha256(h + array("I", tokens[i * TPH:(i + 1) * TPH]).tobytes()).digest()
        out.append(h)
    return out


def store_items(tokens: list[int], fine: list[bytes], tail_end: int) -> list[p.StoreItem]:
    """Every complete chunk of both groups, and a tail ending at `tail_end`."""
    items = []
    for g in (0, 1):
        for end in range(CHUNK, len(tokens) + 1, CHUNK):
            start = end - CHUNK
            items.append(p.StoreItem(key=make_key(fine[end // TPH - 1], g), end_token=end,
                                     token_ids=tokens[start:end],
                                     block_hashes=fine[start // TPH:end // TPH],
                                     parent_hash=fine[start // TPH - 1] if start else None))
        start = tail_end // CHUNK * CHUNK
        items.append(p.StoreItem(key=make_key(fine[tail_end // TPH - 1], g), end_token=tail_end,
                                 tail=True, token_ids=tokens[start:tail_end],
                                 block_hashes=fine[start // TPH:tail_end // TPH],
                                 parent_hash=fine[start // TPH - 1] if start else None))
    return items


def run_engine(control: str, reset: bool = True) -> tuple[list[int], list[bytes]]:
    tokens = list(range(1000, 1000 + 2 * CHUNK + 8))  # two chunks, then an 8-token tail
    fine = fine_chain(tokens)
    c = DaemonClient(control, timeout_ms=5000)
    try:
        c.register(GEOM)
        items = store_items(tokens, fine, 2 * CHUNK + 8)
        grant = c.prepare_store(items)
        assert all(o == p.StoreOutcome.GRANTED for o in grant.outcomes)
        assert c.commit_store([i.key for i in items]) == len(items)
        if reset:
            c.reset()  # every block leaves the pool: removals
    finally:
        c.close()
    return tokens, fine


def settle(replay: str, n: int, decode: Any = decode_batch) -> list[Any]:
    """Batches of the stream once it holds `n` events (publishing is asynchronous)."""
    deadline = time.monotonic() + 10
    while True:
        batches = [decode(pl) for pl in replay_all(replay)]
        if sum(len(b.events) if hasattr(b, "events") else len(b[1]) for b in batches) >= n \
                or time.monotonic() > deadline:
            return batches


def test_dynamo_profile_attention_chunks_at_engine_blocks_no_tails_quiet_removals(
        tmp_path: Path) -> None:
    with run_daemon(tmp_path, "--events-profile", "dynamo", "--events", "tcp://127.0.0.1:0",
                    "--events-replay", "tcp://127.0.0.1:0") as d:
        tokens, fine = run_engine(d.control)
        events = [e for b in settle(d.ready["events_replay"], 4) for e in b.events]
    ints = [hash_to_int(h) for h in fine]
    per = BLOCK // TPH
    stores = [e for e in events if isinstance(e, BlockStored)]
    removals = [e for e in events if isinstance(e, BlockRemoved)]
    # Two chunks of the attention group, each as its two engine blocks; nothing else.
    assert [(e.block_hashes, e.block_size, e.group_idx, e.kv_cache_spec_kind) for e in stores] \
        == [([ints[per - 1], ints[2 * per - 1]], BLOCK, 0, "full_attention"),
            ([ints[3 * per - 1], ints[4 * per - 1]], BLOCK, 0, "full_attention")]
    assert stores[0].token_ids == tokens[:CHUNK] and stores[0].parent_block_hash is None
    assert stores[1].token_ids == tokens[CHUNK:2 * CHUNK]
    assert stores[1].parent_block_hash == ints[2 * per - 1]
    assert all(e.ownership is None for e in stores + removals)  # Dynamo drops any ownership
    assert sorted(map(tuple, (e.block_hashes for e in removals))) == \
        sorted(tuple(e.block_hashes) for e in stores)  # only what was announced


def test_dynamo_profile_tails_when_asked(tmp_path: Path) -> None:
    with run_daemon(tmp_path, "--events-profile", "dynamo", "--events-tails", "--events",
                    "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0") as d:
        tokens, fine = run_engine(d.control, reset=False)
        events = [e for b in settle(d.ready["events_replay"], 3) for e in b.events]
    tails = [e for e in events if isinstance(e, BlockStored) and e.block_size == TPH]
    # vLLM #51243: fine hashes from the tail's block start, parent = the hash just before.
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.group_idx) for e in tails] == \
        [([hash_to_int(h) for h in fine[8:10]], hash_to_int(fine[7]), tokens[32:40], 0)]


def test_full_profile_keeps_everything_and_sets_ownership(tmp_path: Path) -> None:
    with run_daemon(tmp_path, "--events-ownership", "kvoffload", "--events",
                    "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0") as d:
        run_engine(d.control)
        batches = settle(d.ready["events_replay"], 12)
    events = [e for b in batches for e in b.events]
    stores = [e for e in events if isinstance(e, BlockStored)]
    assert len(stores) == 6 and {e.group_idx for e in stores} == {0, 1}  # 2 chunks + tail x2
    assert sum(isinstance(e, BlockRemoved) for e in events) == 6
    assert {e.ownership for e in events} == {"kvoffload"}
    assert len(batches) < len(events)  # one commit's events share a batch


def test_llmd_profile_positional_events_on_the_node_topic(tmp_path: Path) -> None:
    with run_daemon(tmp_path, "--events-profile", "llm-d", "--events-model", "Qwen/Qwen3",
                    "--events-node", "node-7", "--events", "tcp://127.0.0.1:0",
                    "--events-replay", "tcp://127.0.0.1:0") as d:
        s: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(d.ready["events_replay"])
        tokens, fine = run_engine(d.control)
        raw = settle(d.ready["events_replay"], 12, msgspec.msgpack.decode)
        s.send_multipart([b"", (0).to_bytes(8, "big")])
        assert s.poll(5000)
        topic = s.recv_multipart()[1]
        s.close()
    assert topic == b"kv@node:node-7@Qwen/Qwen3"  # llm-d: kv@<pod>@<model>, split on "@"
    events = [e for b in raw for e in b[1]]
    assert all(isinstance(e, list) for e in events)  # positional: llm-d fails on maps
    first = events[0]
    f = LLMD_STORED
    assert first[f["tag"]] == "BlockStored"
    assert first[f["block_hashes"]] == [hash_to_int(fine[CHUNK // TPH - 1])]
    assert first[f["parent_block_hash"]] is None
    assert first[f["token_ids"]] == tokens[:CHUNK] and first[f["block_size"]] == CHUNK
    assert first[f["lora_id"]] is None and first[f["medium"]] == "CPU"
    assert first[f["group_idx"]] == 0 and first[f["kv_cache_spec_kind"]] == "full_attention"
    assert first[f["kv_cache_spec_sliding_window"]] is None
    removed = next(e for e in events if e[0] == "BlockRemoved")
    assert removed[LLMD_REMOVED["medium"]] == "CPU"
    assert removed[LLMD_REMOVED["group_idx"]] in (0, 1)
    assert isinstance(removed[LLMD_REMOVED["block_hashes"]][0], int)


def test_positional_encoding_round_trips_through_our_decoder() -> None:
    batch = EventBatch(ts=2.5, events=[stored(1, group_idx=1, kv_cache_spec_kind="mamba",
                                              locality="LOCAL", ownership="o"),
                                       BlockRemoved([5], "CPU", group_idx=1)],
                       data_parallel_rank=4)
    raw = encode_batch_positional(batch)
    assert decode_batch(raw) == batch
    generic = msgspec.msgpack.decode(raw)
    assert generic[2] == 4 and generic[1][0][13] == "o"  # ownership right after locality


async def test_engine_view_merges_its_engine_and_stamps_its_rank(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    engine = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", registry=reg,
                            data_parallel_rank=0)
    await engine.start()
    try:
        view = "rank=5,events=tcp://127.0.0.1:0,replay=tcp://127.0.0.1:0,engine=0"
        spec = f"{engine.bound_endpoint},{engine.bound_replay_endpoint}"
        with run_daemon(tmp_path, "--engine-events", spec, "--engine-view", view,
                        "--engine-view", "rank=6,events=tcp://127.0.0.1:0") as d:
            gpu = stored(3)
            engine.publish(gpu)
            await asyncio.to_thread(run_engine, d.control, False)
            views = d.ready["engine_views"]
            assert [v["rank"] for v in views] == [5, 6] and views[1]["replay"] is None
            deadline = time.monotonic() + 10
            while True:
                got = [decode_batch(pl) for pl in replay_all(views[0]["replay"])]
                events = block_events(e for b in got for e in b.events)
                if any(e.medium == "GPU" for e in events) and len(events) >= 7 \
                        or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
    finally:
        await engine.aclose(flush=False)
    assert {b.data_parallel_rank for b in got} == {5}
    assert [e for e in events if e.medium == "GPU"] == [gpu]
    assert sum(e.medium == "CPU" for e in events) == 6


async def test_replay_buffer_is_bounded_in_events_and_bytes(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", registry=reg,
                         buffer_events=7, buffer_bytes=1 << 20)
    await pub.start()
    try:
        for i in range(6):
            pub.publish(EventBatch(ts=float(i), events=[stored(10 * i + j) for j in range(3)]))
        while pub.queued:
            await asyncio.sleep(0.001)
        assert pub.bound_replay_endpoint is not None
        got = [decode_batch(pl) for pl in await asyncio.to_thread(
            replay_all, pub.bound_replay_endpoint)]
        assert [b.ts for b in got] == [4.0, 5.0]  # 6 events kept; a third batch makes 9
        assert pub.buffered[:2] == (2, 6)
        small = EventPublisher("tcp://127.0.0.1:0", registry=reg, buffer_bytes=1)
        await small.start()
        small.publish(stored(1))
        small.publish(stored(2))
        while small.queued:
            await asyncio.sleep(0.001)
        assert small.buffered[:2] == (1, 1)  # over the byte bound, the newest batch stays
        await small.aclose(flush=False)
    finally:
        await pub.aclose(flush=False)


async def test_events_of_one_loop_turn_share_batches_of_bounded_size() -> None:
    reg = CollectorRegistry()
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", registry=reg,
                         max_batch_events=4)
    await pub.start()
    sub = EventSubscriber(pub.bound_endpoint, pub.bound_replay_endpoint, from_seq=0,
                          registry=reg)
    try:
        async with sub:
            for i in range(10):  # one loop turn
                pub.publish(stored(i))
            sizes = []
            for _ in range(3):
                item = await sub.recv(5.0)
                assert isinstance(item, Received)
                sizes.append(len(item.batch.events))
            assert sizes == [4, 4, 2]
            pub.publish(stored(99))  # alone: it goes out without waiting for company
            item = await sub.recv(5.0)
            assert isinstance(item, Received) and item.seq == 3
            assert item.batch.events == [stored(99)]
    finally:
        await pub.aclose(flush=False)


def test_profile_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="dynamo"):
        make_profile("dynamo", ownership="kvcr")
    with pytest.raises(ValueError, match="unknown events profile"):
        make_profile("sglang")
    with pytest.raises(ValueError, match="events_model"):
        event_options(Config(events_profile="llm-d"))
    with pytest.raises(ValueError, match="ownership"):
        Config(events_profile="dynamo", events_ownership="x")
    for bad in ("rank=0", "events=tcp://x:1", "rank=a,events=e", "rank=0,events=e,colour=1",
                "rank=-1,events=e"):
        with pytest.raises(ValueError, match="engine view"):
            parse_view_spec(bad)
    spec = parse_view_spec("rank=2, events=tcp://h:1, replay=tcp://h:2, engine=1, topic=t")
    assert (spec.rank, spec.endpoint, spec.replay, spec.engine, spec.topic) == \
        (2, "tcp://h:1", "tcp://h:2", 1, "t")
    assert event_options(Config(events_profile="llm-d", events_model="m",
                                events_node="n"))["topic"] == "kv@node:n@m"
