"""Consumer of the engines' own KV-event streams (`--engine-events EP[,REPLAY_EP]`).

One `EventSubscriber` per engine (or DP rank) feeds a per-engine index of the blocks the engine
announced: hash -> tokens, parent, block size, group, spec kind, LoRA name, extra keys. Two
users read it:

* `DaemonEvents` completes the payload of stores whose client did not know the token ids: vLLM
  publishes every full GPU block with its real tokens, and the hash of a GPU block is the last
  fine hash inside it, i.e. exactly our complete-chunk key's hash.
* the node hub re-publishes the engines' events and answers snapshots from this index.

Why these choices:
* Keys are `(int hash, group_idx, medium)`: engines publishing raw digests and engines publishing
  ints meet on vLLM's int form (`hash_to_int`); the group and medium keep one group's (or one
  tier's) removal from dropping another's entry for the same hash. A missing medium means GPU,
  as Dynamo reads it.
* Memory is bounded by a token budget shared by all engines: tokens sit in `array('I')`
  (4 bytes each) and, over budget, the engine holding the most tokens loses its oldest block.
  The eviction is published on the hub as a `BlockRemoved`, so the hub's live stream and its
  snapshot never disagree (a router then misses a GPU block; it never sees a phantom one).
* Engine `AllBlocksCleared` and publisher restarts (`Reset`) are translated for the hub into
  removals of that engine's blocks: in a merged stream a clear would wipe every tier.
* Nothing an engine sends may crash the daemon: bad frames are skipped by the subscriber, bad
  events here (counted), and a failing subscriber is rebuilt after a pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvoffload.events.hub import StoredRecord
from kvoffload.events.schema import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    hash_to_int,
)
from kvoffload.events.subscriber import EventSubscriber, Gap, Received, Reset
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("kvoffload.daemon")

DEFAULT_MAX_TOKENS = 8 << 20
_Key = tuple[int, int | None, str]


def parse_engine_spec(spec: str) -> tuple[str, str | None]:
    """`EP[,REPLAY_EP]` -> (endpoint, replay endpoint or None)."""
    ep, _, replay = spec.partition(",")
    if not ep.strip():
        raise ValueError(f"engine events endpoint missing in {spec!r}")
    return ep.strip(), (replay.strip() or None)


def norm_hash(h: BlockHash) -> int:
    """vLLM's int form of a hash as published either way; TypeError for anything else."""
    if isinstance(h, bytes):
        return hash_to_int(h)
    if isinstance(h, int) and not isinstance(h, bool):
        return h
    raise TypeError(f"not a block hash: {h!r}")


@dataclass(slots=True)
class _Engine:
    idx: int
    endpoint: str
    replay: str | None
    blocks: OrderedDict[_Key, StoredRecord] = field(default_factory=OrderedDict)
    tokens: int = 0
    groups: set[int | None] = field(default_factory=set)
    media: set[str] = field(default_factory=set)
    dp_rank: int | None = None
    task: asyncio.Task[None] | None = None


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def c(name: str, doc: str) -> Counter:
            return Counter(f"kvoffload_engine_events_{name}", doc, ["engine"], registry=registry)

        self.batches = c("batches", "Engine KV-event batches consumed.")
        self.events = c("events", "Engine KV events consumed.")
        self.gaps = c("gaps", "Engine-stream seq ranges lost for good (replay could not help).")
        self.resets = c("resets", "Engine publisher restarts seen (index of the engine cleared).")
        self.malformed = c("malformed_events", "Engine events skipped as malformed.")
        self.evicted = c("evicted_blocks", "Engine-index blocks dropped to stay in budget.")
        self.lag = Gauge("kvoffload_engine_events_lag_seconds",
                         "Now minus the timestamp of the last live engine batch.", ["engine"],
                         registry=registry)
        self.resident = Gauge("kvoffload_engine_events_resident_blocks",
                              "Blocks the engine index holds per engine.", ["engine"],
                              registry=registry)
        self.tokens = Gauge("kvoffload_engine_events_resident_tokens",
                            "Tokens the engine index holds (all engines; the budget).",
                            registry=registry)


class EngineStreams:
    """The engines' streams and their index. `apply`/`reset` are the synchronous core."""

    def __init__(self, specs: list[str], registry: CollectorRegistry, *,
                 max_tokens: int = DEFAULT_MAX_TOKENS,
                 on_batch: Callable[[int, EventBatch], None] | None = None,
                 on_block: Callable[[int], None] | None = None,
                 replay_timeout: float = 5.0) -> None:
        self.engines = [_Engine(i, *parse_engine_spec(s)) for i, s in enumerate(specs)]
        self.max_tokens = max_tokens
        self.on_batch = on_batch  # the hub: what to re-publish for this engine
        self.on_block = on_block  # payload completion: an int hash became known
        self.replay_timeout = replay_timeout
        self.registry = registry
        self.m = EngineMetrics(registry)
        self.total_tokens = 0
        self._closed = False
        for e in self.engines:  # series exist at 0 for rate()
            for metric in (self.m.batches, self.m.events, self.m.gaps, self.m.resets,
                           self.m.malformed, self.m.evicted, self.m.resident):
                metric.labels(str(e.idx))

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for e in self.engines:
            e.task = loop.create_task(self._run(e))

    async def aclose(self) -> None:
        self._closed = True
        tasks = [e.task for e in self.engines if e.task is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def _run(self, e: _Engine) -> None:
        while not self._closed:
            # Replay from 0 on start: the engine's history up to now is its buffer.
            sub = EventSubscriber(e.endpoint, e.replay, from_seq=0 if e.replay else None,
                                  registry=self.registry, stream=f"engine-{e.idx}",
                                  replay_timeout=self.replay_timeout)
            try:
                async with sub:
                    async for item in sub:
                        self.handle(e.idx, item)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._closed or (task is not None and task.cancelling()):
                    raise
                # Not our cancellation (a zmq poll cancelled under us): resubscribe.
                log.warning("engine %d event stream interrupted; resubscribing", e.idx)
                await asyncio.sleep(0.1)
            except Exception:  # a broken stream must not take the daemon down
                log.exception("engine %d event stream failed; resubscribing", e.idx)
                await asyncio.sleep(1.0)

    def handle(self, idx: int, item: Received[EventBatch] | Gap | Reset) -> None:
        e = self.engines[idx]
        if isinstance(item, Reset):
            self.m.resets.labels(str(idx)).inc()
            log.info("engine %d publisher restarted: dropping its %d indexed blocks",
                     idx, len(e.blocks))
            self.reset(idx)
        elif isinstance(item, Gap):
            # Lost for good: the index may hold blocks the engine freed meanwhile; they age
            # out under the budget. Counted so operators can size the engine's replay buffer.
            self.m.gaps.labels(str(idx)).inc()
        else:
            if not item.replayed:
                self.m.lag.labels(str(idx)).set(max(0.0, time.time() - item.batch.ts))
            self.apply(idx, item.batch)

    # -- index -------------------------------------------------------------------------

    def apply(self, idx: int, batch: EventBatch) -> None:
        """Index one engine batch; hand the hub what it should re-publish."""
        e = self.engines[idx]
        if batch.data_parallel_rank is not None:
            e.dp_rank = batch.data_parallel_rank
        out: list[KVEvent] = []
        stored: list[int] = []
        evicted: dict[int, list[tuple[_Key, StoredRecord]]] = {}
        for ev in batch.events:
            try:
                if isinstance(ev, BlockStored):
                    self._store(e, ev, batch.data_parallel_rank, stored, evicted)
                    out.append(ev)
                elif isinstance(ev, BlockRemoved):
                    self._remove(e, ev)
                    out.append(ev)
                elif isinstance(ev, AllBlocksCleared):
                    out.extend(self._removals(list(e.blocks.items())))
                    self._clear(e)
            except (TypeError, ValueError, OverflowError) as exc:
                self.m.malformed.labels(str(idx)).inc()
                log.debug("engine %d: skipping malformed event: %s", idx, exc)
        self.m.batches.labels(str(idx)).inc()
        self.m.events.labels(str(idx)).inc(len(batch.events))
        self._gauges(e)
        if self.on_batch is not None and out:
            self.on_batch(idx, EventBatch(ts=batch.ts, events=out,
                                          data_parallel_rank=batch.data_parallel_rank))
        for other, gone in evicted.items():
            self._gauges(self.engines[other])
            if self.on_batch is not None and gone:
                self.on_batch(other, EventBatch(ts=time.time(), events=self._removals(gone),
                                                data_parallel_rank=self.engines[other].dp_rank))
        if self.on_block is not None:
            for h in stored:
                self.on_block(h)

    def _store(self, e: _Engine, ev: BlockStored, rank: int | None, stored: list[int],
               evicted: dict[int, list[tuple[_Key, StoredRecord]]]) -> None:
        bs, hashes = ev.block_size, ev.block_hashes
        if bs <= 0 or not hashes or len(ev.token_ids) != bs * len(hashes):
            raise ValueError(f"BlockStored with {len(ev.token_ids)} tokens for "
                             f"{len(hashes)} hashes of block_size {bs}")
        if ev.extra_keys is not None and len(ev.extra_keys) != len(hashes):
            raise ValueError("extra_keys do not match block_hashes")
        keys = [norm_hash(h) for h in hashes]  # validate all before changing anything
        if ev.parent_block_hash is not None:
            norm_hash(ev.parent_block_hash)
        tokens = array("I", ev.token_ids)  # OverflowError for negative / huge ids
        medium = ev.medium or "GPU"
        parent = ev.parent_block_hash
        for i, (h, k) in enumerate(zip(hashes, keys, strict=True)):
            rec = StoredRecord(
                hashes=(h,), parent=parent, tokens=tokens[i * bs:(i + 1) * bs], block_size=bs,
                medium=ev.medium, group_idx=ev.group_idx, kind=ev.kv_cache_spec_kind,
                sliding_window=ev.kv_cache_spec_sliding_window, lora_name=ev.lora_name,
                extra_keys=None if ev.extra_keys is None else (ev.extra_keys[i],),
                locality=ev.locality, dp_rank=rank)
            key = (k, ev.group_idx, medium)
            old = e.blocks.pop(key, None)
            if old is not None:
                self._count(e, -len(old.tokens))
            e.blocks[key] = rec
            e.groups.add(ev.group_idx)
            e.media.add(medium)
            self._count(e, bs)
            stored.append(k)
            parent = h
        while self.total_tokens > self.max_tokens:
            victim = max(self.engines, key=lambda x: x.tokens)
            if not victim.blocks:
                break
            vkey, vrec = victim.blocks.popitem(last=False)
            self._count(victim, -len(vrec.tokens))
            self.m.evicted.labels(str(victim.idx)).inc()
            evicted.setdefault(victim.idx, []).append((vkey, vrec))

    def _remove(self, e: _Engine, ev: BlockRemoved) -> None:
        keys = [norm_hash(h) for h in ev.block_hashes]
        medium = ev.medium or "GPU"
        groups = [ev.group_idx] if ev.group_idx is not None else list(e.groups)
        for k in keys:
            for g in groups:
                old = e.blocks.pop((k, g, medium), None)
                if old is not None:
                    self._count(e, -len(old.tokens))

    def _clear(self, e: _Engine) -> None:
        self._count(e, -e.tokens)
        e.blocks.clear()

    def _count(self, e: _Engine, delta: int) -> None:
        e.tokens += delta
        self.total_tokens += delta

    def _gauges(self, e: _Engine) -> None:
        self.m.resident.labels(str(e.idx)).set(len(e.blocks))
        self.m.tokens.set(self.total_tokens)

    @staticmethod
    def _removals(items: list[tuple[_Key, StoredRecord]]) -> list[KVEvent]:
        """BlockRemoved events (one per group and medium) listing the records' hashes."""
        by: dict[tuple[int | None, str | None], list[BlockHash]] = {}
        for (_, group, _), rec in items:
            by.setdefault((group, rec.medium), []).append(rec.hashes[0])
        return [BlockRemoved(block_hashes=hs, medium=medium, group_idx=group)
                for (group, medium), hs in by.items()]

    def reset(self, idx: int) -> None:
        """Forget engine `idx` (publisher restart); the hub learns the removals."""
        e = self.engines[idx]
        gone = list(e.blocks.items())
        self._clear(e)
        self._gauges(e)
        if self.on_batch is not None and gone:
            self.on_batch(idx, EventBatch(ts=time.time(), events=self._removals(gone),
                                          data_parallel_rank=e.dp_rank))

    # -- reads -------------------------------------------------------------------------

    def find(self, h: int, group: int | None = None) -> StoredRecord | None:
        """A record of int hash `h`, preferring `group`; any group has the same tokens."""
        for e in self.engines:
            for g in (group, *e.groups):
                for m in e.media:
                    rec = e.blocks.get((h, g, m))
                    if rec is not None:
                        return rec
        return None

    def records(self) -> list[StoredRecord]:
        return [rec for e in self.engines for rec in e.blocks.values()]

    def resident(self, idx: int) -> int:
        return len(self.engines[idx].blocks)

    def stats(self) -> dict[str, Any]:
        return {"engines": len(self.engines), "tokens": self.total_tokens,
                "blocks": [len(e.blocks) for e in self.engines]}
