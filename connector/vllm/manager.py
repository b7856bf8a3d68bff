"""Scheduler side of the plugin: vLLM's ``OffloadingManager`` over the daemon's shared index.

vLLM's scheduler asks ``lookup(key)`` dozens of times per request and runs its own scan over
the answers (chunks, partial tails, EAGLE margins, ``max_load_tokens``, ...). Each answer is a
probe of ``IndexView``'s table (the daemon's index as this engine last read it), so vLLM's scan
runs unchanged over true per-key states. No message is sent on the lookup path:

* the first call of a scheduler step refreshes the view (one integer read when nothing
  changed) and reads the replies of earlier steps; ``on_schedule_end`` sends the step's
  ``Step`` without waiting when it carries what cannot wait (the pins of this step's loads,
  store claims, lower-tier finds, a reservation refill); commits, releases of finished loads
  and lookup reports ride the next such message (``LAZY_STEPS`` at most, or at once when vLLM
  has no request left);
* ``prepare_load`` hands the workers each key's (slot, generation) as read; the daemon pins
  them on arrival, and epoch-based reclamation (``daemon/store/reclaim.py``) keeps a slot's bytes
  until then. A slot that went to another writer fails its generation check in the worker, and
  the load is reported (never used);
* ``prepare_store`` takes slots from a reservation the daemon granted in advance and sized to
  recent steps' demand (``reservation.py``); a store short of slots, of a request vLLM offers
  again, answers None (vLLM offers the same keys next step, when the refill is in), one vLLM
  offers once waits ``sync_ms`` at most for a grant asked then (``_top_up``: a ramp); never a
  dropped key while the daemon grants; "already stored" is read from the view, never from a
  private memory that goes stale;
* until the view shows a store READY the manager answers for its own stores itself
  (``own_stores.py``): PENDING, or HIT once committed and the daemon holds the claim (the
  daemon applies a Step's commits before its pins), however long the daemon takes; once it
  has answered a claim the view decides (a block another engine evicted is a MISS at once);
* a key missing from the pool answers RETRY when the daemon has a disk or Mooncake tier, and
  the step's ``finds`` ask the tier; a promotion shows in the index as PENDING, then READY;
  another engine's PENDING key, or a tier's RETRY, defers a request ``pending_wait_ms`` at
  most, then answers MISS and vLLM computes (``waits.py``);
* when the daemon is down, frozen or restarted, lookups answer MISS and nothing is stored
  (``IndexSession`` decides, without a message), and the session re-attaches by itself.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection
from typing import Any

from kvoffload.connector.ready_table import ReadyTable
from kvoffload.connector.session import IndexSession
from kvoffload.connector.vllm.batch import StepBatch as _Batch
from kvoffload.connector.vllm.cache_reset import CacheReset
from kvoffload.connector.vllm.load_spec import PoolInfo, PoolSlotsSpec
from kvoffload.connector.vllm.own_stores import Action, OwnStores
from kvoffload.connector.vllm.requests import (
    RequestInfo,
    lookup_report,
    offered_again,
    store_item,
)
from kvoffload.connector.vllm.reservation import HEADROOM, Reservation
from kvoffload.connector.vllm.settings import ManagerSettings
from kvoffload.connector.vllm.waits import Finds, Waits
from kvoffload.daemon.base import Geometry, GroupKind, key_group
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.store import shared_index as si
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

log = logging.getLogger("kvoffload.connector.vllm")
ATTACH_WAIT_S = 10.0  # longest wait for the first registration, at engine start only
LAZY_STEPS = 4  # steps a commit, release or lookup report may wait for a message to ride

HIT, MISS, PENDING, RETRY = (LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING,
                             LookupResult.RETRY)
_OFFLINE = ReadyTable(0, lambda slot: None)  # no view: nothing READY


def _empty_store() -> PrepareStoreOutput:
    return PrepareStoreOutput(keys_to_store=[], store_spec=PoolSlotsSpec([], None),
                              evicted_keys=[])


class DaemonOffloadingManager(CacheReset, OffloadingManager):
    def __init__(self, session: IndexSession, geometry: Geometry,
                 settings: ManagerSettings) -> None:
        self.session, self.geometry, self.settings = session, geometry, settings
        session.on_lost = self._drop_daemon_state
        self._block = {geometry.group_id(i): g.tokens_per_block * geometry.blocks_per_chunk
                       for i, g in enumerate(geometry.groups)}
        # Groups vLLM stores only from the core's copy-on-write hand-off (Mamba in align mode):
        # those keys are offered once, never again after a None.
        self._cow = {geometry.group_id(i) for i, g in enumerate(geometry.groups)
                     if g.kind is GroupKind.MAMBA and g.mamba_align}
        self.requests: dict[str, RequestInfo] = {}  # handed over by KVOffloadConnector
        self.counters: Counter[str] = Counter()
        self._step, self._busy, self._tiers = 0, False, False
        self._pool: PoolInfo | None = None
        self.reservation = Reservation(settings.reserve, len(geometry.groups))
        session.reserve = self.reservation.first  # the attach thread's first reservation
        self._reserved = self.reservation.slots  # the same list (tests read its length)
        self.own = OwnStores(self.counters)  # our stores until the view shows them READY
        self._loads: dict[str, list[p.SlotRef]] = {}  # req -> pins of its load in flight
        self._finds = Finds(settings.find_ttl_steps)  # keys asked of the daemon's tiers
        self._waits = Waits(settings.pending_wait_ms, self.counters)  # waits.py: why
        self._batch = _Batch()
        self._held = -1  # the step since which the batch holds items that could wait
        self._waited = False  # this step waited for our claims' replies already
        self._flush = False  # vLLM has no request left: send what waits at the next step
        self._live: set[str] = set()  # requests vLLM has not finished
        self._deferred: dict[str, int] = {}  # request -> keys its last store deferred
        self._find, self._declined = _OFFLINE.find, _OFFLINE.declined_flags  # per step: _begin

    # -- the step -----------------------------------------------------------------------

    def attach(self, wait_s: float = ATTACH_WAIT_S) -> None:
        """Register, map the index and fill the store reservation now, at engine start (the
        engine is not serving yet, so this may wait), so that the first step neither waits
        nor finds prepare_store without slots. Re-attaching later never waits on a step."""
        self.session.start(wait_s)
        self._begin()
        self.session.end_idle()
        self._busy = False

    def _begin(self) -> None:
        """First call of a step: refresh the view, read replies. Sets ``_busy``."""
        self._busy = True
        self._waited = False
        replies = self.session.begin()
        view = self.session.view
        self._waits.start_step(self._step, view.pending if view is not None else (),
                               self._finds.asking)
        table = view.ready if view is not None else _OFFLINE  # offline: nothing READY
        self._find, self._declined = table.find, table.declined_flags  # bound for this step
        if replies is None:
            return
        reg = self.session.reg
        if reg is not None and (self._pool is None or self._pool.daemon_id != reg.daemon_id):
            self._pool = PoolInfo(reg.daemon_id, reg.pool_path,
                                  reg.slot_bytes * reg.num_slots, reg.slot_bytes,
                                  reg.rank_bytes, reg.index_path)
            self._tiers = reg.has_tiers
        for reply in replies:
            self._absorb(reply)
        if view is not None and self.own.any_committed:
            self.own.settle(view)  # replies read before the refresh: the view decides

    def _wait_claims(self) -> None:
        """Once per step, only when a lookup wants our own committed store whose claim the
        daemon has not answered yet (it almost always has: claims go out two steps before
        their commits): wait up to ``sync_ms`` for the replies, rather than defer it."""
        self._waited = True
        for reply in self.session.poll():  # arrived already, unread
            self._absorb(reply)
        if self.own.unanswered:
            for reply in self.session.wait_replies(self.settings.sync_ms):
                self._absorb(reply)

    def _absorb(self, r: p.StepReply) -> None:
        self.reservation.answered(r.rid, r.granted, r.no_space)
        self._reserved.extend(self.own.answered(r.rid, r.exists, r.refused))
        self.counters["earmarks_withdrawn"] += self.reservation.withdraw(r.withdrawn)
        if r.lost:
            self.counters["pins_lost"] += len(r.lost)
            log.warning("kvoffload: %d loads lost their slot before the daemon pinned them; "
                        "the workers report them as failed", len(r.lost))
        self._finds.answered(r.found, r.not_found, self._step)

    def _drop_daemon_state(self) -> None:
        """The daemon went away: nothing it granted is ours any more."""
        self._waits.clear()
        self.reservation.clear()
        self.own.clear()
        self._finds.clear()
        self._loads.clear()
        self._batch = _Batch()

    # -- lookups ------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # The hot path: vLLM calls this ~50-80 times per long request. One table probe for a
        # hit, everything else only on the way to a miss.
        if not self._busy:
            self._begin()
        slot = self._find(key)
        if slot >= 0:
            if self._declined[slot]:  # its load cannot repay its bytes
                self.counters["tails_declined"] += 1
                return MISS
            return HIT
        view = self.session.view
        if view is None:
            return MISS  # offline: vLLM computes, nothing waits
        if key in self.own:
            # Our own store, committed, its claim answered: the daemon holds it PENDING in our
            # slot and takes our commit before any pin of the same or a later Step.
            if not self._waited and self.own.done_early(key):
                self._wait_claims()
            return HIT if self.own.hit(key) else PENDING
        if key in view.pending:
            return PENDING if self._waits.may_wait(key) else MISS
        if self._tiers and self._finds.worth_asking(key, self._step):
            if not self._waits.may_wait(key):  # the tier is too slow for this request
                self._finds.give_up(key, self._step)
                self._waits.forget(key)
                return MISS
            if self._finds.ask(key):
                self._batch.finds.append(key)
            return RETRY  # the scan goes on; asked again next step
        return MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return  # vLLM 0.33 never calls it; loads and reuse offers (``touches``) say recency

    # -- loads --------------------------------------------------------------------------

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext
                     ) -> LoadStoreSpec:
        view = self.session.view
        slots, gens, refs = [], [], []
        for key in keys:
            ref = view.ready.get(key) if view is not None else None
            if ref is None:
                own = self.own.loadable(key)  # our own committed store (see lookup)
                if own is not None:
                    ref = (own[0], si.ident(own[1], key))
            if ref is None:
                # Only a HIT of this step is loaded; its view vanished (offline mid-step).
                slots.append(-1)
                gens.append(0)
                self.counters["loads_without_slot"] += 1
                continue
            slots.append(ref[0])
            gens.append(ref[1])  # the ident word: the worker checks generation and key tag
            refs.append(p.SlotRef(key, ref[0], ref[1] & si.GEN_MASK))
        self._batch.pins.extend(refs)
        self._loads.setdefault(req_context.req_id, []).extend(refs)
        self.counters["loads"] += 1
        self.counters["keys_loaded"] += len(refs)
        return PoolSlotsSpec(slots, self._pool, gens, req_context.req_id)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        refs = self._loads.pop(req_context.req_id, [])
        self._batch.releases.extend(refs)

    # -- stores -------------------------------------------------------------------------

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext
                      ) -> PrepareStoreOutput | None:
        if not self._busy:
            self._begin()
        view = self.session.view
        if view is None or self._pool is None:
            self.counters["stores_skipped_offline"] += len(keys)
            return _empty_store()  # not None: vLLM would re-offer (and log) every step
        ready, pending, own = view.ready, view.pending, self.own.held
        new = [k for k in keys if k not in ready and k not in pending and k not in own]
        if len(new) < len(keys):  # reused blocks: their recency, as vLLM's manager keeps it
            self._batch.touches += [k for k in keys if k in ready]
        if not new:
            return _empty_store()
        res = self.reservation
        # Keys offered again after a None count once: the demand is what the prefill adds.
        res.demand += len(new) - min(len(new), self._deferred.pop(req_context.req_id, 0))
        if len(res.slots) < len(new):
            for reply in self.session.poll():  # a refill that came in since the step began
                self._absorb(reply)
        if len(res.slots) < len(new):
            if res.covers(len(new)) and offered_again(self.requests.get(req_context.req_id),
                                                      new, req_context, self._cow, self._block):
                # vLLM keeps these keys and offers them again next step, when the refill this
                # step asks for is at hand: a step later, nothing lost, nothing waited for.
                self.counters["stores_deferred"] += len(new)
                self._deferred[req_context.req_id] = len(new)
                return None
            self._top_up(len(new))  # offered once only: the bounded wait of a ramp
        if len(res.slots) < len(new):
            # Offered once only (a finished request, a tail, a copy-on-write state) and the
            # daemon granted no more in time, or more than it grants us: the longest prefix
            # that fits (keys in prefix order).
            self.counters["stores_short_reservation"] += len(new) - len(res.slots)
            new = new[:len(res.slots)]
            if not new:
                return _empty_store()
        return self._claim(new, req_context)

    def _top_up(self, n: int) -> None:
        """Keys vLLM offers once only (tails, copy-on-write states, a finished request's last
        blocks) lack slots: the step's demand jumped past what recent steps asked for (a ramp:
        48 requests' tails in one step). Ask for the target now and wait ``sync_ms`` at most,
        rather than drop keys vLLM never offers again; only while every earlier ask was
        answered in full (a slow, frozen or capping daemon is not waited for again). The
        record stays busy at the view's epoch: this step's pins stay protected (reclaim.py)."""
        res = self.reservation
        want = max(res.target(), HEADROOM * n) - len(res.slots)
        if res.asked or res.short or res.no_space or want <= 0:
            return
        rid = self.session.send(lambda rid, engine, epoch: p.Step(
            rid=rid, engine=engine, epoch=epoch, reserve=want), end_of_step=False, sync=True)
        if rid is not None:  # None: the session is lost, and no grant can come
            res.sent(rid, want)
            self.counters["reserve_waits"] += 1
            for reply in self.session.wait_replies(self.settings.sync_ms, only_sync=True):
                self._absorb(reply)

    def _claim(self, new: list[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput:
        info = self.requests.get(req_context.req_id)
        tph = self.geometry.tokens_per_hash
        refs = self.reservation.take(len(new), {ref.slot for ref in self._batch.pins})
        stamp = self._batch.claim_stamp()  # its workers' deadline for an earmark's handover
        claims, block = self._batch.claims, self._block
        for key, (slot, gen) in zip(new, refs, strict=True):
            item = store_item(key, req_context.get_offload_key_position(key),
                              block.get(key_group(key), 1), tph, info)
            claims.append(p.StoreClaim(item=item, slot=slot, gen=gen))
        self.own.claimed(new, refs)
        self._finds.stored(new)  # the pool may demote them: a tier may hold them later
        slots, gens = [r[0] for r in refs], [r[1] for r in refs]
        self.counters["stores_offered"] += len(new)
        lock = self.session.reg.readers_path if self.session.reg is not None else ""
        return PrepareStoreOutput(keys_to_store=new,
                                  store_spec=PoolSlotsSpec(slots, self._pool, gens, lock=lock,
                                                           stamp=stamp),
                                  evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        # The commits ride the next step's Step (no message of their own): until the view
        # shows them READY, lookup answers for them (HIT once the claim is in the index).
        batch = self._batch
        for key in keys:
            done = self.own.done(key, success)
            if done is None:
                continue
            what, (slot, gen) = done
            if what is Action.REUSE:  # the daemon kept the slot reserved for us: reuse it
                self._reserved.append((slot, gen))
            elif what is Action.COMMIT:
                batch.commits.append(p.SlotRef(key, slot, gen))
                self.counters["stores_committed"] += 1
            elif what is Action.ABORT:
                batch.aborts.append(p.SlotRef(key, slot, gen))

    # -- lifecycle ----------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        # REQUEST_LEVEL: every chunk is offered, prefix hits included, so the block a partial
        # tail only half loaded is stored once the request fills it (the vLLM 0.33 gap).
        policy = (OffloadPolicy.REQUEST_LEVEL if self.settings.policy == "request"
                  else OffloadPolicy.CHUNK_LEVEL)
        self._live.add(req_context.req_id)
        return RequestOffloadingContext(policy=policy)

    def track(self, request: Any) -> None:
        """A request vLLM's connector saw (``KVOffloadConnector``): its tokens for events."""
        self.requests[request.request_id] = RequestInfo.of(request)

    def report_lookup(self, report: Any) -> None:
        """A request's outcome (a ``LookupReport``, or the arguments of one built later)."""
        self._batch.lookups.append(report)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.requests.pop(req_context.req_id, None)
        self._live.discard(req_context.req_id)
        self._deferred.pop(req_context.req_id, None)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        for reply in self.session.poll():  # grants, refusals, finds of earlier steps
            self._absorb(reply)
        res, batch = self.reservation, self._batch
        want = res.end_step()
        if not self.session.attached:
            self._batch = _Batch()  # offline: nothing of it means anything to a daemon
            self.session.end_idle()
            self.session.settle()  # a re-attach finished: the next step serves again
        elif batch.urgent() or res.needs_refill(want) or (batch and (
                self._flush or not self._live or 0 <= self._held <= self._step - LAZY_STEPS)):
            self._send(batch, want)
        else:
            # Commits, releases and lookup reports wait for the next message that must go
            # out (pins, claims, finds), LAZY_STEPS at most: every message wakes ZMQ's I/O
            # thread and the daemon, which on a busy host is time the scheduler thread loses.
            if batch and self._held < 0:
                self._held = self._step
            self.session.end_idle()
        self._busy = False
        self._step += 1

    def _send(self, batch: _Batch, want: int) -> None:
        self._batch, self._flush, self._held = _Batch(), False, -1
        block = self.geometry.groups[0].tokens_per_block
        lookups = [r if isinstance(r, p.LookupReport) else lookup_report(block, *r)
                   for r in batch.lookups]
        unreserve = [p.SlotRef(b"", *ref) for ref in self.reservation.surplus()]

        def build(rid: int, engine: int, epoch: int) -> p.Step:
            return batch.step(rid, engine, epoch, unreserve, want, lookups)

        # sync: the next step's first read waits (sync_ms at most) for a refill it may need (a
        # deferred store, fewer slots left than a step's demand); claims are waited for only
        # by a lookup that wants them (_wait_claims).
        sync = bool(self._deferred) or self.reservation.low()
        rid = self.session.send(build, end_of_step=True, sync=sync)
        if rid is not None:  # else the session is lost, and with it what was granted
            self.reservation.sent(rid, want)
            if batch.claims:
                self.own.sent(rid, [c.item.key for c in batch.claims])

    def has_pending_work(self) -> bool:
        # vLLM asks only once no request is left: then whatever waits goes out next step.
        if self._batch:
            self._flush = True
            return True
        return False

    def shutdown(self) -> None:
        self.session.close()
