"""The daemon's own KV events and lookup events, checked against the consumers' rules."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from array import array

import msgspec
import pytest
import zmq
from kvoffload.events.schema import (
    BlockRemoved,
    BlockStored,
    decode_batch,
    decode_lookup_batch,
)

from tests.daemon_helpers import run_daemon

END = b"\xff" * 8
SEED = hashlib.sha256(b"kvoffload").digest()  # bench.workload.block_hashes' chain seed


def replay_all(endpoint: str, timeout_ms: int = 10_000) -> list[bytes]:
    """Every buffered batch payload, through vLLM's replay protocol (DEALER, end marker)."""
    s: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send_multipart([b"", (0).to_bytes(8, "big")])
    out: list[bytes] = []
    try:
        while True:
            assert s.poll(timeout_ms), "replay did not finish"
            frames = s.recv_multipart()
            if frames[2] == END:
                return out
            out.append(frames[3])
    finally:
        s.close()


def run_demo(control: str, *args: str) -> dict:
    res = subprocess.run([sys.executable, "-m", "kvoffload", "demo", "--json", "--connect",
                          control, *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def chain_ok(parent: int | bytes | None, tokens: list[int], tph: int,
             hashes: list[int | bytes]) -> bool:
    """Recompute the demo's sha256 chain over the event's tokens and compare its hashes
    (bytes: the daemon here runs with ``--event-hashes bytes``)."""
    assert parent is None or isinstance(parent, bytes), parent
    h = SEED if parent is None else parent
    fine = []
    for i in range(len(tokens) // tph):
        h = hashlib.sha256(h + array("I", tokens[i * tph:(i + 1) * tph]).tobytes()).digest()
        fine.append(h)
    return fine == hashes or (len(hashes) == 1 and fine[-1:] == hashes)


@pytest.fixture
def daemon(tmp_path):
    with run_daemon(tmp_path, "--events", "tcp://127.0.0.1:*", "--events-replay",
                    "tcp://127.0.0.1:*", "--lookup-events", "tcp://127.0.0.1:*",
                    "--event-hashes", "bytes", pool_bytes=8 << 20) as d:
        yield d


def test_every_stored_block_is_self_describing_and_removals_match(daemon) -> None:
    lookups: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    lookups.setsockopt(zmq.SUBSCRIBE, b"")
    lookups.connect(daemon.ready["lookup_events"])
    time.sleep(0.3)  # PUB/SUB join before the first lookup
    summary = run_demo(daemon.control, "--requests", "80")
    assert summary["evicted_keys"] > 0  # the small pool forces removals too
    payloads = replay_all(daemon.ready["events_replay"])
    stored: dict[tuple[tuple[int | bytes, ...], int], BlockStored] = {}
    removed = 0
    kinds = set()
    for payload in payloads:
        for ev in decode_batch(payload).events:
            if isinstance(ev, BlockStored):
                assert ev.block_size > 0 and ev.medium == "CPU" and ev.locality == "LOCAL"
                assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
                assert chain_ok(ev.parent_block_hash, ev.token_ids, 16, ev.block_hashes)
                assert ev.group_idx is not None
                kinds.add((ev.kv_cache_spec_kind, ev.block_size))
                stored[(tuple(ev.block_hashes), ev.group_idx)] = ev
            elif isinstance(ev, BlockRemoved):
                key = (tuple(ev.block_hashes), ev.group_idx)
                assert key in stored, "a removal must match an earlier store"
                del stored[key]
                removed += 1
    # Chunks (784-token blocks) and tails (16-token units) of attention and Mamba groups.
    assert {("full_attention", 784), ("mamba", 784), ("full_attention", 16),
            ("mamba", 16)} <= kinds
    assert removed > 0
    events = []
    while lookups.poll(500):
        events.extend(decode_lookup_batch(lookups.recv_multipart()[2]).events)
    lookups.close()
    assert len(events) == summary["requests"]
    assert sum(e.hit_tokens for e in events) == summary["hit_tokens"]
    assert sum(e.tail_hit_tokens for e in events) == summary["tail_hit_tokens"]
    assert {e.outcome for e in events} <= {"hit", "partial", "miss"}
    assert all(e.miss_reason for e in events if e.outcome == "miss")
    assert all(e.latency_us is not None and e.latency_us >= 0 for e in events)
    assert all(e.group_outcomes is not None and len(e.group_outcomes) == 4 for e in events)
    assert all(set(e.group_outcomes or []) == {"hit"} for e in events if e.outcome == "hit")
    assert any("miss" in (e.group_outcomes or []) for e in events if e.outcome == "miss")


@pytest.mark.vllm
def test_vllm_typed_decoder_accepts_every_batch(tmp_path) -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events",
                                    reason="vLLM 0.33.0 is not installed")
    with run_daemon(tmp_path, "--events", "tcp://127.0.0.1:*", "--events-replay",
                    "tcp://127.0.0.1:*", pool_bytes=8 << 20) as d:
        run_demo(d.control, "--requests", "40")
        decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
        payloads = replay_all(d.ready["events_replay"])
        assert payloads
        n = 0
        for payload in payloads:
            batch = decoder.decode(payload)
            for ev in batch.events:
                n += 1
                if isinstance(ev, kv_events.BlockStored):
                    assert all(isinstance(h, int) for h in ev.block_hashes)  # int by default
                    assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
        assert n > 0
