"""What the daemon tells the outside world: KV events for routers, lookup events for operators.

KV events (``--events``) are vLLM 0.33's format, published when a store commits (BlockStored)
and when a block leaves the pool (BlockRemoved), with medium "CPU" and the real payload: no
placeholders. A complete chunk lists its block hash with ``block_size`` = tokens per block and
the block's tokens; a partial tail lists the fine hashes from its block start to the boundary
with ``block_size`` = tokens per hash; a recurrent-state snapshot carries the same hashes and
tokens as the attention tail at the same boundary, told apart by ``group_idx`` and
``kv_cache_spec_kind``. A removal lists exactly the hashes its store listed.

A store whose request carried no token ids is still stored, but its event waits (bounded, and
counted) until a payload is known: a router must never see a silent placeholder.

Lookup events (``--lookup-events``) use our own versioned schema on their own endpoint: routers
reject batches holding unknown event types, so the two streams never mix.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from kvoffload.daemon import protocol as p
from kvoffload.daemon.index import Namespace
from kvoffload.daemon.types import key_group, key_hash
from kvoffload.events.publisher import EventPublisher, LookupEventPublisher
from kvoffload.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    LookupEvent,
    hash_to_int,
)
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("kvoffload.daemon")

MAX_AWAITING_PAYLOAD = 65_536
RECENTLY_EVICTED = 65_536


class DaemonEvents:
    def __init__(self, *, events: str | None, events_replay: str | None,
                 lookup_events: str | None, int_hashes: bool, registry: CollectorRegistry,
                 hwm: int = 100_000, buffer_batches: int = 10_000) -> None:
        self.int_hashes = int_hashes
        self.kv = (EventPublisher(events, events_replay, hwm=hwm, buffer_batches=buffer_batches,
                                  registry=registry) if events else None)
        self.lookups = (LookupEventPublisher(lookup_events, hwm=hwm, registry=registry)
                        if lookup_events else None)
        # slot -> the store request's payload, from prepare until commit or abort.
        self._payloads: dict[int, p.StoreItem] = {}
        # slot -> hashes a committed tail listed (a chunk lists only its key's hash).
        self._tail_hashes: dict[int, list[bytes]] = {}
        self._awaiting: OrderedDict[int, tuple[Namespace, bytes]] = OrderedDict()
        self._evicted: OrderedDict[bytes, None] = OrderedDict()
        self.incomplete = Counter("kvoffload_events_incomplete_total",
                                  "Stores whose event could not carry a full payload, by "
                                  "reason (no_tokens, bad_length, overflow).", ["reason"],
                                  registry=registry)
        self.awaiting_gauge = Gauge("kvoffload_events_awaiting_payload",
                                    "Committed blocks whose event waits for token ids.",
                                    registry=registry)

    @property
    def enabled(self) -> bool:
        return self.kv is not None

    async def start(self) -> None:
        for pub in (self.kv, self.lookups):
            if pub is not None:
                await pub.start()

    async def aclose(self) -> None:
        for pub in (self.kv, self.lookups):
            if pub is not None:
                await pub.aclose(flush=True)

    def _hash(self, h: bytes) -> Any:
        return hash_to_int(h) if self.int_hashes else h

    # -- index listeners --------------------------------------------------------------

    def remember(self, slot: int, item: p.StoreItem) -> None:
        """Keep a store's payload from prepare to commit (only when KV events are on)."""
        if self.kv is not None:
            self._payloads[slot] = item

    def forget(self, slot: int) -> None:
        """A prepared store was aborted: nothing was published, nothing to remove."""
        self._payloads.pop(slot, None)

    def stored(self, ns: Namespace, key: bytes, slot: int) -> None:
        item = self._payloads.pop(slot, None)
        if self.kv is None:
            return
        event = self._block_stored(ns, key, slot, item)
        if event is None:
            self._awaiting[slot] = (ns, key)
            if len(self._awaiting) > MAX_AWAITING_PAYLOAD:
                self._awaiting.popitem(last=False)
                self.incomplete.labels("overflow").inc()
            self.awaiting_gauge.set(len(self._awaiting))
            return
        self.kv.publish(event)

    def _block_stored(self, ns: Namespace, key: bytes, slot: int, item: p.StoreItem | None
                      ) -> BlockStored | None:
        g = ns.geometry
        group = key_group(key)
        spec = g.groups[group]
        if item is None or item.token_ids is None:
            self.incomplete.labels("no_tokens").inc()
            return None
        if item.tail:
            hashes = list(item.block_hashes or [])
            block_size = g.tokens_per_hash
        else:
            hashes = [key_hash(key)]
            block_size = spec.tokens_per_block * g.blocks_per_chunk
        if not hashes or len(item.token_ids) != block_size * len(hashes):
            self.incomplete.labels("bad_length").inc()
            return None
        if item.tail:
            self._tail_hashes[slot] = hashes
        return BlockStored(
            block_hashes=[self._hash(h) for h in hashes],
            parent_block_hash=None if item.parent_hash is None else self._hash(item.parent_hash),
            token_ids=list(item.token_ids), block_size=block_size, lora_id=None, medium="CPU",
            lora_name=item.lora_name, group_idx=group, kv_cache_spec_kind=spec.kind.value,
            kv_cache_spec_sliding_window=spec.sliding_window_tokens, locality="LOCAL")

    def dropped(self, ns: Namespace, key: bytes, slot: int) -> None:
        """A READY block left the pool (eviction, reset): remove what its store listed."""
        self._evicted[key] = None
        if len(self._evicted) > RECENTLY_EVICTED:
            self._evicted.popitem(last=False)
        hashes = self._tail_hashes.pop(slot, None)
        if self._awaiting.pop(slot, None) is not None:
            self.awaiting_gauge.set(len(self._awaiting))
            return  # never published, so nothing to remove
        if self.kv is None:
            return
        hashes = hashes or [key_hash(key)]
        self.kv.publish(BlockRemoved(block_hashes=[self._hash(h) for h in hashes], medium="CPU",
                                     group_idx=key_group(key), locality="LOCAL"))

    def cleared(self) -> None:
        if self.kv is not None:
            self.kv.publish(AllBlocksCleared())

    def was_evicted(self, key: bytes) -> bool:
        return key in self._evicted

    # -- lookup events ----------------------------------------------------------------

    def lookup(self, ns: Namespace, q: p.LookupQuery, a: p.LookupAnswer) -> None:
        if self.lookups is None:
            return
        hit = a.hit_tokens or 0
        if a.hit_tokens is None:
            outcome = "deferred"
        elif hit == 0:
            outcome = "miss"
        else:
            best = (q.num_prompt_tokens - 1) // ns.geometry.tokens_per_hash * \
                ns.geometry.tokens_per_hash
            outcome = "hit" if q.local_tokens + hit >= best else "partial"
        chunk = min(a.chunk_tokens, hit)
        self.lookups.publish(LookupEvent(
            request_id=q.req_id, namespace=ns.geometry.namespace,
            prompt_tokens=q.num_prompt_tokens, local_tokens=q.local_tokens, hit_tokens=hit,
            chunk_hit_tokens=chunk, tail_hit_tokens=hit - chunk, tail_boundary=a.tail_boundary,
            outcome=outcome,  # type: ignore[arg-type]
            miss_reason=a.miss_reason if outcome != "hit" else None))
