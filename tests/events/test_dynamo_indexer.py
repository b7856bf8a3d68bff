"""The real consumer: NVIDIA Dynamo 1.6.1's own KV indexer indexes the daemon's events.

A daemon with ``--events-profile dynamo`` and two per-engine views runs the demo's simulated
engine; Dynamo's ``python -m dynamo.indexer`` (its ZMQ listener, decoder and radix tree)
subscribes to both views, registered at the engine's block size, one worker per engine. Then:

* every full-attention chunk the daemon's stream holds is in Dynamo's index, under both
  workers, with the DP rank of its view, in the host tier; nothing else is (no Mamba block, no
  tail); with the disk tier the same holds for STORAGE blocks in Dynamo's disk tier; engine
  0's own GPU blocks (vLLM's publisher, merged into its view) are on worker 1 only;
* a prefix query through the indexer's HTTP API matches, for every prompt of the run, the
  longest prefix of chunks the stream holds (computed from the workload's own hashes);
* a listener registered after a 20k-event run recovers the whole index by replay, with no
  "Replay incomplete" report.

Skips (with the reason) where the Dynamo wheel cannot be installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from kvoffload.bench.workload import PRESETS, block_hashes, chat_turns
from kvoffload.events.schema import hash_to_int

from tests.daemon_helpers import run_daemon
from tests.dynamo_helpers import DynamoIndexer, dynamo_python, replay_state

HYBRID = "qwen3-next-80b-tp1"  # 544-token blocks: 1 attention + 3 Mamba groups
ATTENTION = "llama-8b-attention-only"  # 16-token blocks


@pytest.fixture(scope="module")
def dynamo() -> Path:
    py, why = dynamo_python()
    if py is None:
        pytest.skip(f"Dynamo's indexer is not available: {why}")
    return py


@pytest.fixture
def indexer(dynamo: Path) -> Iterator[DynamoIndexer]:
    workdir = Path(tempfile.mkdtemp(prefix="kvo-dyn-"))
    idx = DynamoIndexer(dynamo, workdir)
    try:
        yield idx
    finally:
        idx.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _views() -> list[str]:
    # Engine 0's view also carries that engine's own GPU stream (--engine-events #0).
    return ["--engine-view", "rank=0,events=tcp://127.0.0.1:0,replay=tcp://127.0.0.1:0,engine=0",
            "--engine-view", "rank=1,events=tcp://127.0.0.1:0,replay=tcp://127.0.0.1:0"]


@pytest.fixture
def vllm_engine() -> Iterator[tuple[Any, Any]]:
    """vLLM 0.33's own KV-event publisher, standing in for engine 0's GPU stream."""
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    kv = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM 0.33.0 is not installed")
    pub = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint="tcp://127.0.0.1:*",
                               replay_endpoint="tcp://127.0.0.1:*")
    try:
        yield kv, pub
    finally:
        pub.shutdown()


def _demo(control: str, preset: str, requests: int, seed: int = 0) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "kvoffload", "demo", "--connect", control,
                           "--preset", preset, "--requests", str(requests), "--json",
                           "--seed", str(seed)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _settle(idx: DynamoIndexer, replay: str, want_of: Callable[[set[Any]], set[Any]],
            timeout: float = 60.0) -> tuple[set[Any], set[Any], set[Any]]:
    """(Dynamo's index, what the stream says it should be, the stream's held blocks) once the
    two agree, else the last pair seen after `timeout` (the assertion shows the difference).

    Both sides move after a demo ends: Dynamo applies events asynchronously, and the stream
    itself still grows while disk writes finish (a STORAGE BlockStored is published when its
    write lands), so the stream is read again on every round, not once."""
    deadline = time.monotonic() + timeout
    while True:
        held = replay_state(replay)[0]
        want = want_of(held)
        got = idx.blocks()
        if got == want or time.monotonic() > deadline:
            return got, want, held
        time.sleep(0.2)


def _expected_match(prompt: list[int], held: set[int], block: int, tph: int) -> int:
    """Tokens of the longest prefix of whole engine blocks whose hashes the stream holds."""
    fine = block_hashes(prompt, tph)
    per = block // tph
    n = 0
    while (n + 1) * per <= len(fine) and hash_to_int(fine[(n + 1) * per - 1]) in held:
        n += 1
    return n * block


# A 1 MiB pool evicts (removals, and STORAGE events with the disk tier) during the run.
@pytest.mark.parametrize("preset,requests,disk", [(HYBRID, 80, True), (ATTENTION, 60, False)])
def test_dynamo_indexes_every_attention_chunk_under_each_engine(
        tmp_path: Path, indexer: DynamoIndexer, vllm_engine: tuple[Any, Any], preset: str,
        requests: int, disk: bool) -> None:
    p = PRESETS[preset]
    extra = ["--disk-dir", str(tmp_path / "disk"), "--disk-bytes", "64MiB"] if disk else []
    kv, engine = vllm_engine
    gpu = [0x5EED0001, 0x5EED0002]  # two GPU blocks of engine 0 (other tokens than the run's)
    engine.publish(kv.KVEventBatch(ts=time.time(), events=[kv.BlockStored(
        block_hashes=gpu, parent_block_hash=None, token_ids=[7] * (2 * p.block_tokens),
        block_size=p.block_tokens, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
        kv_cache_spec_kind="full_attention")]))
    extra += ["--engine-events", f"{engine._pub.getsockopt_string(zmq.LAST_ENDPOINT)},"
              f"{engine._replay.getsockopt_string(zmq.LAST_ENDPOINT)}"]
    with run_daemon(tmp_path, "--events-profile", "dynamo", "--events", "tcp://127.0.0.1:0",
                    "--events-replay", "tcp://127.0.0.1:0", *_views(), *extra,
                    pool_bytes=1 << 20) as d:
        views = d.ready["engine_views"]
        for worker, view in enumerate(views, 1):
            indexer.register(worker, view["events"], p.block_tokens, dp_rank=view["rank"],
                             replay=view["replay"])
        _demo(d.control, preset, requests)

        def want_of(held: set[Any]) -> set[Any]:
            want = {(w, v["rank"], tier, h) for w, v in enumerate(views, 1) for tier, h in held}
            return want | {(1, 0, "device", h) for h in gpu}  # engine 0's own: its worker only

        got, want, held = _settle(indexer, d.ready["events_replay"], want_of)
        _, events, _, kinds = replay_state(d.ready["events_replay"])
        assert events > 0 and set(kinds) == {"full_attention"}  # no Mamba, anything else
    assert got == want, (f"missing {len(want - got)}, extra {len(got - want)}; log:\n"
                         + indexer.log()[-2000:])
    tiers = {tier for tier, _ in held}
    assert "host_pinned" in tiers and (("disk" in tiers) == disk)
    cpu = {h for tier, h in held if tier == "host_pinned"}
    matched = 0
    for turn in chat_turns(requests, 0):
        answer = indexer.query(turn.prompt)
        expect = _expected_match(turn.prompt, cpu, p.block_tokens, p.tokens_per_hash)
        for wid in ("1", "2"):
            got_tokens = answer["instances"].get(wid, {}).get("cpu", 0)
            assert got_tokens == expect, (turn.conversation, turn.index, wid, answer)
        matched += expect > 0
    assert matched > 0  # the run left reusable prefixes, so the check above is not vacuous
    assert "Dropping" not in indexer.log()


def test_late_dynamo_listener_recovers_by_replay_after_20k_events(
        tmp_path: Path, indexer: DynamoIndexer) -> None:
    p = PRESETS[ATTENTION]
    with run_daemon(tmp_path, "--events-profile", "dynamo", "--events", "tcp://127.0.0.1:0",
                    "--events-replay", "tcp://127.0.0.1:0", pool_bytes=2 << 20) as d:
        _demo(d.control, ATTENTION, 300)
        _, events, batches, _ = replay_state(d.ready["events_replay"])
        assert events >= 20_000, events  # the run is what the issue measured, or bigger
        indexer.register(7, d.ready["events"], p.block_tokens, replay=d.ready["events_replay"])
        # Dynamo's listener asks replay when a live batch shows it missed seqs: a little
        # more traffic (other prompts) after it joined, as on any live node.
        _demo(d.control, ATTENTION, 3, seed=1)
        got, want, _ = _settle(indexer, d.ready["events_replay"],
                               lambda held: {(7, 0, tier, h) for tier, h in held})
    log = indexer.log()
    assert got == want, f"missing {len(want - got)}, extra {len(got - want)}:\n{log[-2000:]}"
    assert "Replay incomplete" not in log and "started_after_requested" not in log
    assert batches < events  # batched under load: fewer messages than events
