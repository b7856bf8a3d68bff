"""Node event hub: one merged KV-event stream per node, with replay and a full-state snapshot.

The hub is an `EventPublisher` (own seq, own replay buffer) that the daemon feeds with the
engines' GPU events (re-published as they came, medium kept) and its own CPU events. Routers
subscribe once per node instead of once per engine plus once for the daemon.

Snapshot protocol (on the hub's replay ROUTER socket; everything else is vLLM's replay):

* request: `[b"", SNAPSHOT_SEQ]` where `SNAPSHOT_SEQ` = 0xFFFFFFFFFFFFFFFE, 8 bytes BE. No
  real publisher reaches that seq, and a plain vLLM publisher answers it with just the end
  marker (an empty replay), so asking an old publisher is harmless.
* reply: one or more `[b"", topic, S, payload]` where every payload is an ordinary batch of
  `BlockStored` events (the real payload; an empty state gives one batch with no events) and
  every seq frame is the same value `S`; then the end marker `[b"", b"", FF*8, b""]`.
* `S` is the seq of the first live batch NOT reflected in the snapshot. The hub flushes its
  queue before taking the snapshot, in the same event-loop turn, so the snapshot is exactly
  the state after batches `0..S-1`. The client applies the snapshot, drops live batches with
  seq < S, and fetches `[S, first live seq)` with an ordinary replay request `[b"", S]`.
  `EventSubscriber(hub, hub_replay, from_seq=S)` does exactly that.

Why records, not events: the state is kept as immutable `StoredRecord`s (tokens in an
`array('I')`, 4 bytes per token instead of ~36 as Python ints). A snapshot captures the list of
record references synchronously (consistent: records are replaced, never mutated) and only then
encodes them chunk by chunk, yielding to the loop in between.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

from .publisher import END_SEQ, SEQ, EventPublisher
from .schema import BlockHash, BlockStored, EventBatch

__all__ = ["SNAPSHOT_SEQ", "HubPublisher", "StoredRecord", "request_snapshot"]

SNAPSHOT_SEQ: Final = 0xFFFF_FFFF_FFFF_FFFE
_SNAPSHOT_BATCH: Final = 256  # events per snapshot batch


@dataclass(slots=True, frozen=True)
class StoredRecord:
    """One resident block (or tail) as a `BlockStored` would describe it. Never mutated."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    tokens: array[int]  # array('I'); may be shared by records of other groups
    block_size: int
    medium: str | None
    group_idx: int | None = None
    kind: str | None = None
    sliding_window: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    locality: str | None = None
    dp_rank: int | None = None  # rank of the batch the record came from (engine records)

    @classmethod
    def from_event(cls, ev: BlockStored, tokens: array[int] | None = None,
                   dp_rank: int | None = None) -> StoredRecord:
        return cls(hashes=tuple(ev.block_hashes), parent=ev.parent_block_hash,
                   tokens=array("I", ev.token_ids) if tokens is None else tokens,
                   block_size=ev.block_size, medium=ev.medium, group_idx=ev.group_idx,
                   kind=ev.kv_cache_spec_kind, sliding_window=ev.kv_cache_spec_sliding_window,
                   lora_name=ev.lora_name,
                   extra_keys=None if ev.extra_keys is None else tuple(ev.extra_keys),
                   locality=ev.locality, dp_rank=dp_rank)

    def to_event(self) -> BlockStored:
        return BlockStored(
            block_hashes=list(self.hashes), parent_block_hash=self.parent,
            token_ids=self.tokens.tolist(), block_size=self.block_size, lora_id=None,
            medium=self.medium, lora_name=self.lora_name,
            extra_keys=None if self.extra_keys is None else list(self.extra_keys),
            group_idx=self.group_idx, kv_cache_spec_kind=self.kind,
            kv_cache_spec_sliding_window=self.sliding_window, locality=self.locality)


SnapshotSource = Callable[[], Iterable[StoredRecord]]


class HubPublisher(EventPublisher):
    """`EventPublisher` whose replay socket also answers snapshot requests."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *args: Any,
                 snapshot: SnapshotSource, stream: str = "hub", **kwargs: Any) -> None:
        super().__init__(endpoint, replay_endpoint, *args, stream=stream, **kwargs)
        self._snapshot_source = snapshot
        self.snapshots_served = 0

    async def _replay(self, client: bytes, start: int) -> None:
        if start != SNAPSHOT_SEQ:
            await super()._replay(client, start)
            return
        # Same loop turn from flush to capture: the state is exactly "after seq S-1".
        if not self._closed:
            self._seal()  # coalesced events are part of "before S"
            if self._queue:
                self._drain_chunk(len(self._queue))
        resume = self._seq
        records = list(self._snapshot_source())
        router = self._router
        assert router is not None
        seq_bytes = SEQ.pack(resume)
        # Group by rank so a consumer mapping ranks to workers attributes GPU blocks right.
        by_rank: dict[int | None, list[StoredRecord]] = {}
        for rec in records:
            by_rank.setdefault(rec.dp_rank, []).append(rec)
        if not by_rank:
            by_rank[None] = []  # one empty batch: the client always learns S
        now = time.time()
        for rank, recs in by_rank.items():
            for i in range(0, max(len(recs), 1), _SNAPSHOT_BATCH):
                batch = EventBatch(ts=now, events=[r.to_event() for r in
                                                   recs[i:i + _SNAPSHOT_BATCH]],
                                   data_parallel_rank=rank)
                router.send_multipart((client, b"", self._topic, seq_bytes,
                                       self._encoder.encode(batch)), 0)
                await asyncio.sleep(0)
        router.send_multipart((client, b"", b"", END_SEQ, b""), 0)
        self.snapshots_served += 1


def request_snapshot(endpoint: str, timeout: float = 10.0,
                     context: Any = None) -> tuple[int, list[bytes]]:
    """Blocking client helper: `(resume_seq, payloads)` of one snapshot from `endpoint`.

    Raises TimeoutError when the end marker does not arrive in time. `resume_seq` is -1 when
    no batch came back (a publisher without snapshot support: replay from 0 instead).
    """
    import zmq

    ctx = context if context is not None else zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    resume = -1
    payloads: list[bytes] = []
    try:
        sock.send_multipart([b"", SEQ.pack(SNAPSHOT_SEQ)])
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000)):
                raise TimeoutError(f"no snapshot end marker from {endpoint} in {timeout}s")
            frames = sock.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                continue
            if frames[2] == END_SEQ:
                return resume, payloads
            resume = SEQ.unpack(frames[2])[0]
            payloads.append(frames[3])
    finally:
        sock.close()
