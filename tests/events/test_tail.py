"""`kvoffload events tail`: argparse wiring, JSON/human output, the real CLI as a subprocess."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
from collections.abc import Callable

import pytest
from kvoffload.events.publisher import EventPublisher
from kvoffload.events.schema import AllBlocksCleared, BlockRemoved, EventBatch
from kvoffload.events.tail import run_tail, tail
from prometheus_client import CollectorRegistry

from kvoffload.cli.events import add_parser as add_events_parser
from tests.events_helpers import mixed_batch, stored, wait_until


def expected_json() -> list[dict[str, object]]:
    """What --json prints for [batch 0: mixed_batch(0)] + [batch 1: one BlockStored]."""
    nulls = dict(
        lora_id=None,
        lora_name=None,
        extra_keys=None,
        kv_cache_spec_sliding_window=None,
        locality=None,
        ownership=None,
        session_id=None,
        lookahead_token_ids=None,
    )
    return [
        dict(
            seq=0,
            ts=0.0,
            dp_rank=2,
            type="BlockStored",
            block_hashes=[(0).to_bytes(32, "big").hex()],
            parent_block_hash=None,
            token_ids=[0, 1, 2, 3],
            block_size=4,
            medium="GPU",
            group_idx=1,
            kv_cache_spec_kind="full_attention",
            **nulls,
        ),
        dict(
            seq=0,
            ts=0.0,
            dp_rank=2,
            type="BlockRemoved",
            block_hashes=[7, 8],
            medium="CPU",
            group_idx=None,
            locality=None,
            ownership=None,
        ),
        dict(seq=0, ts=0.0, dp_rank=2, type="AllBlocksCleared"),
        dict(
            seq=1,
            ts=9.5,
            dp_rank=None,
            type="BlockStored",
            block_hashes=[1005],
            parent_block_hash=None,
            token_ids=[20, 21, 22, 23],
            block_size=4,
            medium="GPU",
            group_idx=None,
            kv_cache_spec_kind=None,
            **nulls,
        ),
    ]


async def started_publisher(ipc: Callable[[str], str]) -> EventPublisher:
    pub = EventPublisher(ipc("p"), ipc("r"), registry=CollectorRegistry())
    await pub.start()
    pub.publish(mixed_batch(0))
    pub.publish(EventBatch(ts=9.5, events=[stored(5)]))
    await wait_until(lambda: pub.next_seq == 2)
    return pub


def test_parser_wiring() -> None:
    parser = argparse.ArgumentParser(prog="kvoffload")
    add_events_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["events", "tail", "--endpoint", "tcp://h:5557", "--replay", "tcp://h:5558"]
        + ["--from-seq", "7", "--topic", "t", "--json", "--count", "3"]
    )
    assert args.handler is run_tail
    assert (args.endpoint, args.replay, args.from_seq, args.topic) == (
        "tcp://h:5557",
        "tcp://h:5558",
        7,
        "t",
    )
    assert args.json is True and args.count == 3
    defaults = parser.parse_args(["events", "tail", "--endpoint", "x"])
    assert (defaults.replay, defaults.from_seq, defaults.topic, defaults.json) == (
        None,
        None,
        "",
        False,
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["events", "tail"])  # --endpoint is required


async def test_json_lines(ipc: Callable[[str], str]) -> None:
    pub = await started_publisher(ipc)
    out, err = io.StringIO(), io.StringIO()
    try:
        code = await asyncio.wait_for(
            tail(
                pub.bound_endpoint,
                replay=pub.bound_replay_endpoint,
                from_seq=0,
                as_json=True,
                count=4,
                out=out,
                err=err,
            ),
            10,
        )
    finally:
        await pub.aclose()
    assert code == 0
    lines = out.getvalue().splitlines()
    records = [json.loads(line) for line in lines]
    assert records == expected_json()
    assert list(records[0])[:5] == ["seq", "ts", "dp_rank", "type", "block_hashes"]
    assert err.getvalue() == ""


async def test_human_lines_and_count_cuts_inside_a_batch(ipc: Callable[[str], str]) -> None:
    pub = await started_publisher(ipc)
    out = io.StringIO()
    try:
        code = await asyncio.wait_for(
            tail(
                pub.bound_endpoint, replay=pub.bound_replay_endpoint, from_seq=0, count=2, out=out
            ),
            10,
        )
    finally:
        await pub.aclose()
    assert code == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("seq=0 ts=0.000000 dp=2 BlockStored hashes=[0000000000000000]")
    assert "tokens=4 block_size=4" in lines[0] and "group_idx=1" in lines[0]
    assert "kv_cache_spec_kind=full_attention" in lines[0] and "lora_id" not in lines[0]
    assert lines[1] == "seq=0 ts=0.000000 dp=2 BlockRemoved hashes=[7,8] medium=CPU"


async def test_gap_notice_goes_to_stderr(ipc: Callable[[str], str]) -> None:
    pub = EventPublisher(ipc("p"), registry=CollectorRegistry())
    await pub.start()
    for i in range(10):  # the stream is past --from-seq 5 before tail starts
        pub.publish([BlockRemoved(block_hashes=[i], medium="GPU")])
    await wait_until(lambda: pub.next_seq == 10)
    out, err = io.StringIO(), io.StringIO()
    task = asyncio.create_task(
        tail(pub.bound_endpoint, from_seq=5, as_json=True, count=1, out=out, err=err)
    )
    try:
        while not task.done():  # slow joiner: keep publishing until tail has its event
            pub.publish([BlockRemoved(block_hashes=[pub.next_seq], medium="GPU")])
            await asyncio.wait([task], timeout=0.02)
        assert task.result() == 0
    finally:
        await pub.aclose()
    record = json.loads(out.getvalue())
    assert record["seq"] >= 10
    # No replay endpoint: the skipped seqs are reported on stderr, never invented.
    assert err.getvalue() == f"# gap: seqs 5..{record['seq'] - 1} lost\n"
    assert record["type"] == "BlockRemoved" and record["block_hashes"] == [record["seq"]]


async def test_cli_subprocess(ipc: Callable[[str], str]) -> None:
    pub = await started_publisher(ipc)
    pub.publish(EventBatch(ts=11.0, events=[AllBlocksCleared()]))
    await wait_until(lambda: pub.next_seq == 3)
    replay = pub.bound_replay_endpoint
    assert replay is not None
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        for prefix in ([], ["events", "tail"]):  # both standalone forms
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kvoffload.cli.events",
                *prefix,
                "--endpoint",
                pub.bound_endpoint,
                "--replay",
                replay,
                "--from-seq",
                "1",
                "--json",
                "--count",
                "2",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
            )
            stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == 0, stderr.decode()
            records = [json.loads(line) for line in stdout.decode().splitlines()]
            assert records == [
                expected_json()[3],
                dict(seq=2, ts=11.0, dp_rank=None, type="AllBlocksCleared"),
            ]
    finally:
        await pub.aclose()


@pytest.mark.parametrize("args", [
    ["--endpoint", "localhost:5557"], ["--endpoint", "/run/kvoffload/events.sock"],
    ["--endpoint", "tcp://127.0.0.1"], ["--endpoint", "tcp://127.0.0.1:5557", "--replay", "5558"]])
def test_a_bad_endpoint_is_one_line(args: list[str]) -> None:
    import subprocess

    out = subprocess.run([sys.executable, "-m", "kvoffload", "events", "tail", *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a ZMQ endpoint" in lines[0], out.stderr
    assert args[-1] in lines[0] and "tcp://HOST:PORT" in lines[0]


def test_an_endpoint_zmq_refuses_at_connect_is_one_line() -> None:
    import subprocess

    # Well formed, but not a host libzmq can connect to (a bad tcp host name is refused by
    # connect itself).
    out = subprocess.run([sys.executable, "-m", "kvoffload", "events", "tail", "--endpoint",
                          "tcp://no such host:5557"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot connect to --endpoint tcp://no such host:5557" in lines[0]


async def test_nothing_publishing_says_once_what_it_waits_for(
        ipc: Callable[[str], str]) -> None:
    """No PUB at the endpoint: ZMQ is silent, so the tail says once, on stderr, what it waits
    for, and keeps waiting; once the stream starts, its events print as usual."""
    endpoint = ipc("nobody")
    out, err = io.StringIO(), io.StringIO()
    task = asyncio.create_task(tail(endpoint, as_json=True, count=1, out=out, err=err,
                                    waiting_notice_s=0.0))
    await wait_until(lambda: err.getvalue() != "")
    await asyncio.sleep(0.2)  # a second notice would come in this time, if there were one
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"# waiting for events on {endpoint}:")
    assert "--events" in lines[0] and out.getvalue() == "" and not task.done()
    registry = CollectorRegistry()
    pub = EventPublisher(endpoint, registry=registry)
    await pub.start()
    try:
        while not task.done():  # a SUB joining late misses what was sent before it
            pub.publish(EventBatch(ts=1.0, events=[AllBlocksCleared()]))
            await asyncio.sleep(0.05)
        assert await task == 0
    finally:
        await pub.aclose()
    assert json.loads(out.getvalue())["type"] == "AllBlocksCleared"
    assert len(err.getvalue().splitlines()) == 1


async def test_a_stream_that_sends_gets_no_waiting_notice(ipc: Callable[[str], str]) -> None:
    pub = await started_publisher(ipc)
    out, err = io.StringIO(), io.StringIO()
    try:
        replay = pub.bound_replay_endpoint
        assert await tail(pub.bound_endpoint, replay=replay, from_seq=0, count=1, out=out,
                          err=err, waiting_notice_s=30.0) == 0
    finally:
        await pub.aclose()
    assert out.getvalue() and "waiting" not in err.getvalue()
