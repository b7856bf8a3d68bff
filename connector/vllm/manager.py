"""Scheduler side of the plugin: vLLM's ``OffloadingManager`` over the daemon's shared index.

vLLM's scheduler asks ``lookup(key)`` dozens of times per request and runs its own scan over
the answers (complete chunks, partial tails, EAGLE margins, ``max_load_tokens``, ...). Every
answer here is a dict lookup in ``IndexView`` -- the daemon's index as this engine last read it
-- so vLLM's scan runs unchanged over true per-key states and costs what it costs over vLLM's
own manager. No message is sent on the lookup path:

* the first call of a scheduler step refreshes the view (one integer read when nothing
  changed) and reads the replies of earlier steps; ``on_schedule_end`` sends the step's one
  ``Step`` message without waiting: the pins of this step's loads, releases of finished loads,
  store claims, lower-tier finds, per-request lookup reports, a reservation refill;
* ``prepare_load`` hands the workers each key's (slot, generation) as read; the daemon pins
  them on arrival, and epoch-based reclamation (``daemon/store/reclaim.py``) keeps a slot's bytes
  until then. A slot that went to another writer fails its generation check in the worker, and
  the load is reported (never used);
* ``prepare_store`` takes slots from a reservation the daemon granted in advance, so it never
  waits; "already stored" is read from the view, never from a private memory that goes stale;
  commits are sent the moment vLLM reports the store done, so they are readable next step;
* a key missing from the pool answers RETRY when the daemon has a disk or Mooncake tier, and
  the step's ``finds`` ask the tier; a promotion shows in the index as PENDING, then READY;
* when the daemon is down, frozen or restarted, lookups answer MISS and nothing is stored
  (``IndexSession`` decides, without a message), and the session re-attaches by itself.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection
from typing import Any

from kvoffload.connector.session import IndexSession
from kvoffload.connector.vllm.load_spec import PoolInfo, PoolSlotsSpec
from kvoffload.connector.vllm.requests import RequestInfo, store_item
from kvoffload.connector.vllm.settings import ManagerSettings
from kvoffload.daemon.base import Geometry, key_group
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

HIT, MISS, PENDING, RETRY = (LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING,
                             LookupResult.RETRY)


def _empty_store() -> PrepareStoreOutput:
    return PrepareStoreOutput(keys_to_store=[], store_spec=PoolSlotsSpec([], None),
                              evicted_keys=[])


class DaemonOffloadingManager(OffloadingManager):
    def __init__(self, session: IndexSession, geometry: Geometry,
                 settings: ManagerSettings) -> None:
        self.session = session
        self.geometry = geometry
        self.settings = settings
        session.on_lost = self._drop_daemon_state
        session.reserve = settings.reserve  # the attach thread's first reservation
        self._block = {geometry.group_id(i): g.tokens_per_block * geometry.blocks_per_chunk
                       for i, g in enumerate(geometry.groups)}
        self.requests: dict[str, RequestInfo] = {}  # handed over by KVOffloadConnector
        self.counters: Counter[str] = Counter()
        self._step = 0
        self._busy = False
        self._tiers = False
        self._pool: PoolInfo | None = None
        # Written by this engine, not yet READY in the view: key -> (slot, gen).
        self._storing: dict[bytes, tuple[int, int]] = {}
        self._reserved: list[tuple[int, int]] = []
        self._reserve_asked = 0
        self._reserve_rids: dict[int, int] = {}  # rid -> slots it asked for
        self._no_space = False
        self._claim_rids: dict[int, list[bytes]] = {}
        self._dupes: set[bytes] = set()  # claims of keys stored meanwhile: slot still ours
        self._committed: dict[bytes, int] = {}  # commit sent -> step it was sent
        self._loads: dict[str, list[p.SlotRef]] = {}  # req -> pins of its load in flight
        self._finding: set[bytes] = set()
        self._not_found: dict[bytes, int] = {}  # key -> step it was not found
        self._after_reset: tuple[list[p.SlotRef], list[p.SlotRef]] | None = None
        self._batch = _Batch()
        self._ready: dict[bytes, tuple[int, int]] = {}
        self._not_worth: set[bytes] = set()

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
        replies = self.session.begin()
        view = self.session.view
        # The view's own containers, bound for this step (empty ones when offline).
        self._ready = view.ready if view is not None else {}
        self._not_worth = view.not_worth if view is not None else set()
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
        view = self.session.view
        if view is not None and self._committed:
            # Our commits the view shows READY now, or that it will never show (the block was
            # evicted at once, or the commit refused): the view answers for them from here.
            for key, step in list(self._committed.items()):
                if key in view.ready or (step < self._step - 1 and key not in view.pending):
                    del self._committed[key]
                    self._storing.pop(key, None)

    def _absorb(self, r: p.StepReply) -> None:
        self._reserved.extend(r.granted)
        asked = self._reserve_rids.pop(r.rid, 0)
        self._reserve_asked -= asked
        if asked:
            self._no_space = r.no_space
        claimed = set(self._claim_rids.pop(r.rid, ()))
        for key in r.exists:  # stored meanwhile by another engine: our slot stays reserved
            if key in claimed and key in self._storing:
                self.counters["stores_exist"] += 1
                if self._committed.pop(key, None) is not None:  # its worker is done: reuse
                    self._reserved.append(self._storing.pop(key))
                else:
                    self._dupes.add(key)  # reused once its worker is done (complete_store)
        for key in r.refused:  # not our slot any more (our lease ran out): forget it
            if key in claimed:
                self.counters["stores_refused"] += 1
                self._storing.pop(key, None)
                self._committed.pop(key, None)
                self._dupes.discard(key)
        if r.lost:
            self.counters["pins_lost"] += len(r.lost)
            log.warning("kvoffload: %d loads lost their slot before the daemon pinned them; "
                        "the workers report them as failed", len(r.lost))
        self._finding.difference_update(r.found)
        for key in r.not_found:
            self._finding.discard(key)
            self._not_found[key] = self._step

    def _drop_daemon_state(self) -> None:
        """The daemon went away: nothing it granted is ours any more."""
        self._reserved.clear()
        self._reserve_asked = 0
        self._reserve_rids.clear()
        self._storing.clear()
        self._committed.clear()
        self._dupes.clear()
        self._claim_rids.clear()
        self._finding.clear()
        self._not_found.clear()
        self._loads.clear()
        self._batch = _Batch()

    # -- lookups ------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # The hot path: vLLM calls this ~50-80 times per long request. One dict probe for a
        # hit, everything else only on the way to a miss.
        if not self._busy:
            self._begin()
        if key in self._ready:
            if self._not_worth and key in self._not_worth:  # its load cannot repay its bytes
                self.counters["tails_declined"] += 1
                return MISS
            return HIT
        view = self.session.view
        if view is None:
            return MISS  # offline: vLLM computes, nothing waits
        if key in self._committed and view.slot_of(key) == self._storing[key][0]:
            # Our own store, committed: the daemon holds it PENDING in our slot and takes our
            # commit before any pin we send after it (one socket, in order).
            return HIT
        if key in view.pending or key in self._storing:
            return PENDING
        if self._tiers:
            seen = self._not_found.get(key)
            if seen is None or self._step - seen > self.settings.find_ttl_steps:
                if key not in self._finding:
                    self._finding.add(key)
                    self._batch.finds.append(key)
                return RETRY  # the scan goes on; asked again next step
        return MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return  # loads make blocks most recently used in the daemon; no message for this

    # -- loads --------------------------------------------------------------------------

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext
                     ) -> LoadStoreSpec:
        view = self.session.view
        slots, gens, refs = [], [], []
        for key in keys:
            ref = view.ready.get(key) if view is not None else None
            if ref is None and key in self._committed:
                own = self._storing.get(key)  # our own committed store (see lookup)
                ref = (own[0], si.ident(own[1], key)) if own is not None else None
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
        new = [k for k in keys if k not in view.ready and k not in view.pending
               and k not in self._storing]
        if not new:
            return _empty_store()
        room = len(self._reserved)
        if room < len(new):
            self.counters["stores_short_reservation"] += len(new) - room
            new = new[:room]  # vLLM lists keys in prefix order: the longest prefix goes
            if not new:
                return _empty_store()
        info = self.requests.get(req_context.req_id)
        tph = self.geometry.tokens_per_hash
        slots, gens = [], []
        for key in new:
            slot, gen = self._reserved.pop()
            item = store_item(key, req_context.get_offload_key_position(key),
                              self._block.get(key_group(key), 1), tph, info)
            self._batch.claims.append(p.StoreClaim(item=item, slot=slot, gen=gen))
            self._storing[key] = (slot, gen)
            slots.append(slot)
            gens.append(gen)
        self.counters["stores_offered"] += len(new)
        lock = self.session.reg.readers_path if self.session.reg is not None else ""
        return PrepareStoreOutput(keys_to_store=new,
                                  store_spec=PoolSlotsSpec(slots, self._pool, gens, lock=lock),
                                  evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        commits, aborts = [], []
        for key in keys:
            ref = self._storing.get(key)
            if ref is None:
                continue
            if key in self._dupes:  # the daemon kept the slot reserved for us: reuse it
                self._dupes.discard(key)
                del self._storing[key]
                self._reserved.append(ref)
            elif success:
                commits.append(p.SlotRef(key, *ref))  # stays in _storing until READY
                self._committed[key] = self._step
            else:
                del self._storing[key]
                aborts.append(p.SlotRef(key, *ref))
        if commits or aborts:
            # Now, not at the step's end: the next step's view then already reads them READY.
            self.session.send(lambda rid, engine, epoch: p.Step(
                rid=rid, engine=engine, epoch=epoch, commits=commits, aborts=aborts),
                end_of_step=not self._busy, sync=True)
            self.counters["stores_committed"] += len(commits)

    # -- lifecycle ----------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        # REQUEST_LEVEL: every chunk is offered, prefix hits included, so the block a partial
        # tail only half loaded is stored once the request fills it (the vLLM 0.33 gap).
        policy = (OffloadPolicy.REQUEST_LEVEL if self.settings.policy == "request"
                  else OffloadPolicy.CHUNK_LEVEL)
        return RequestOffloadingContext(policy=policy)

    def track(self, request: Any) -> None:
        """A request vLLM's connector saw (``KVOffloadConnector``): its tokens for events."""
        self.requests[request.request_id] = RequestInfo.of(request)

    def report_lookup(self, report: Any) -> None:
        """A request's outcome (a ``LookupReport``, or the arguments of one built later)."""
        self._batch.lookups.append(report)

    def _report(self, req_id: str, num_tokens: int, num_prompt: int, local: int,
                hit: int | None, seconds: float) -> p.LookupReport:
        """Built at the step's end, off vLLM's lookup path."""
        block = self.geometry.groups[0].tokens_per_block
        end = local + (hit or 0)
        tail = bool(hit) and end % block != 0
        chunk = max(0, end - end % block - local) if tail else (hit or 0)
        return p.LookupReport(
            req_id=req_id, num_tokens=num_tokens, num_prompt_tokens=num_prompt,
            local_tokens=local, hit_tokens=hit, chunk_tokens=chunk,
            tail_boundary=end if tail else None,
            miss_reason=None if hit else ("pending" if hit is None else "not_stored"),
            latency_us=int(seconds * 1e6))

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.requests.pop(req_context.req_id, None)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        for reply in self.session.poll():  # grants, refusals, finds of earlier steps
            self._absorb(reply)
        batch, self._batch = self._batch, _Batch()
        want = self.settings.reserve - len(self._reserved) - self._reserve_asked
        if self.session.attached and (batch or want > 0):
            reserve = max(0, want)

            lookups = [r if isinstance(r, p.LookupReport) else self._report(*r)
                       for r in batch.lookups]

            def build(rid: int, engine: int, epoch: int) -> p.Step:
                return p.Step(rid=rid, engine=engine, epoch=epoch, pins=batch.pins,
                              releases=batch.releases, claims=batch.claims, reserve=reserve,
                              finds=batch.finds, lookups=lookups)

            rid = self.session.send(build, end_of_step=True, sync=bool(batch.claims))
            if rid is not None:
                self._reserve_asked += reserve
                self._reserve_rids[rid] = reserve
                if batch.claims:
                    self._claim_rids[rid] = [c.item.key for c in batch.claims]
        else:
            self.session.end_idle()
            if not self.session.attached:
                self.session.settle()  # a re-attach finished: the next step serves again
        self._busy = False
        self._step += 1

    def has_pending_work(self) -> bool:
        # Keep the engine stepping while load pins wait to be released.
        return bool(self._batch)

    def reset_cache(self) -> None:
        # Workers may still read pinned slots and write claimed ones until on_reset_flushed.
        pins = [ref for refs in self._loads.values() for ref in refs]
        grants = [p.SlotRef(k, *ref) for k, ref in self._storing.items()]
        self._after_reset = (pins, grants)
        self._loads.clear()
        self._storing.clear()
        self._committed.clear()
        self._dupes.clear()
        scope = self.settings.reset_scope
        if scope != "none":
            self.session.post(lambda rid, engine: p.Reset(rid=rid, engine=engine, scope=scope))

    def on_reset_flushed(self) -> None:
        if self._after_reset is None:
            return
        pins, grants = self._after_reset
        self._after_reset = None
        if pins or grants:
            self.session.send(lambda rid, engine, epoch: p.Step(
                rid=rid, engine=engine, epoch=epoch, releases=pins, aborts=grants),
                end_of_step=not self._busy)

    def shutdown(self) -> None:
        self.session.close()


class _Batch:
    """What one step sends."""

    __slots__ = ("pins", "releases", "claims", "finds", "lookups")

    def __init__(self) -> None:
        self.pins: list[p.SlotRef] = []
        self.releases: list[p.SlotRef] = []
        self.claims: list[p.StoreClaim] = []
        self.finds: list[bytes] = []
        self.lookups: list[p.LookupReport] = []

    def __bool__(self) -> bool:
        return bool(self.pins or self.releases or self.claims or self.finds or self.lookups)
