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
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvoffload.connector.client import DaemonClient, DaemonUnavailable
from kvoffload.connector.vllm.worker import PoolInfo, PoolSlotsSpec
from kvoffload.daemon import protocol as p
from kvoffload.daemon.types import Geometry
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

log = logging.getLogger("kvoffload.connector.vllm")


@dataclass
class RequestInfo:
    """What the manager needs to know about a request, read from vLLM's scheduler state."""

    block_hashes: list[bytes]
    num_tokens: int
    num_prompt_tokens: int
    local_tokens: int
    token_ids: Callable[[int, int], list[int]] | None = None
    lora_name: str | None = None


class RequestSource(Protocol):
    def get(self, req_id: str) -> RequestInfo | None: ...

    def waiting(self) -> Iterable[tuple[str, RequestInfo]]: ...


class RequestWaiter(Protocol):
    """Parks a deferred query on the daemon's futures (``Lookup`` with ``wait_ms``)."""

    def park(self, query: p.LookupQuery) -> Future[Any]: ...

    def close(self) -> None: ...


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
    known_keys: int = 1 << 20  # keys remembered as stored (skips re-offering them)


class DaemonOffloadingManager(OffloadingManager):  # type: ignore[misc]
    def __init__(
        self,
        client: DaemonClient,
        geometry: Geometry,
        settings: ManagerSettings,
        requests: RequestSource | None = None,
        waiter: RequestWaiter | None = None,
        group_ids: list[int] | None = None,
    ) -> None:
        self.client = client
        self.geometry = geometry
        self.settings = settings
        self.requests = requests
        self.waiter = waiter
        self.pool: PoolInfo | None = None
        # vLLM's group ids (the last 4 bytes of a key) -> tokens per chunk of that group.
        self._chunk_tokens = dict(zip(group_ids or range(len(geometry.groups)),
                                      (geometry.tokens_per_chunk(i)
                                       for i in range(len(geometry.groups))), strict=True))
        self._offline_until = 0.0
        self._step = 0
        self._answers: dict[str, _Answer] = {}
        self._probe: dict[bytes, LookupResult] = {}  # fallback: no request info
        self._probe_wanted: set[bytes] = set()
        self._release: list[bytes] = []
        self._commit_ok: list[bytes] = []
        self._commit_fail: list[bytes] = []
        self._granted: set[bytes] = set()  # granted by the daemon, not committed yet
        self._offered: set[bytes] = set()  # offered to prepare_store, store not finished
        self._store_batch: list[tuple[p.StoreItem, PoolSlotsSpec, int]] = []
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._after_reset: tuple[list[bytes], list[bytes]] | None = None
        self.counters: dict[str, int] = dict.fromkeys(
            ("lookup_calls", "lookup_queries", "parked",
             "stores_offered", "stores_granted", "stores_skipped_offline", "stores_refused",
             "pin_fallbacks", "pin_failures", "offline_events", "protocol_errors"), 0)

    # -- daemon access ------------------------------------------------------------

    def connect(self) -> bool:
        """Register now (best effort); otherwise the first lookup or store does."""
        return self._online()

    def _online(self) -> bool:
        """Registered and reachable; (re)registers once the retry interval has passed."""
        if time.monotonic() < self._offline_until:
            return False
        if self.pool is not None:
            return True
        # A fresh socket connects asynchronously and refuses sends until it has: retry for
        # up to one timeout, then stay offline for retry_ms.
        deadline = time.monotonic() + self.settings.timeout_ms / 1000
        while True:
            try:
                self.client.connect()  # a fresh Welcome: the daemon_id workers key pools on
                reg = self.client.register(self.geometry)
                break
            except p.ProtocolError as exc:
                self._went_offline(exc)
                return False
            except DaemonUnavailable as exc:
                if time.monotonic() >= deadline:
                    self._went_offline(exc)
                    return False
                time.sleep(0.01)
        self._adopt(reg)
        return True

    def _adopt(self, reg: p.Registered) -> None:
        welcome = self.client.welcome
        daemon_id = welcome.daemon_id if welcome else ""
        if self.pool is not None and self.pool.daemon_id != daemon_id:
            self._forget_daemon_state()
        pool_bytes = welcome.pool_bytes if welcome else reg.slot_bytes * reg.num_slots
        self.pool = PoolInfo(daemon_id, reg.pool_path, pool_bytes, reg.slot_bytes, reg.rank_bytes)

    def _went_offline(self, exc: Exception) -> None:
        if self._offline_until <= time.monotonic():
            log.warning("kvoffload daemon unavailable (%s); lookups miss for %d ms",
                        exc, self.settings.retry_ms)
        self.counters["offline_events"] += 1
        self._offline_until = time.monotonic() + self.settings.retry_ms / 1000
        # A restarted daemon knows none of our pins or grants; a slow one drops them at
        # lease expiry. Either way they are not ours to release any more.
        self._forget_daemon_state()
        self.pool = None

    def _forget_daemon_state(self) -> None:
        self._release.clear()
        self._commit_ok.clear()
        self._commit_fail.clear()
        self._granted.clear()
        self._known.clear()
        for ans in self._answers.values():
            ans.pins.clear()
        self._answers.clear()
        self._probe.clear()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run one client call; None when the daemon is gone (then the manager is offline)."""
        try:
            result = fn()
        except DaemonUnavailable as exc:
            self._went_offline(exc)
            return None
        except p.ProtocolError as exc:
            self.counters["protocol_errors"] += 1
            log.error("kvoffload daemon refused a call: %s", exc)
            return None
        reg = self.client.registered
        if reg is not None and self.client.welcome is not None and self.pool is not None \
                and self.client.welcome.daemon_id != self.pool.daemon_id:
            self._adopt(reg)  # the client re-registered with a restarted daemon
        return result

    def _remember(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._known[key] = None
            self._known.move_to_end(key)
        while len(self._known) > self.settings.known_keys:
            self._known.popitem(last=False)

    # -- lookups --------------------------------------------------------------------

    def _query(self, req_id: str, info: RequestInfo) -> p.LookupQuery:
        return p.LookupQuery(req_id=req_id, block_hashes=info.block_hashes,
                             num_tokens=info.num_tokens, num_prompt_tokens=info.num_prompt_tokens,
                             local_tokens=info.local_tokens)

    def _usable(self, ans: _Answer | None, info: RequestInfo) -> bool:
        if ans is None or ans.num_hashes != len(info.block_hashes):
            return False
        if ans.parked is not None:
            return not ans.parked.done()  # still waiting on the daemon's future: no call
        # The daemon's probe covers vLLM's scan for any local prefix up to its boundary.
        return ans.step == self._step and ans.local_tokens <= info.local_tokens <= ans.boundary

    def _answer_for(self, ctx: ReqContext) -> _Answer | None:
        info = self.requests.get(ctx.req_id) if self.requests else None
        if info is None:
            return None
        ans = self._answers.get(ctx.req_id)
        if self._usable(ans, info):
            return ans
        if not self._online():
            return None
        queries = {ctx.req_id: self._query(ctx.req_id, info)}
        if self.settings.prefetch and self.requests is not None:
            for rid, other in self.requests.waiting():
                if rid not in queries and not self._usable(self._answers.get(rid), other):
                    queries[rid] = self._query(rid, other)
        self._flush_commits()  # our finished stores must be readable before we ask
        answers = self._call(lambda: self.client.lookup(list(queries.values()), pin=True))
        if answers is None:
            return None
        self.counters["lookup_calls"] += 1
        self.counters["lookup_queries"] += len(answers)
        for query, a in zip(queries.values(), answers, strict=True):
            self._install(query, a)
        return self._answers.get(ctx.req_id)

    def _install(self, query: p.LookupQuery, a: p.LookupAnswer) -> None:
        old = self._answers.pop(query.req_id, None)
        if old is not None:
            self._release.extend(old.pins)
        ans = _Answer(step=self._step, local_tokens=query.local_tokens,
                      num_hashes=len(query.block_hashes),
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
        ans = self._answer_for(req_context)
        if ans is not None:
            return ans.status(key)
        if self.requests is not None and self.requests.get(req_context.req_id) is not None:
            return LookupResult.MISS  # offline
        # Fallback without request data: answer from last step's probe, ask for the rest.
        status = self._probe.get(key)
        if status is None:
            if time.monotonic() < self._offline_until:
                return LookupResult.MISS
            self._probe_wanted.add(key)
            return LookupResult.RETRY
        return status

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
            got = self._call(lambda: self.client.pin_load([keys[i] for i in missing]))
            for i, slot in zip(missing, got or [-1] * len(missing), strict=True):
                slots[i] = slot
            if any(s < 0 for s in slots):
                self.counters["pin_failures"] += 1
                log.error("request %s: %d keys to load are gone from the daemon",
                          req_context.req_id, sum(s < 0 for s in slots))
        if ans is not None:
            self._release.extend(ans.pins)  # pinned by the lookup, not loaded
            ans.pins.clear()
        return PoolSlotsSpec(slots, self.pool)

    def complete_load(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        self._release.extend(keys)

    # -- stores ---------------------------------------------------------------------

    def _store_item(self, key: OffloadKey, ctx: ReqContext, info: RequestInfo | None) -> p.StoreItem:
        end = ctx.get_offload_key_position(key) or 0
        block = self._chunk_tokens.get(int.from_bytes(key[-4:], "big"), 1)
        tail = end % block != 0
        if info is None or end == 0:
            return p.StoreItem(key=key, end_token=end, tail=tail)
        start = (end // block) * block if tail else end - block
        tph = self.geometry.tokens_per_hash
        return p.StoreItem(
            key=key, end_token=end, tail=tail,
            token_ids=info.token_ids(start, end) if info.token_ids else None,
            block_hashes=info.block_hashes[start // tph:end // tph],
            parent_hash=info.block_hashes[start // tph - 1] if start else None,
            lora_name=info.lora_name)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        new = [k for k in keys if k not in self._known and k not in self._offered]
        if not new:
            return PrepareStoreOutput(keys_to_store=[], store_spec=PoolSlotsSpec([], None),
                                      evicted_keys=[])
        if not self._online():
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
        grant = self._call(lambda: self.client.prepare_store([item for item, _, _ in batch]))
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
            if self._call(lambda: self.client.commit_store(batch, ok=ok)) is None:  # noqa: B023
                continue
            if ok:
                self._remember(batch)
                self._unpark(set(batch))

    def _unpark(self, committed: set[bytes]) -> None:
        """A request waiting for keys this engine just committed can ask again at once."""
        for ans in self._answers.values():
            if ans.parked is not None and not ans.pending.isdisjoint(committed):
                ans.parked.cancel()
                ans.parked = None
                ans.step = -1

    def _flush_releases(self) -> None:
        if self._release:
            batch, self._release = self._release, []
            self._call(lambda: self.client.complete_load(batch))

    def _flush_probes(self) -> None:
        self._probe.clear()
        wanted, self._probe_wanted = list(self._probe_wanted), set()
        if not wanted or not self._online():
            return
        statuses = self._call(lambda: self.client.probe(wanted))
        for key, st in zip(wanted, statuses or [], strict=False):
            self._probe[key] = LookupResult[st.name]

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
        if self.pool is not None and time.monotonic() >= self._offline_until:
            self._flush_commits()
            self._flush_releases()
            self._flush_stores()
        else:
            self._store_batch.clear()
        self._flush_probes()
        self._step += 1

    def has_pending_work(self) -> bool:
        # Keep the engine stepping until our batched commits and releases reached the daemon.
        return bool(self._commit_ok or self._commit_fail or self._release)

    def reset_cache(self) -> None:
        # Workers may still read pinned slots and write granted ones until on_reset_flushed.
        pins = [k for a in self._answers.values() for k in a.pins] + self._release
        self._after_reset = (pins, list(self._granted) + self._commit_ok + self._commit_fail)
        self._answers.clear()
        self._release, self._commit_ok, self._commit_fail = [], [], []
        self._granted.clear()
        self._offered.clear()
        self._known.clear()
        if self.settings.reset_daemon and self._online():
            self._call(self.client.reset)

    def on_reset_flushed(self) -> None:
        if self._after_reset is None:
            return
        pins, grants = self._after_reset
        self._after_reset = None
        if self.pool is None:
            return
        if pins:
            self._call(lambda: self.client.complete_load(pins))
        if grants:
            self._call(lambda: self.client.commit_store(grants, ok=False))

    def shutdown(self) -> None:
        if self.pool is not None:
            self._flush_commits()
            self._flush_releases()
        if self.waiter is not None:
            self.waiter.close()
        self.client.close()
