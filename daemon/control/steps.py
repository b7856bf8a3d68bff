"""The ``Step`` handler: everything one scheduler step of an index-reading engine writes.

An engine that answers vLLM from the shared index sends at most one ``Step`` per scheduler
step and never waits for its reply (it reads it at a later step). Handled in this order:

1. ``commits`` / ``aborts`` of this client's own pending stores only. First: the engine loads
   its own committed stores before it reads them READY, and their pins ride the same Step as
   the commit (a commit makes nothing evictable that a pin below would have protected).
2. ``pins``: each is (key, slot, generation) as the engine saw it READY. The slot is pinned if
   its generation still matches (READY, or retired but not reclaimed: the bytes are intact).
   Otherwise the key is answered in ``lost``: its load must be reported as failed, and the
   worker's own generation check fails it too.
3. ``releases``: the loads are done (pins drop; the block becomes most recently used).
4. ``claims``: keys into slots of this client's reservation; a key stored meanwhile by another
   engine is answered in ``exists`` and the slot stays reserved for the next store. A claim
   of an earmarked READY block evicts it and queues its handover (``earmarks.py``: the slot
   is written only once no reader can load the old block, within ``HANDOVER_S`` of the
   Step's ``stamp``); earmarks used meanwhile are answered in ``withdrawn``.
5. ``unreserve``; then ``epoch``: the engine's pins above were decided from that view
   (``reclaim.py``), so slots retired before it are reclaimed now, ahead of ``reserve``
   (refill, evicting as needed, bounded per client: what one step's prefill stores, at any
   rate, fits; see ``reservation_cap``) and the promotions of ``finds``.
6. ``finds``: keys the pool misses are looked up in the lower tiers; a hit starts a promotion
   (the key reads PENDING in the index, then READY: nobody polls).
7. ``lookups``: per-request outcomes, published as lookup events; ``touches``: READY blocks a
   request reused (offered to store again), most recently used now; then the pool's free
   slots are topped up ahead of the next stores (``keep_free``).
"""

from __future__ import annotations

import math
from collections import Counter

from kvoffload.daemon.base import KeyStatus
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.control.errors import bad_request as _bad
from kvoffload.daemon.control.leases import ClientState, drop_pin
from kvoffload.daemon.control.quotas import Quotas
from kvoffload.daemon.ops.metrics import DaemonMetrics
from kvoffload.daemon.store.index import BlockIndex, Namespace
from kvoffload.daemon.streams.publish import DaemonEvents
from kvoffload.daemon.tiers.promote import Promoter

# Token ids one store may describe: a block of 1M tokens is already implausible.
MAX_ITEM_TOKENS = 1 << 20


class StepHandler:
    def __init__(self, index: BlockIndex, metrics: DaemonMetrics, events: DaemonEvents,
                 totals: Counter[str], max_reserved: int) -> None:
        self.index = index
        self.metrics = metrics
        self.events = events
        self.totals = totals
        self.max_reserved = max_reserved
        self.tiers: Promoter | None = None
        self.pending_owner: dict[int, ClientState] = {}  # shared with Service
        self.quotas: Quotas | None = None  # per-client caps (set by Service)
        # Label children resolved once: a Step names hundreds of keys, and a labels() lookup
        # per key was most of the daemon's CPU per message.
        loads, stores = metrics.loads, metrics.stores
        self._pinned, self._lost = loads.labels("pinned"), loads.labels("lost")
        self._pin_quota, self._completed = loads.labels("quota"), loads.labels("completed")
        self._granted, self._exists = stores.labels("granted"), stores.labels("exists")
        self._refused, self._not_worth = stores.labels("refused"), stores.labels("not_worth")
        self._committed, self._aborted = stores.labels("committed"), stores.labels("aborted")
        self._tail_store = metrics.tails_declined.labels("store")

    def reservation_cap(self) -> int:
        """Slots one client may hold empty: an eighth of the pool (and ``max_reserved_slots``
        when set). A prefill of 8,192 tokens in 16-token blocks stores 512 keys per step and
        the engine keeps twice a step's demand at hand; quotas bound it further."""
        share = max(1, self.index.pool.num_slots // 8)
        return min(self.max_reserved, share) if self.max_reserved else share

    def _validate(self, ns: Namespace, msg: p.Step) -> None:
        for claim in msg.claims:
            it = claim.item
            if not 0 <= it.end_token < 1 << 32:
                raise _bad("end_token must be in 0..2**32-1")
            if it.token_ids is not None and len(it.token_ids) > MAX_ITEM_TOKENS:
                self.metrics.refused.labels("token_ids").inc()
                raise _bad(f"{len(it.token_ids)} token ids in one store item; the limit is "
                           f"{MAX_ITEM_TOKENS}")
        if msg.reserve < 0:
            raise _bad("reserve must be >= 0")
        if not math.isfinite(msg.stamp):
            raise _bad("stamp must be a finite time.monotonic() value")

    def handle(self, client: ClientState, ns: Namespace, msg: p.Step) -> p.StepReply:
        self._validate(ns, msg)
        idx, m = self.index, self.metrics
        reply = p.StepReply(rid=msg.rid)
        self._commits(client, ns, msg, reply)
        room = self.quotas.room_pins(client) if self.quotas is not None and msg.pins else 0
        pinned = lost = 0
        for ref in msg.pins:
            if room <= 0:  # its share of the pool is pinned already: the load fails, counted
                reply.lost.append(ref.key)
                self._pin_quota.inc()
                assert self.quotas is not None
                self.quotas.refused("pins")
                continue
            if ns.keys.get(ref.key, ref.slot) == ref.slot and idx.pin_generation(ref.slot,
                                                                                 ref.gen):
                room -= 1
                client.pins[ref.slot] += 1
                idx.touch(ref.slot)
                pinned += 1
            else:
                reply.lost.append(ref.key)
                lost += 1
        if pinned:
            self._pinned.inc(pinned)
            m.loaded_bytes.inc(pinned * idx.pool.slot_bytes)
        if lost:
            self._lost.inc(lost)
        completed = 0
        for ref in msg.releases:
            if drop_pin(idx, client, ref.slot):
                idx.touch(ref.slot)
                completed += 1
        if completed:
            self._completed.inc(completed)
        self._claims(client, ns, msg, reply)
        for ref in msg.unreserve:
            if ref.slot in client.reserved:
                client.reserved.discard(ref.slot)
                idx.unreserve(ref.slot)
        # The engine's pins above were decided from this view; what no reader can still see
        # is free before the refill and the promotions below look for room.
        idx.reclaimer.report(client.identity, msg.epoch)
        idx.reclaim()
        self._reserve(client, msg.reserve, reply)
        self._finds(ns, msg.finds, reply)
        for r in msg.lookups:
            query = p.LookupQuery(req_id=r.req_id, num_tokens=r.num_tokens,
                                  num_prompt_tokens=r.num_prompt_tokens or r.num_tokens,
                                  local_tokens=r.local_tokens)
            answer = p.LookupAnswer(req_id=r.req_id, hit_tokens=r.hit_tokens,
                                    chunk_tokens=r.chunk_tokens, tail_boundary=r.tail_boundary,
                                    hit_keys=r.hit_keys, pending_keys=r.pending_keys,
                                    miss_reason=r.miss_reason)
            self.events.lookup(ns, query, answer, None if r.latency_us is None
                               else r.latency_us / 1e6)
            self.totals["lookups_reported"] += 1
        for key in msg.touches:
            slot = ns.keys.get(key)
            if slot is not None:
                idx.touch(slot)  # READY only (index.touch): a pending or retired one is not
        ahead = idx.keep_free()
        if ahead:
            m.evictions.labels(idx.policy.name, "capacity").inc(ahead)
        reply.epoch = idx.epoch
        if idx.withdrawn:
            reply.withdrawn = idx.take_withdrawn(client)
            for slot in reply.withdrawn:
                client.reserved.discard(slot)
        return reply

    def _commits(self, client: ClientState, ns: Namespace, msg: p.Step,
                 reply: p.StepReply) -> None:
        idx = self.index
        for ok, refs in ((True, msg.commits), (False, msg.aborts)):
            done = 0
            for ref in refs:
                slot = ns.keys.get(ref.key)
                if slot != ref.slot or slot not in client.pending or idx.gen[slot] != ref.gen:
                    reply.refused.append(ref.key)
                    continue
                if idx.commit(ns, ref.key) if ok else idx.abort(ns, ref.key):
                    client.pending.discard(slot)
                    self.pending_owner.pop(slot, None)
                    done += 1
            if done:
                (self._committed if ok else self._aborted).inc(done)
                if ok:
                    self.metrics.stored_bytes.inc(done * idx.pool.slot_bytes)

    def _claims(self, client: ClientState, ns: Namespace, msg: p.Step,
                reply: p.StepReply) -> None:
        idx = self.index
        granted = 0
        for claim in msg.claims:
            it = claim.item
            if it.tail and ns.cost is not None and not ns.cost.admit_tail(it.end_token):
                # A later hit on this tail would cost more to load than to recompute.
                reply.exists.append(it.key)
                self._not_worth.inc()
                self._tail_store.inc()
                continue
            earmark = idx.earmarks.get(claim.slot) is client
            ok = idx.claim(ns, it.key, claim.slot, claim.gen, it.end_token, it.tail, client,
                           client.owner, msg.stamp)
            if earmark and claim.slot not in idx.earmarks:  # used up: claimed or burnt
                client.reserved.discard(claim.slot)
                if ok:  # its block was evicted for this store
                    self.metrics.evictions.labels(idx.policy.name, "capacity").inc()
            if ok is None:
                reply.refused.append(it.key)
                self._refused.inc()
            elif not ok:
                reply.exists.append(it.key)
                self._exists.inc()
            else:
                client.reserved.discard(claim.slot)
                client.pending.add(claim.slot)
                self.pending_owner[claim.slot] = client
                self.events.remember(claim.slot, it)
                granted += 1
        if granted:
            self._granted.inc(granted)

    def _reserve(self, client: ClientState, want: int, reply: p.StepReply) -> None:
        n = min(want, self.reservation_cap() - len(client.reserved))
        if self.quotas is not None and n > 0:
            room = self.quotas.room_pending(client)
            if room < n:  # a shorter reservation: the engine counts its short stores
                self.quotas.refused("pending", n - room)
                n = room
        if n <= 0:
            return
        granted, evicted = self.index.reserve(client, n)
        if evicted:
            self.metrics.evictions.labels(self.index.policy.name, "capacity").inc(len(evicted))
        client.reserved.update(slot for slot, _ in granted)
        reply.granted = granted
        # Nothing granted and nothing on its way back: every slot is pinned, pending or held.
        reply.no_space = not granted and not evicted and self.index.reclaimer.backlog == 0
        if len(granted) < n:
            self.metrics.stores.labels("reserve_short").inc(n - len(granted))

    def _finds(self, ns: Namespace, keys: list[bytes], reply: p.StepReply) -> None:
        for key in keys:
            if self.index.status(ns, key) is not KeyStatus.MISS:
                reply.found.append(key)  # stored or promoted meanwhile: the index says so
            elif self.tiers is not None and self.tiers.probe(ns, key) is not KeyStatus.MISS:
                reply.found.append(key)
            else:
                reply.not_found.append(key)

    def release_client(self, client: ClientState, fence_s: float) -> int:
        """A departed client's reservation goes back, revoked: its workers may still write
        (quarantined while they hold its session's lock, else fenced for ``fence_s``)."""
        writers = client.session if client.writer_lock else None
        for slot in client.reserved:
            self.index.unreserve(slot, fence_s, writers)
        self.index.take_withdrawn(client)
        n = len(client.reserved)
        client.reserved.clear()
        if client.reads_index:
            self.index.reclaimer.remove_reader(client.identity)
        return n
