"""What the daemon tells the outside world: KV events for routers, lookup events for operators.

KV events (``--events``) are vLLM 0.33's format, published when a store commits (BlockStored)
and when a block leaves the pool (BlockRemoved), with medium "CPU" and the real payload: no
placeholders. A complete chunk lists its block hash with ``block_size`` = tokens per block and
the block's tokens; a partial tail lists the fine hashes from its block start to the boundary
with ``block_size`` = tokens per hash; a recurrent-state snapshot carries the same hashes and
tokens as the attention tail at the same boundary, told apart by ``group_idx`` and
``kv_cache_spec_kind``. A removal lists exactly the hashes its store listed.

A store whose request carried no token ids is still stored, but its event waits (bounded, and
counted) until a payload is known: a router must never see a silent placeholder. For complete
chunks the payload comes from the engines' own streams (``daemon/streams/completion.py``): a GPU
block's hash is the last fine hash inside it, i.e. our chunk key's hash, and any group of the
namespace will do (tokens are the same for every group). Partial tails cannot be completed that
way (vLLM only publishes full blocks): they stay awaiting, counted, until evicted.

With the node hub (``--hub``) every published CPU event also goes to the hub, and the payload of
every resident block is kept (one ``StoredRecord`` per slot, token arrays shared by the groups
that list the same hashes) so the hub can answer snapshots.

Router profiles (``--events-profile``, events/profiles.py) decide what each consumer gets: the
filter runs in ``_emit`` and at chunk building (engine-block chunks for Dynamo); a suppressed
store is remembered so its removal is suppressed too. Per-engine views (``--engine-view``, or
``add_engine_view`` called on Register) publish the same events with one engine's
``data_parallel_rank``, optionally merged with that engine's own GPU stream.

Lookup events (``--lookup-events``) use our own versioned schema on their own endpoint: routers
reject batches holding unknown event types, so the two streams never mix.
"""

from __future__ import annotations

import dataclasses
import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
from kvoffload.daemon.base import key_group, key_hash
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.store.index import Namespace
from kvoffload.daemon.streams.completion import EngineCompletion
from kvoffload.daemon.streams.consume import DEFAULT_MAX_TOKENS, EngineStreams
from kvoffload.daemon.streams.views import (  # event_options: server.py's entry point
    EngineView,
    EngineViews,
    LookupEvents,
    event_options,
)
from kvoffload.events.hub import HubPublisher, StoredRecord
from kvoffload.events.lookup_publisher import LookupEventPublisher
from kvoffload.events.profiles import Profile, make_profile, parse_view_spec
from kvoffload.events.publisher import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_BUFFER_EVENTS,
    EventPublisher,
)
from kvoffload.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    encode_batch,
    encode_batch_positional,
    hash_to_int,
)
from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["DaemonEvents", "EngineView", "event_options"]

log = logging.getLogger("kvoffload.daemon")

MAX_AWAITING_PAYLOAD = 65_536
RECENTLY_EVICTED = 65_536  # keys remembered for the ``evicted`` miss reason (1.7 MB, fixed)
QUIET_KEYS = 1 << 18  # (hashes, group) of stores a profile suppressed, for their removals


class RecentKeys:
    """The last ``capacity`` keys added, in memory fixed at construction: a ring of 64-bit
    tags (``hash(key)``, 0 reserved) and an open-addressing table of them at most half full,
    so an eviction neither allocates nor frees: 1.7 MB at 65,536 keys, where the OrderedDict
    it replaces held 5.8 MB of nodes plus 4.5 MB of key objects only it kept alive, and grew
    until full. Exact up to a tag collision (p ~ capacity / 2**64)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._mask = (1 << max(4, (2 * capacity - 1).bit_length())) - 1
        self._table = array("Q", bytes(8 * (self._mask + 1)))
        self._ring = array("Q", bytes(8 * capacity))
        self._next = self.count = 0

    def add(self, key: bytes) -> None:
        tag = hash(key) & 0xFFFF_FFFF_FFFF_FFFF or 1
        if self.count == self.capacity:
            self._remove(self._ring[self._next])
        else:
            self.count += 1
        self._ring[self._next] = tag
        self._next = (self._next + 1) % self.capacity
        i, table = tag & self._mask, self._table
        while table[i]:
            i = (i + 1) & self._mask
        table[i] = tag

    def __contains__(self, key: bytes) -> bool:
        tag = hash(key) & 0xFFFF_FFFF_FFFF_FFFF or 1
        i, table = tag & self._mask, self._table
        while t := table[i]:
            if t == tag:
                return True
            i = (i + 1) & self._mask
        return False

    def _remove(self, tag: int) -> None:
        i, table, mask = tag & self._mask, self._table, self._mask
        while table[i] != tag:
            i = (i + 1) & mask
        j = i
        while t := table[j := (j + 1) & mask]:  # backward shift: no tombstones to pile up
            home = t & mask
            if not (i < home <= j if i <= j else home > i or home <= j):
                table[i], i = t, j
        table[i] = 0


class DaemonEvents(EngineCompletion, EngineViews, LookupEvents):
    def __init__(self, *, events: str | None, events_replay: str | None,
                 lookup_events: str | None, int_hashes: bool, registry: CollectorRegistry,
                 hwm: int = 100_000, buffer_batches: int = 10_000,
                 engine_events: list[str] | None = None,
                 engine_max_tokens: int = DEFAULT_MAX_TOKENS, hub: str | None = None,
                 hub_replay: str | None = None, hub_buffer_batches: int | None = None,
                 profile: Profile | None = None, topic: str = "", batch_events: int = 256,
                 buffer_events: int = DEFAULT_BUFFER_EVENTS,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                 engine_views: list[str] | None = None, auto_views: str = "",
                 secure: Callable[[Any], None] | None = None) -> None:
        self.int_hashes = int_hashes
        self.profile = profile or make_profile()
        self.registry = registry
        # Every router-facing publisher (stream, hub, views) shares these settings.
        self._pub_options: dict[str, Any] = {
            "hwm": hwm, "registry": registry, "topic": topic, "buffer_events": buffer_events,
            "buffer_bytes": buffer_bytes, "max_batch_events": batch_events,
            "encode": encode_batch_positional if self.profile.positional else encode_batch,
            "secure": secure}  # CURVE on every event socket (security.curve_server_options)
        self.kv = (EventPublisher(events, events_replay, buffer_batches=buffer_batches or None,
                                  **self._pub_options) if events else None)
        self.lookups = (LookupEventPublisher(lookup_events, hwm=hwm, registry=registry,
                                             secure=secure)
                        if lookup_events else None)
        self.hub = (HubPublisher(hub, hub_replay, buffer_batches=hub_buffer_batches or None,
                                 snapshot=self._snapshot, **self._pub_options)
                    if hub else None)
        self.views: list[EngineView] = []
        self.auto_views = auto_views
        for spec in engine_views or []:
            self._open_view(parse_view_spec(spec))
        # (hashes, group) of stores the profile did not publish: their removals stay quiet.
        self._quiet: OrderedDict[tuple[Any, ...], None] = OrderedDict()
        self.engines = (EngineStreams(engine_events, registry, max_tokens=engine_max_tokens,
                                      on_batch=self._engine_batch, on_block=self._engine_block)
                        if engine_events else None)
        # slot -> the store request's payload, from prepare until commit or abort.
        self._payloads: dict[int, p.StoreItem] = {}
        # slot -> wire hashes a published event listed, when not just its key's hash
        # (tails; chunks completed from several engine blocks).
        self._listed: dict[int, list[Any]] = {}
        self._awaiting: OrderedDict[int, tuple[Namespace, bytes]] = OrderedDict()
        # int hash of an awaiting chunk key -> its slots (one per group), for completion.
        self._awaiting_by_hash: dict[int, set[int]] = {}
        # Only with the hub: slot -> what its event said; listed hashes -> shared tokens.
        self._resident: dict[int, StoredRecord] = {}
        self._tokens: dict[tuple[Any, ...], list[Any]] = {}  # hashes -> [array, refs]
        # Recently evicted keys, for the lookup handler's ``evicted`` miss reason: kept with
        # no event endpoint too, since /metrics and ``kvoffload stats`` count that reason.
        self._evicted = RecentKeys(RECENTLY_EVICTED)
        # Set by the disk tier: keep each resident block's record (as for the hub) so an
        # evicted block's STORAGE event, and its CPU event when promoted back, can be told.
        self.keep_payloads = False
        self._restored: dict[int, StoredRecord] = {}  # slot -> record of a promotion
        self.incomplete = Counter("kvoffload_events_incomplete_total",
                                  "Stores whose event could not carry a full payload, by "
                                  "reason (no_tokens, bad_length, overflow).", ["reason"],
                                  registry=registry)
        self.awaiting_gauge = Gauge("kvoffload_events_awaiting_payload",
                                    "Committed blocks whose event waits for token ids.",
                                    registry=registry)
        self.completed = Counter("kvoffload_events_completed_total",
                                 "Awaiting stores whose payload came from an engine stream.",
                                 registry=registry)

    @property
    def enabled(self) -> bool:
        return self.kv is not None or self.hub is not None or bool(self.views) or \
            bool(self.auto_views)

    @property
    def _keep_records(self) -> bool:
        # Views added later (on Register) announce what is resident: keep the records then.
        return self.hub is not None or self.keep_payloads or bool(self.views) or \
            bool(self.auto_views)

    async def start(self) -> None:
        self._started = True
        for pub in (self.kv, self.lookups, self.hub, *(v.pub for v in self.views)):
            if pub is not None:
                await pub.start()
        if self.engines is not None:
            await self.engines.start()

    async def aclose(self) -> None:
        if self.engines is not None:
            await self.engines.aclose()
        for pub in (self.kv, self.lookups, self.hub, *(v.pub for v in self.views)):
            if pub is not None:
                await pub.aclose(flush=True)

    # -- index listeners --------------------------------------------------------------

    def remember(self, slot: int, item: p.StoreItem) -> None:
        """Keep a store's payload from prepare to commit (only when KV events are on)."""
        if self.enabled:
            self._payloads[slot] = item

    def forget(self, slot: int) -> None:
        """A prepared store was aborted: nothing was published, nothing to remove."""
        self._payloads.pop(slot, None)
        self._restored.pop(slot, None)

    def stored(self, ns: Namespace, key: bytes, slot: int) -> None:
        item = self._payloads.pop(slot, None)
        restored = self._restored.pop(slot, None)
        if not self.enabled:
            return
        if restored is not None:  # promoted from a tier: the event it had before eviction
            self._publish_stored(slot, key, dataclasses.replace(  # REMOTE: shared tier
                restored, medium="CPU",
                locality="REMOTE" if restored.locality == "REMOTE" else "LOCAL").to_event(), ns)
            return
        event = self._block_stored(ns, key, slot, item)
        if event is None and item is not None and not item.tail:
            event = self._from_engines(ns, key, slot)
        if event is None:
            if item is None or item.token_ids is None:
                self.incomplete.labels("no_tokens").inc()
            self._awaiting[slot] = (ns, key)
            if item is not None and not item.tail:
                self._awaiting_by_hash.setdefault(hash_to_int(key_hash(key)), set()).add(slot)
            if len(self._awaiting) > MAX_AWAITING_PAYLOAD:
                self._unawait(next(iter(self._awaiting)))
                self.incomplete.labels("overflow").inc()
            self.awaiting_gauge.set(len(self._awaiting))
            return
        self._publish_stored(slot, key, event, ns, item is not None and item.tail)

    def recovered(self, ns: Namespace, key: bytes, slot: int, tail: bool) -> None:
        """A block recovered from the state dir after a restart. Its payload (token ids) died
        with the old process, and routers saw the old stream end: announce it again once an
        engine stream tells its tokens (complete chunks); a tail waits, counted."""
        if not self.enabled:
            return
        self._awaiting[slot] = (ns, key)
        if not tail:
            self._awaiting_by_hash.setdefault(hash_to_int(key_hash(key)), set()).add(slot)
        self.incomplete.labels("recovered").inc()
        self.awaiting_gauge.set(len(self._awaiting))

    def _emit(self, event: KVEvent, ns: Namespace | None = None, tail: bool = False) -> bool:
        """Publish `event` to every router-facing stream, as the profile says; False: not."""
        if not self.profile.allows(event, tail):
            return False
        if (self._quiet and isinstance(event, BlockStored | BlockRemoved)
                and self._quiet_key(event.block_hashes, event.group_idx) in self._quiet):
            return False  # its store was not published (or this is its tier copy)
        if self.profile.ownership is not None and isinstance(event, BlockStored | BlockRemoved):
            event = msgspec.structs.replace(event, ownership=self.profile.ownership)
        if self.kv is not None:
            self.kv.publish(event)
        if self.hub is not None:
            self.hub.publish(event)
        for view in self.views:
            want = view.spec.namespace
            if want is None or ns is None or ns.geometry.namespace == want:
                view.pub.publish(event)
        return True

    def _quiet_key(self, hashes: Any, group: int | None) -> tuple[Any, ...]:
        return (tuple(hashes), group)

    def _hush(self, hashes: Any, group: int | None) -> None:
        key = self._quiet_key(hashes, group)
        self._quiet[key] = None
        self._quiet.move_to_end(key)
        if len(self._quiet) > QUIET_KEYS:
            self._quiet.popitem(last=False)

    def _publish_stored(self, slot: int, key: bytes, event: BlockStored,
                        ns: Namespace | None = None, tail: bool = False) -> None:
        if event.block_hashes != [self._hash(key_hash(key))]:
            self._listed[slot] = list(event.block_hashes)
        if self._keep_records:
            listed = tuple(event.block_hashes)
            shared = self._tokens.get(listed)
            if shared is None or shared[0].tolist() != event.token_ids:
                shared = self._tokens[listed] = [array("I", event.token_ids), 0]
            shared[1] += 1
            self._resident[slot] = StoredRecord.from_event(event, tokens=shared[0])
        if not self._emit(event, ns, tail):
            self._hush(event.block_hashes, event.group_idx)

    # -- hub ---------------------------------------------------------------------------

    def _engine_batch(self, idx: int, batch: EventBatch) -> None:
        if self.hub is not None:
            self.hub.publish(batch)
        for view in self.views:  # the engine's own GPU blocks, credited to its rank
            if view.spec.engine == idx:
                view.pub.publish(EventBatch(ts=batch.ts, events=batch.events,
                                            data_parallel_rank=view.spec.rank))

    def _snapshot(self) -> list[StoredRecord]:
        gpu = self.engines.records() if self.engines is not None else []
        return [*gpu, *self._resident.values()]

    def _unresident(self, slot: int) -> None:
        rec = self._resident.pop(slot, None)
        if rec is None:
            return
        shared = self._tokens.get(rec.hashes)
        if shared is not None and shared[0] is rec.tokens:
            shared[1] -= 1
            if shared[1] <= 0:
                del self._tokens[rec.hashes]

    def _block_stored(self, ns: Namespace, key: bytes, slot: int, item: p.StoreItem | None
                      ) -> BlockStored | None:
        g = ns.geometry
        group = key_group(key)
        spec = g.groups[g.group_pos(key)]
        if item is None or item.token_ids is None:
            return None  # counted by the caller if the engines cannot complete it either
        if item.tail:
            hashes = list(item.block_hashes or [])
            block_size = g.tokens_per_hash
        else:
            hashes = [key_hash(key)]
            block_size = spec.tokens_per_block * g.blocks_per_chunk
            per_block = spec.tokens_per_block // g.tokens_per_hash
            fine = item.block_hashes or []
            if (self.profile.engine_blocks and g.blocks_per_chunk > 1
                    and len(fine) == per_block * g.blocks_per_chunk and fine[-1] == hashes[0]):
                # One hash per engine block (a block's hash is its last fine hash), so a
                # router registered at the engine's block size accepts the chunk.
                hashes = list(fine[per_block - 1::per_block])
                block_size = spec.tokens_per_block
        if not hashes or len(item.token_ids) != block_size * len(hashes):
            self.incomplete.labels("bad_length").inc()
            return None
        return BlockStored(
            block_hashes=[self._hash(h) for h in hashes],
            parent_block_hash=None if item.parent_hash is None else self._hash(item.parent_hash),
            token_ids=list(item.token_ids), block_size=block_size, lora_id=None, medium="CPU",
            lora_name=item.lora_name, group_idx=group, kv_cache_spec_kind=spec.kind.value,
            kv_cache_spec_sliding_window=spec.sliding_window_tokens, locality="LOCAL")

    def dropped(self, ns: Namespace, key: bytes, slot: int) -> None:
        """A READY block left the pool (eviction, reset): remove what its store listed."""
        self._evicted.add(key)
        listed = self._listed.pop(slot, None)
        self._unresident(slot)
        if self._unawait(slot):
            self.awaiting_gauge.set(len(self._awaiting))
            return  # never published, so nothing to remove
        if not self.enabled:
            return
        hashes = listed or [self._hash(key_hash(key))]
        self._emit(BlockRemoved(block_hashes=hashes, medium="CPU", group_idx=key_group(key),
                                locality="LOCAL"), ns)

    def cleared(self) -> None:
        # Not sent to the hub, nor to a view that merges an engine's stream: there a clear
        # would also wipe the engines' GPU blocks.
        if self.kv is not None:
            self.kv.publish(AllBlocksCleared())
        for view in self.views:
            if view.spec.engine is None:
                view.pub.publish(AllBlocksCleared())

    def was_evicted(self, key: bytes) -> bool:
        return key in self._evicted

    # -- tiers below the pool (daemon/tiers) --------------------------------------------

    def record_of(self, slot: int) -> StoredRecord | None:
        """What the published BlockStored of a resident block said (None: not published)."""
        return self._resident.get(slot)

    def restored(self, slot: int, record: StoredRecord) -> None:
        """A promotion into ``slot`` is about to commit: announce it as its record says."""
        self._restored[slot] = record

    def storage_stored(self, record: StoredRecord) -> None:
        if self.enabled:
            self._emit(dataclasses.replace(record, medium="STORAGE", locality="LOCAL").to_event())

    def storage_removed(self, hashes: list[Any], group: int) -> None:
        if self.enabled:
            self._emit(BlockRemoved(block_hashes=hashes, medium="STORAGE", group_idx=group,
                                    locality="LOCAL"))
