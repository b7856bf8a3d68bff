"""Scheduler side of the plugin: vLLM's ``OffloadingManager`` answered by the kvoffload daemon.

vLLM's scheduler asks its manager one key at a time (``lookup``), often ~50-200 keys for one
request, and one daemon round trip costs about as much as vLLM's whole in-process lookup of a
32k-token prompt (``shared/spec/measured-here.md``). So the manager never asks the daemon per key:

* The first ``lookup`` of a request in a step sends ONE ``Lookup`` (``pin=True``) carrying that
  request and every other waiting request the scheduler tracks (their answers are reused if the
  scheduler reaches them in the same step). Each answer lists the keys the daemon's lookup (the
  same algorithm as vLLM 0.33's ``_lookup``) probed: ``hit_keys`` answer HIT, ``pending_keys``
  HIT_PENDING, anything else MISS. vLLM then re-derives the same hit from those answers.
* The keys of the hit are pinned by that same ``Lookup``; ``prepare_load`` hands their slots to
  the workers, ``complete_load`` releases them. Pins are what make a load never fail.
* ``prepare_store`` decides locally which keys to store and returns a spec whose slots are
  filled by one batched ``PrepareStore`` in ``on_schedule_end`` -- still before vLLM ships the
  step's metadata to the workers. Commits and pin releases are batched the same way.
* A request whose answer is pending is parked on a daemon future (``request_waiter``): no round
  trip is spent on it until the daemon resolves the future or this engine commits a key it
  waits for.
* ``DaemonUnavailable`` turns the manager offline for ``retry_ms``: lookups answer MISS, stores
  are skipped and counted, no call is made. The engine is never blocked longer than one
  ``timeout_ms`` per retry interval.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffload.connector.vllm.worker import PoolSlotsSpec
from kvoffload.daemon import protocol as p
from kvoffload.daemon.types import Geometry, PackedHashes
from vllm.v1.kv_offload.base import (  # type: ignore[import-untyped]
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

if TYPE_CHECKING:
    from kvoffload.connector.vllm.connector import (
        DaemonLink,
        RequestInfo,
        RequestSource,
        RequestWaiter,
    )

log = logging.getLogger("kvoffload.connector.vllm")

_PROBE_STEPS = 4  # fallback probe answers stay valid this many steps
_NO_INFO = object()  # no vLLM request state for a request: the per-key probe fallback


@dataclass
class _Answer:
    step: int
    local_tokens: int
    num_hashes: int
    boundary: int  # local + complete-chunk hit: answers stay exact for local tokens up to it
    hit: set[bytes]
    pending: set[bytes]
    pins: dict[bytes, int] = field(default_factory=dict)  # pinned load key -> slot
    parked: Future[Any] | None = None

    def status(self, key: bytes) -> LookupResult:
        if key in self.hit:
            return LookupResult.HIT
        if key in self.pending:
            return LookupResult.HIT_PENDING
        return LookupResult.MISS


@dataclass(frozen=True)
class ManagerSettings:
    timeout_ms: int = 500
    retry_ms: int = 1000
    wait_ms: int = 5000  # how long a parked lookup waits on the daemon's futures
    prefetch: bool = True  # batch the waiting requests into the step's one Lookup
    prefetch_max: int = 16  # at most this many other requests per Lookup
    policy: str = "request"  # "request" (fixes the vLLM 0.33 tail gap) or "chunk"
    reset_daemon: bool = True  # forward vLLM's reset_cache to the daemon (this namespace)
    known_keys: int = 1 << 16  # keys remembered as stored (not offered again)
    # (prefill tokens/s, copy bytes/s): the daemon's cost-aware tails; None = off.
    time_model: tuple[float, float] | None = None


class DaemonOffloadingManager(OffloadingManager):  # type: ignore[misc]
    def __init__(
        self,
        link: DaemonLink,
        geometry: Geometry,
        settings: ManagerSettings,
        requests: RequestSource | None = None,
        waiter: RequestWaiter | None = None,
        group_ids: list[int] | None = None,
    ) -> None:
        self.link = link
        self.client = link.client
        self.geometry = geometry
        self.settings = settings
        self.requests = requests
        self.waiter = waiter
        link.on_lost = self._forget_daemon_state
        # vLLM's group ids (the last 4 bytes of a key) -> tokens per chunk of that group.
        self._chunk_tokens = dict(zip(group_ids or range(len(geometry.groups)),
                                      (geometry.tokens_per_chunk(i)
                                       for i in range(len(geometry.groups))), strict=True))
        self._step = 0
        self._answers: dict[str, _Answer] = {}
        self._memo: dict[str, _Answer | None] = {}  # this step's answer per request
        self._probe: dict[bytes, tuple[LookupResult, int]] = {}  # fallback: key -> (st, step)
        self._probe_wanted: set[bytes] = set()
        self._release: list[bytes] = []
        self._commit_ok: list[bytes] = []
        self._commit_fail: list[bytes] = []
        self._granted: set[bytes] = set()  # granted by the daemon, not committed yet
        self._loading: Counter[bytes] = Counter()  # pinned keys of loads in flight
        self._offered: set[bytes] = set()  # offered to prepare_store, store not finished
        self._store_batch: list[tuple[p.StoreItem, PoolSlotsSpec, int]] = []
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._after_reset: tuple[list[bytes], list[bytes]] | None = None
        self.counters = link.counters
        self.counters.update(dict.fromkeys(
            ("lookup_calls", "lookup_queries", "parked", "stores_offered", "stores_granted",
             "stores_skipped_offline", "stores_refused", "pin_fallbacks", "pin_failures"), 0))

    # -- daemon access (DaemonLink: registration, offline window, restarts) ----------

    def connect(self) -> bool:
        """Register now (best effort); otherwise the first lookup or store does."""
        return self.link.online()

    @property
    def pool(self) -> Any:
        return self.link.pool

    def _forget_daemon_state(self) -> None:
        """The daemon restarted or is gone: none of our pins, grants or answers hold."""
        self._release.clear()
        self._commit_ok.clear()
        self._commit_fail.clear()
        self._granted.clear()
        self._loading.clear()
        self._known.clear()
        for ans in self._answers.values():
            if ans.parked is not None:
                ans.parked.cancel()
        self._answers.clear()
        self._memo.clear()
        self._probe.clear()

    def _remember(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._known[key] = None
            self._known.move_to_end(key)
        while len(self._known) > self.settings.known_keys:
            self._known.popitem(last=False)

    # -- lookups --------------------------------------------------------------------

    def _query(self, req_id: str, info: RequestInfo) -> p.LookupQuery:
        # Packed hashes cross the wire and decode in constant time (thousands per prompt).
        try:
            packed = PackedHashes.pack(info.block_hashes)
        except ValueError:  # mixed lengths (never with vLLM's hashes): send them one by one
            return p.LookupQuery(req_id=req_id, block_hashes=list(info.block_hashes),
                                 num_tokens=info.num_tokens,
                                 num_prompt_tokens=info.num_prompt_tokens,
                                 local_tokens=info.local_tokens)
        return p.LookupQuery(req_id=req_id, hash_blob=packed.blob, hash_bytes=packed.width,
                             num_tokens=info.num_tokens, num_prompt_tokens=info.num_prompt_tokens,
                             local_tokens=info.local_tokens)

    def _usable(self, ans: _Answer | None, info: RequestInfo) -> bool:
        if ans is None or ans.num_hashes != len(info.block_hashes):
            return False
        if ans.parked is not None:  # waiting on the daemon's future: no call until it fires
            return not ans.parked.done() and ans.local_tokens == info.local_tokens
        # The daemon's probe covers vLLM's scan for any local prefix up to its boundary.
        return ans.step == self._step and ans.local_tokens <= info.local_tokens <= ans.boundary

    def _answer_for(self, ctx: ReqContext) -> _Answer | None | object:
        """The request's answer; None when offline; _NO_INFO without vLLM's request state."""
        info = self.requests.get(ctx.req_id) if self.requests else None
        if info is None:
            return _NO_INFO
        ans = self._answers.get(ctx.req_id)
        if ans is not None and ans.parked is not None and not ans.pending.isdisjoint(
                self._commit_ok):
            self._flush_commits()  # it waits for keys we finished writing: unparks it
        if self._usable(ans, info):
            return ans
        if not self.link.online():
            return None
        queries = {ctx.req_id: self._query(ctx.req_id, info)}
        if self.settings.prefetch and self.requests is not None:
            for rid, other in self.requests.waiting():
                if rid not in queries and not self._usable(self._answers.get(rid), other):
                    queries[rid] = self._query(rid, other)
        self._flush_commits()  # our finished stores must be readable before we ask
        answers = self.link.call(lambda: self.client.lookup(list(queries.values()), pin=True))
        if answers is None:
            return None
        self.counters["lookup_calls"] += 1
        self.counters["lookup_queries"] += len(answers)
        for query, a in zip(queries.values(), answers, strict=True):
            self._install(query, a)
        return self._answers.get(ctx.req_id)

    def _install(self, query: p.LookupQuery, a: p.LookupAnswer) -> None:
        self._memo.pop(query.req_id, None)
        old = self._answers.pop(query.req_id, None)
        if old is not None:
            self._release.extend(old.pins)
            if old.parked is not None:
                old.parked.cancel()
        ans = _Answer(step=self._step, local_tokens=query.local_tokens,
                      num_hashes=len(query.hashes()),
                      boundary=query.local_tokens + a.chunk_tokens,
                      hit=set(a.hit_keys), pending=set(a.pending_keys),
                      pins=dict(zip(a.load_keys, a.slots, strict=False)))
        self._remember(a.hit_keys)
        if a.hit_tokens is None and self.waiter is not None:
            # Deferred: wait on the daemon's futures instead of asking again every step.
            ans.parked = self.waiter.park(query)
            self.counters["parked"] += 1
        self._answers[query.req_id] = ans

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        # vLLM calls this once per key (hundreds per request): after the first call of a
        # step, answer from the memo without touching vLLM's request state again.
        ans = self._memo.get(req_context.req_id, _NO_INFO)
        if ans is _NO_INFO:
            ans = self._answer_for(req_context)
            if ans is None or isinstance(ans, _Answer):
                self._memo[req_context.req_id] = ans
        if isinstance(ans, _Answer):
            return ans.status(key)
        if ans is None:
            return LookupResult.MISS  # offline
        # Fallback without request data: answer from recent probes, ask for the rest at the
        # end of the step (RETRY keeps vLLM scanning, so one step collects many keys).
        probed = self._probe.get(key)
        if probed is not None and probed[1] >= self._step - _PROBE_STEPS:
            return probed[0]
        if self.link.offline:
            return LookupResult.MISS
        self._probe_wanted.add(key)
        return LookupResult.RETRY

    def touch(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        return  # the daemon's policy sees every lookup and load; no extra round trip

    # -- loads ----------------------------------------------------------------------

    def prepare_load(self, keys: Collection[bytes], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        ans = self._answers.get(req_context.req_id)
        pins = ans.pins if ans is not None else {}
        slots = [pins.pop(k, -1) for k in keys]
        missing = [i for i, s in enumerate(slots) if s < 0]
        if missing:
            # vLLM chose keys the daemon did not pin (a cap the daemon does not know): pin now.
            self.counters["pin_fallbacks"] += 1
            got = self.link.call(lambda: self.client.pin_load([keys[i] for i in missing]))
            for i, slot in zip(missing, got or [-1] * len(missing), strict=True):
                slots[i] = slot
            if any(s < 0 for s in slots):
                self.counters["pin_failures"] += 1
                log.error("request %s: %d keys to load are gone from the daemon",
                          req_context.req_id, sum(s < 0 for s in slots))
        if ans is not None:
            self._release.extend(ans.pins)  # pinned by the lookup, not loaded
            ans.pins.clear()
        self._loading.update(k for k, s in zip(keys, slots, strict=True) if s >= 0)
        return PoolSlotsSpec(slots, self.pool)

    def complete_load(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        for key in keys:
            if self._loading[key] > 0:  # pins of an older daemon are not ours to release
                self._loading[key] -= 1
                self._release.append(key)

    # -- stores ---------------------------------------------------------------------

    def _store_item(self, key: OffloadKey, ctx: ReqContext,
                    info: RequestInfo | None) -> p.StoreItem:
        end = ctx.get_offload_key_position(key) or 0
        block = self._chunk_tokens.get(int.from_bytes(key[-4:], "big"), 1)
        if info is None or end == 0:
            return p.StoreItem(key=key, end_token=end, tail=end % block != 0)
        return info.store_item(key, end, block, self.geometry.tokens_per_hash)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        new = [k for k in keys if k not in self._known and k not in self._offered]
        if not new:
            return PrepareStoreOutput(keys_to_store=[], store_spec=PoolSlotsSpec([], None),
                                      evicted_keys=[])
        if not self.link.online():
            # Skip (not None): vLLM would re-offer the chunks every step and log each time.
            self.counters["stores_skipped_offline"] += len(new)
            return PrepareStoreOutput(keys_to_store=[], store_spec=PoolSlotsSpec([], None),
                                      evicted_keys=[])
        info = self.requests.get(req_context.req_id) if self.requests else None
        spec = PoolSlotsSpec([-1] * len(new), None)  # slots filled in on_schedule_end
        for i, key in enumerate(new):
            self._store_batch.append((self._store_item(key, req_context, info), spec, i))
            self._offered.add(key)
        self.counters["stores_offered"] += len(new)
        return PrepareStoreOutput(keys_to_store=new, store_spec=spec, evicted_keys=[])

    def complete_store(
        self, keys: Collection[bytes], req_context: ReqContext, success: bool = True
    ) -> None:
        for key in keys:
            self._offered.discard(key)
            if key in self._granted:
                self._granted.discard(key)
                (self._commit_ok if success else self._commit_fail).append(key)

    def _flush_stores(self) -> None:
        batch, self._store_batch = self._store_batch, []
        if not batch:
            return
        grant = self.link.call(lambda: self.client.prepare_store([item for item, _, _ in batch]))
        if grant is None:
            self.counters["stores_skipped_offline"] += len(batch)
            return  # slots stay -1: workers copy nothing, complete_store commits nothing
        for (item, spec, i), outcome, slot in zip(batch, grant.outcomes, grant.slots,
                                                  strict=True):
            spec.pool = self.pool
            if outcome == p.StoreOutcome.GRANTED:
                spec.slots[i] = slot
                self._granted.add(item.key)
                self.counters["stores_granted"] += 1
            elif outcome == p.StoreOutcome.EXISTS:
                self._remember([item.key])
            else:
                self.counters["stores_refused"] += 1
        for key in grant.evicted:
            self._known.pop(key, None)

    def _flush_commits(self) -> None:
        for ok, keys in ((True, self._commit_ok), (False, self._commit_fail)):
            if not keys:
                continue
            batch = list(keys)
            keys.clear()
            if self.link.call(lambda: self.client.commit_store(batch, ok=ok)) is None:  # noqa: B023
                continue
            if ok:
                self._remember(batch)
                self._unpark(set(batch))

    def _unpark(self, committed: set[bytes]) -> None:
        """A request waiting for keys this engine just committed can ask again at once."""
        for req_id, ans in self._answers.items():
            if ans.parked is not None and not ans.pending.isdisjoint(committed):
                ans.parked.cancel()
                ans.parked = None
                ans.step = -1
                self._memo.pop(req_id, None)

    def _flush_releases(self) -> None:
        if self._release:
            batch, self._release = self._release, []
            self.link.call(lambda: self.client.complete_load(batch))

    def _flush_probes(self) -> None:
        wanted, self._probe_wanted = list(self._probe_wanted), set()
        self._probe = {k: v for k, v in self._probe.items() if v[1] >= self._step - _PROBE_STEPS}
        if not wanted or not self.link.online():
            return
        statuses = self.link.call(lambda: self.client.probe(wanted))
        for key, st in zip(wanted, statuses or [], strict=False):
            self._probe[key] = (LookupResult[st.name], self._step)

    # -- lifecycle --------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        # REQUEST_LEVEL: every chunk is offered, prefix hits included, so the block a partial
        # tail only half loaded is stored once the request fills it (the vLLM 0.33 gap).
        policy = (OffloadPolicy.REQUEST_LEVEL if self.settings.policy == "request"
                  else OffloadPolicy.CHUNK_LEVEL)
        return RequestOffloadingContext(policy=policy)

    def on_request_finished(self, req_context: ReqContext) -> None:
        ans = self._answers.pop(req_context.req_id, None)
        if ans is not None:
            self._release.extend(ans.pins)
            if ans.parked is not None:
                ans.parked.cancel()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self.pool is not None and not self.link.offline:
            self._flush_commits()
            self._flush_releases()
            self._flush_stores()
            # Pins and grants live as long as our lease: keep it alive while we hold any.
            if self._granted or +self._loading or any(a.pins for a in self._answers.values()):
                self.link.keep_alive()
        else:
            self._store_batch.clear()
        self._flush_probes()
        self._memo.clear()
        self._step += 1

    def has_pending_work(self) -> bool:
        # Keep the engine stepping until our batched commits and releases reached the daemon.
        return bool(self._commit_ok or self._commit_fail or self._release)

    def reset_cache(self) -> None:
        # Workers may still read pinned slots and write granted ones until on_reset_flushed.
        pins = [k for a in self._answers.values() for k in a.pins] + self._release
        pins += list(self._loading.elements())
        self._loading.clear()
        self._after_reset = (pins, list(self._granted) + self._commit_ok + self._commit_fail)
        self._answers.clear()
        self._release, self._commit_ok, self._commit_fail = [], [], []
        self._granted.clear()
        self._offered.clear()
        self._known.clear()
        if self.settings.reset_daemon and self.link.online():
            self.link.call(self.client.reset)

    def on_reset_flushed(self) -> None:
        if self._after_reset is None:
            return
        pins, grants = self._after_reset
        self._after_reset = None
        if self.pool is None:
            return
        if pins:
            self.link.call(lambda: self.client.complete_load(pins))
        if grants:
            self.link.call(lambda: self.client.commit_store(grants, ok=False))

    def shutdown(self) -> None:
        if self.pool is not None:
            self._flush_commits()
            self._flush_releases()
        if self.waiter is not None:
            self.waiter.close()
        self.link.close()
