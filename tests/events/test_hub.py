"""The node event hub: merged stream, replay, and snapshot + live == the daemon's own state."""

from __future__ import annotations

import asyncio
import io
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import zmq
from kvoffload.connector.client import DaemonClient
from kvoffload.events.hub import SNAPSHOT_SEQ, request_snapshot
from kvoffload.events.lookup_publisher import LookupEventPublisher
from kvoffload.events.publisher import END_SEQ, SEQ
from kvoffload.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    LookupEvent,
    decode_batch,
    encode_batch,
)
from kvoffload.events.tail import tail
from prometheus_client import CollectorRegistry

from tests.daemon.streams.test_publish import replay_all
from tests.daemon_helpers import run_daemon


class Model:
    """A router's index: GPU blocks per hash (vLLM splits them), CPU entries per event key."""

    def __init__(self) -> None:
        self.gpu: dict[tuple[int | None, Any], tuple[tuple[int, ...], Any]] = {}
        self.cpu: dict[tuple[int | None, tuple[Any, ...]], tuple[tuple[int, ...], Any, int]] = {}

    def apply(self, payload: bytes) -> None:
        for ev in decode_batch(payload).events:
            if isinstance(ev, BlockStored):
                assert ev.block_size > 0 and len(ev.token_ids) == ev.block_size * len(
                    ev.block_hashes)
                if ev.medium == "CPU":
                    self.cpu[(ev.group_idx, tuple(ev.block_hashes))] = (
                        tuple(ev.token_ids), ev.parent_block_hash, ev.block_size)
                    continue
                parent, bs = ev.parent_block_hash, ev.block_size
                for i, h in enumerate(ev.block_hashes):
                    self.gpu[(ev.group_idx, h)] = (tuple(ev.token_ids[i * bs:(i + 1) * bs]),
                                                   parent)
                    parent = h
            elif isinstance(ev, BlockRemoved):
                if ev.medium == "CPU":
                    self.cpu.pop((ev.group_idx, tuple(ev.block_hashes)), None)
                    continue
                for h in ev.block_hashes:
                    self.gpu.pop((ev.group_idx, h), None)
            else:
                raise AssertionError("the hub never forwards AllBlocksCleared")


class FakeEngine:
    """A vLLM-like GPU publisher on a raw XPUB: random stores, removals and one clear."""

    def __init__(self, sock: zmq.Socket[Any], rng: random.Random) -> None:
        self.sock, self.rng, self.seq = sock, rng, 0
        self.resident: list[tuple[int | bytes, int]] = []  # (hash, group)

    def publish(self, events: list[KVEvent]) -> None:
        batch = EventBatch(ts=time.time(), events=events, data_parallel_rank=0)
        self.sock.send_multipart([b"", SEQ.pack(self.seq), encode_batch(batch)])
        self.seq += 1

    def marker(self) -> BlockRemoved:
        """Publish a block's store and then its removal (no net change); returns the removal."""
        h = self.rng.getrandbits(63)
        self.publish([BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[1] * 4,
                                  block_size=4, lora_id=None, medium="GPU", lora_name=None,
                                  group_idx=0, kv_cache_spec_kind="full_attention")])
        removal = BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0)
        self.publish([removal])
        return removal

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.6 or not self.resident:
            n, group = self.rng.randint(1, 3), self.rng.randint(0, 1)
            hashes: list[int | bytes] = [self.rng.getrandbits(63) for _ in range(n)]
            self.publish([BlockStored(
                block_hashes=hashes, parent_block_hash=self.rng.choice([None, 7]),
                token_ids=[self.rng.randrange(50_000) for _ in range(4 * n)], block_size=4,
                lora_id=None, medium="GPU", lora_name=None, group_idx=group,
                kv_cache_spec_kind="full_attention")])
            self.resident += [(h, group) for h in hashes]
        elif r < 0.98:
            h, group = self.resident.pop(self.rng.randrange(len(self.resident)))
            self.publish([BlockRemoved(block_hashes=[h], medium="GPU", group_idx=group)])
        else:
            self.publish([AllBlocksCleared()])
            self.resident.clear()


def replay_from(endpoint: str, start: int) -> dict[int, bytes]:
    s: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.connect(endpoint)
    s.send_multipart([b"", SEQ.pack(start)])
    out: dict[int, bytes] = {}
    try:
        while True:
            assert s.poll(10_000), "replay did not finish"
            frames = s.recv_multipart()
            if frames[2] == END_SEQ:
                return out
            out[SEQ.unpack(frames[2])[0]] = frames[3]
    finally:
        s.close()


def test_snapshot_plus_live_rebuilds_the_daemons_index(tmp_path: Any) -> None:
    rng = random.Random(int(time.time()))
    ctx: zmq.Context[Any] = zmq.Context.instance()
    xpub = ctx.socket(zmq.XPUB)
    xpub.setsockopt(zmq.LINGER, 0)
    port = xpub.bind_to_random_port("tcp://127.0.0.1")
    live = ctx.socket(zmq.SUB)
    live.setsockopt(zmq.RCVHWM, 0)
    live.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        with run_daemon(tmp_path, "--engine-events", f"tcp://127.0.0.1:{port}",
                        "--hub", "tcp://127.0.0.1:*", "--hub-replay", "tcp://127.0.0.1:*",
                        "--events", "tcp://127.0.0.1:*", "--events-replay", "tcp://127.0.0.1:*",
                        pool_bytes=8 << 20) as d:
            assert xpub.poll(10_000), "the daemon never subscribed to the engine"
            xpub.recv()
            engine = FakeEngine(xpub, rng)
            live.connect(d.ready["hub"])
            time.sleep(0.3)  # SUB joined before anything we want live
            demo = subprocess.Popen(
                [sys.executable, "-m", "kvoffload", "demo", "--json", "--connect", d.control,
                 "--requests", "150", "--seed", str(rng.randrange(1000))],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for _ in range(100):
                engine.step()
            time.sleep(rng.random() * 0.8)  # somewhere inside the demo run
            resume, snap = request_snapshot(d.ready["hub_replay"])
            assert resume >= 0 and snap
            for _ in range(300):
                engine.step()
                if rng.random() < 0.1:
                    time.sleep(0.005)
            out, err = demo.communicate(timeout=120)
            assert demo.returncode == 0, err
            # The daemon reads the engine's stream in order and the hub publishes in order:
            # once a marker sent last comes back on the hub, everything before it is in.
            # (A fixed pause lost this race on a loaded machine.)
            got: dict[int, bytes] = {}
            marker = engine.marker()
            deadline = time.monotonic() + 60
            seen = False
            while not seen:
                assert time.monotonic() < deadline and live.poll(10_000), "no hub marker"
                frames = live.recv_multipart()
                got[SEQ.unpack(frames[1])[0]] = frames[2]
                seen = any(isinstance(ev, BlockRemoved) and ev.medium == "GPU" and
                           ev.block_hashes == marker.block_hashes
                           for ev in decode_batch(frames[2]).events)
            final_resume, final = request_snapshot(d.ready["hub_replay"])
            while live.poll(300):
                frames = live.recv_multipart()
                got[SEQ.unpack(frames[1])[0]] = frames[2]
            assert got, "nothing arrived live on the hub"
            for seq, payload in replay_from(d.ready["hub_replay"], resume).items():
                got.setdefault(seq, payload)  # whatever the SUB missed
            rebuilt = Model()
            for payload in snap:
                rebuilt.apply(payload)
            for seq in range(resume, final_resume):
                rebuilt.apply(got[seq])
            expect = Model()
            for payload in final:
                expect.apply(payload)
            assert expect.gpu and expect.cpu and final_resume > resume
            assert rebuilt.gpu == expect.gpu and rebuilt.cpu == expect.cpu
            # GPU part: what the engine says is resident; CPU part: the daemon's own index.
            assert set(expect.gpu) == {(g, h) for h, g in engine.resident}
            own = Model()
            for payload in replay_all(d.ready["events_replay"]):
                own.apply(payload)
            assert own.cpu == rebuilt.cpu and own.gpu == {}
            client = DaemonClient(d.control, timeout_ms=5000)
            assert len(rebuilt.cpu) == client.stats()["ready"] > 0
            client.close()
    finally:
        live.close()
        xpub.close()


def test_snapshot_of_an_empty_hub_and_plain_replay(tmp_path: Any) -> None:
    with run_daemon(tmp_path, "--hub", "tcp://127.0.0.1:*", "--hub-replay",
                    "tcp://127.0.0.1:*") as d:
        resume, snap = request_snapshot(d.ready["hub_replay"])
        assert resume == 0 and [decode_batch(pl).events for pl in snap] == [[]]
        assert replay_from(d.ready["hub_replay"], 0) == {}  # ordinary replay still works
        assert SEQ.unpack(END_SEQ)[0] != SNAPSHOT_SEQ


async def test_tail_prints_lookup_events_by_decoding() -> None:
    d = tempfile.mkdtemp(prefix="kvo-")
    pub = LookupEventPublisher(f"ipc://{d}/l", f"ipc://{d}/lr", registry=CollectorRegistry())
    await pub.start()
    try:
        pub.publish([
            LookupEvent(request_id="r1", namespace="ns", prompt_tokens=100, local_tokens=16,
                        hit_tokens=48, chunk_hit_tokens=32, tail_hit_tokens=16,
                        tail_boundary=96, outcome="partial", miss_reason="tail_not_stored"),
            LookupEvent(request_id="r2", namespace="ns", prompt_tokens=10, local_tokens=0,
                        hit_tokens=0, chunk_hit_tokens=0, tail_hit_tokens=0, tail_boundary=None,
                        outcome="miss", miss_reason="evicted")])
        await asyncio.sleep(0.05)
        human, js = io.StringIO(), io.StringIO()
        for out, as_json, lookup in ((human, False, False), (js, True, True)):
            await asyncio.wait_for(tail(f"ipc://{d}/l", replay=f"ipc://{d}/lr", from_seq=0,
                                        as_json=as_json, lookup=lookup, count=2, out=out), 10)
        lines = human.getvalue().splitlines()
        assert lines[0].startswith("seq=0 ") and "LookupEvent v1 partial req=r1" in lines[0]
        assert "tail=16@96" in lines[0] and "miss_reason=evicted" in lines[1]
        recs = [json.loads(x) for x in js.getvalue().splitlines()]
        assert recs[1]["type"] == "LookupEvent" and recs[1]["schema_version"] == 1
        assert recs[1]["miss_reason"] == "evicted" and recs[0]["hit_tokens"] == 48
    finally:
        await pub.aclose()
        shutil.rmtree(d, ignore_errors=True)
