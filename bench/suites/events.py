"""KV-event publishing throughput: our EventPublisher vs vLLM's ZmqEventPublisher.

Both publish the same prebuilt batches (BlockStored with 16 token ids per block) end to end over
tcp loopback to one subscriber process that counts events. Both publishers connect to the
subscriber's bound SUB socket, so one sink serves every round. Batch sizes: 1 and 8 events,
and 32 and 256: vLLM publishes one batch per engine step, and a busy engine's step stores tens
to hundreds of blocks (a 2,048-token prefill step of 16-token blocks: 128).

CPU per event: this process's CPU time (``time.process_time``: every thread, so the ZMQ I/O
thread and vLLM's publisher thread count too) from the first timed publish until the sink
reported, over the events it received. The sink's own CPU is not in it.

Timing: t0 is taken in this process right before the first timed `publish`, the end is the sink's
receipt of the last timed event (`time.monotonic` is system-wide on Linux, so both processes
share the clock). Warm-up batches (ts < 0) establish the connection and subscription first and
are not counted. PUB high-water marks are set equal and large for both, so neither side wins by
dropping; lost events are reported anyway.

Run: `python -m kvoffload.bench.suites.events [--full]`.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq
from kvoffload.events.publisher import EventPublisher
from kvoffload.events.schema import BlockStored, EventBatch
from prometheus_client import CollectorRegistry

__all__ = ["run_events_bench"]

TARGET = 4.0  # issue 15's done-means: >= 4x vLLM's publisher at 1 event per batch
STEP_BATCHES = (32, 256)  # events per batch of a busy engine's step
TOKENS_PER_BLOCK = 16
HWM = 1_000_000
_IDLE_MS = 2000


class _CountBatch(msgspec.Struct, array_like=True):
    # The sink only needs ts (warm-up marker) and the number of events: Raw skips decoding them.
    ts: float
    events: list[msgspec.Raw]


def _sink(conn: Connection) -> None:
    """Subscriber process: per round, wait for warm-up, then count timed events."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:*")
    conn.send(sub.getsockopt_string(zmq.LAST_ENDPOINT))
    decode = msgspec.msgpack.Decoder(_CountBatch).decode
    recv = sub.recv
    while True:
        expected = conn.recv()
        if expected is None:
            break
        sub.setsockopt(zmq.RCVTIMEO, 20_000)
        recv(), recv(), recv()  # first warm-up message: the path is up
        conn.send("warm")
        sub.setsockopt(zmq.RCVTIMEO, _IDLE_MS)
        count = 0
        t_last = 0.0
        while count < expected:
            try:
                recv()
                recv()
                payload = recv()
            except zmq.Again:
                break  # lost events: report what arrived
            batch = decode(payload)
            if batch.ts >= 0:
                count += len(batch.events)
                t_last = time.monotonic()
        conn.send((count, t_last))
    sub.close(0)
    ctx.term()


def _block(i: int, j: int) -> dict[str, Any]:
    base = (i * 8 + j) * TOKENS_PER_BLOCK
    return {
        "block_hashes": [(i * 8 + j) * 2654435761 % (1 << 64)],
        "parent_block_hash": None if j == 0 else (i * 8 + j - 1) * 2654435761 % (1 << 64),
        "token_ids": list(range(base, base + TOKENS_PER_BLOCK)),
        "block_size": TOKENS_PER_BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def _ours_batches(n: int, per: int) -> list[EventBatch]:
    return [
        EventBatch(ts=1.0, events=[BlockStored(**_block(i, j)) for j in range(per)])
        for i in range(n)
    ]


def _round_ours(conn: Connection, ep: str, batches: list[EventBatch], per: int) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        pub = EventPublisher(  # the sink binds: our PUB connects to it
            f"connect:{ep}", hwm=HWM, queue_size=len(batches) + 1024, registry=CollectorRegistry()
        )
        await pub.start()
        conn.send(len(batches) * per)
        while not conn.poll(0):
            pub.publish(EventBatch(ts=-1.0, events=[]))
            await asyncio.sleep(0.002)
        conn.recv()
        t0, cpu0 = time.monotonic(), time.process_time()
        for i, batch in enumerate(batches):
            pub.publish(batch)
            if i & 255 == 255:
                await asyncio.sleep(0)  # let the sender drain, as any real producer yields
        while not conn.poll(0):
            await asyncio.sleep(0.0005)
        count, t_last = conn.recv()
        cpu = time.process_time() - cpu0
        await pub.aclose(flush=False)
        return {"events": count, "seconds": t_last - t0, "cpu_s": cpu}

    try:
        import uvloop

        return uvloop.run(run())
    except ImportError:
        return asyncio.run(run())


def _round_vllm(conn: Connection, ep: str, batches: list[Any], per: int) -> dict[str, Any]:
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    pub = ZmqEventPublisher(0, endpoint=ep, hwm=HWM, max_queue_size=100_000)
    try:
        conn.send(len(batches) * per)
        while not conn.poll(0.002):
            pub.publish(KVEventBatch(ts=-1.0, events=[]))
        conn.recv()
        t0, cpu0 = time.monotonic(), time.process_time()
        for batch in batches:
            pub.publish(batch)
        count, t_last = conn.recv()
        cpu = time.process_time() - cpu0
    finally:
        pub.shutdown()
    return {"events": count, "seconds": t_last - t0, "cpu_s": cpu}


def _vllm_batches(n: int, per: int) -> list[Any]:
    from vllm.distributed.kv_events import BlockStored as VBlockStored
    from vllm.distributed.kv_events import KVEventBatch

    return [
        KVEventBatch(ts=1.0, events=[VBlockStored(**_block(i, j)) for j in range(per)])
        for i in range(n)
    ]


def _load_vllm() -> tuple[bool, str]:
    """(available, description) of the vLLM baseline."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm
        from vllm.distributed.kv_events import ZmqEventPublisher  # noqa: F401
    except Exception as exc:  # any import failure means: no baseline here
        return False, f"unavailable: {type(exc).__name__}: {exc}"
    return True, f"vllm {getattr(vllm, '__version__', '?')} ZmqEventPublisher"


def run_events_bench(
    quick: bool, n_batches: int | None = None, rounds: int | None = None
) -> dict[str, Any]:
    """Events/s and CPU per event of ours vs vLLM's publisher, 1, 8, 32 and 256 events per
    batch; medians of `rounds`."""
    n1 = n_batches or (40_000 if quick else 200_000)
    n8 = max(1, n1 // 4)
    sizes = ((1, n1), (8, n8), *((per, max(1, 2 * n1 // per)) for per in STEP_BATCHES))
    rounds = rounds or (1 if quick else 3)
    have_vllm, baseline = _load_vllm()
    ctx = mp.get_context("spawn")  # no fork: this process may hold ZMQ/asyncio state
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sink, args=(child,), daemon=True)
    proc.start()
    result: dict[str, Any] = {"target": TARGET, "rounds": rounds,
                              "n_batches": {per: n for per, n in sizes}}
    try:
        if not parent.poll(60):
            raise RuntimeError("event sink did not start")
        ep = parent.recv()
        for per, n in sizes:
            ours_b = _ours_batches(n, per)
            vllm_b = _vllm_batches(n, per) if have_vllm else []
            ours: list[float] = []
            theirs: list[float] = []
            cpu: dict[str, list[float]] = {"ours": [], "vllm": []}  # µs per event
            lost = {"ours": 0, "vllm": 0}
            # Everything built so far (vLLM's import, the batches) would otherwise be scanned
            # by full GC passes inside whichever timed round comes first.
            gc.collect()
            gc.freeze()
            for r_idx in range(rounds):  # alternate the order, so drift hits both alike
                order = ("ours", "vllm") if r_idx % 2 == 0 else ("vllm", "ours")
                for who in order:
                    if who == "ours":
                        r = _round_ours(parent, ep, ours_b, per)
                        ours.append(r["events"] / r["seconds"])
                        lost["ours"] += n * per - r["events"]
                    elif have_vllm:
                        r = _round_vllm(parent, ep, vllm_b, per)
                        theirs.append(r["events"] / r["seconds"])
                        lost["vllm"] += n * per - r["events"]
                    else:
                        continue
                    cpu[who].append(1e6 * r["cpu_s"] / max(1, r["events"]))
            gc.unfreeze()
            suffix = "" if per == 1 else f"_{per}"
            mine = statistics.median(ours)
            base = statistics.median(theirs) if theirs else None
            result[f"ours_events_per_s{suffix}"] = round(mine)
            result[f"vllm_events_per_s{suffix}"] = round(base) if base else None
            result[f"ratio{suffix}"] = round(mine / base, 2) if base else None
            result[f"lost_events{suffix}"] = lost
            result[f"cpu_us_per_event{suffix}"] = {
                k: round(statistics.median(v), 3) if v else None for k, v in cpu.items()}
        parent.send(None)
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    result["meets"] = result["ratio"] is not None and result["ratio"] >= TARGET
    result["baseline"] = baseline
    return result


if __name__ == "__main__":
    res = run_events_bench(quick="--full" not in sys.argv)
    print(msgspec.json.format(msgspec.json.encode(res)).decode())
    print(
        f"ratio (1 event/batch, ours/vLLM): {res['ratio']}  target {TARGET}  meets={res['meets']}"
    )
