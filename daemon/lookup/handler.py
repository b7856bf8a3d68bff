"""Lookup handling: many requests per message, futures for pending keys, miss reasons.

Runs the pure lookup (``daemon/lookup/plan.py``) against the index for every query of a ``Lookup``
message, pins the hit's keys for the caller when asked, and, when a key is still being written
and the caller allows a wait, parks on that key's future and answers when it resolves. Every
final answer is counted once and published once as a lookup event.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvoffload.daemon.base import KeyStatus
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.control.errors import MAX_KEY_BYTES, RequestError
from kvoffload.daemon.control.errors import bad_request as _bad
from kvoffload.daemon.control.leases import ClientState, take_pin
from kvoffload.daemon.control.quotas import Quotas
from kvoffload.daemon.lookup import plan as lk
from kvoffload.daemon.ops.metrics import DaemonMetrics
from kvoffload.daemon.store.index import BlockIndex, Namespace
from kvoffload.daemon.streams.publish import DaemonEvents
from kvoffload.daemon.tiers.promote import Promoter

# A parked lookup holds memory and a future: bound how long a client can make it wait.
MAX_WAIT_MS = 60_000
# Hashes one query may carry: 2M tokens at 16 tokens per hash. A query is one unit of work
# (the pure lookup cannot yield); a long one is scanned in a worker thread, tiers or not.
MAX_QUERY_HASHES = 1 << 17
# A message whose queries hold more hashes than this is answered in slices of about this
# many hashes, yielding to the loop in between (other clients, /healthz, timers).
SLICE_HASHES = 16_384
# A query this long is scanned in a worker thread: one query cannot be split, and a
# Mamba-only miss probes every chunk (~5 us each on the loop).
THREAD_HASHES = 8192


@dataclass(slots=True)
class _Scan:
    """What the pure lookup found for one query, before pins and decisions."""

    out: lk.LookupOutcome
    hits: list[bytes]
    pending: list[bytes]
    misses: list[bytes]
    in_tiers: set[bytes]


class LookupHandler:
    def __init__(self, index: BlockIndex, metrics: DaemonMetrics, events: DaemonEvents,
                 totals: Counter[str]) -> None:
        self.index = index
        self.metrics = metrics
        self.events = events
        self.totals = totals
        # daemon/tiers Promoter, when a tier is configured: asked about keys the pool misses.
        self.tiers: Promoter | None = None
        # Whether a client still holds its lease (set by the server): a parked lookup of a
        # client that left takes no pins when its keys commit; nobody would release them.
        self.client_alive: Callable[[ClientState], bool] = lambda client: True
        self.draining = False
        self.quotas: Quotas | None = None  # per-client caps (set by Service)
        self._stop: asyncio.Future[bool] | None = None  # resolved by stop_waiting()

    def _validate_query(self, ns: Namespace, q: p.LookupQuery) -> None:
        tph = ns.geometry.tokens_per_hash
        if not 0 <= q.local_tokens <= q.num_tokens or not 0 <= q.num_prompt_tokens <= q.num_tokens:
            raise _bad(f"request {q.req_id!r}: need 0 <= local_tokens <= num_tokens and "
                       "num_prompt_tokens <= num_tokens")
        if q.hash_bytes or q.hash_blob:
            if q.block_hashes or not 0 < q.hash_bytes <= MAX_KEY_BYTES or \
                    len(q.hash_blob) % q.hash_bytes:
                raise _bad(f"request {q.req_id!r}: hash_blob must hold whole hashes of "
                           f"hash_bytes (1..{MAX_KEY_BYTES}) bytes, without block_hashes")
            n = len(q.hash_blob) // q.hash_bytes
        else:
            n = len(q.block_hashes)
        if n > MAX_QUERY_HASHES:
            self.metrics.refused.labels("query_hashes").inc()
            raise RequestError(p.ErrorCode.TOO_LARGE, f"request {q.req_id!r}: {n} hashes; the "
                               f"limit is {MAX_QUERY_HASHES} per query")
        # min/max over map(len) run in C: per-hash Python checks cost more than the lookup.
        if n and not q.hash_bytes and (min(map(len, q.block_hashes)) == 0 or
                                       max(map(len, q.block_hashes)) > MAX_KEY_BYTES):
            raise _bad(f"request {q.req_id!r}: a block hash is empty or too long")
        if n > q.num_tokens // tph:
            raise _bad(f"request {q.req_id!r}: {n} hashes for {q.num_tokens} tokens at "
                       f"{tph} tokens per hash")

    def _lookup_one(self, client: ClientState, ns: Namespace, q: p.LookupQuery,
                    pin: bool) -> tuple[p.LookupAnswer, list[bytes]]:
        return self._conclude(client, ns, q, self._scan(ns, q), pin)

    def _scan(self, ns: Namespace, q: p.LookupQuery, known: dict[bytes, KeyStatus] | None = None,
              asks: list[bytes] | None = None) -> _Scan:
        """The pure lookup against the index: reads only, so it may run in a worker thread.

        In a thread (``known`` given) the tiers are asked from memory only (``peek_local``);
        a key only the loop can ask about (a shared store) is taken as MISS unless ``known``
        says otherwise, and listed in ``asks`` for the loop to ask."""
        hits: list[bytes] = []
        pending: list[bytes] = []
        misses: list[bytes] = []
        status = self.index.status
        tiers = self.tiers
        in_tiers: set[bytes] = set()

        def tier_peek(key: bytes) -> KeyStatus:
            assert tiers is not None
            if known is None:
                return tiers.peek(ns, key)
            got = known.get(key)
            if got is None:
                got = tiers.peek_local(ns, key)
                if got is KeyStatus.MISS and tiers.asks_remote and asks is not None:
                    asks.append(key)
            return got

        def probe(key: bytes) -> KeyStatus:
            s = status(ns, key)
            if s is KeyStatus.MISS and tiers is not None:
                s = tier_peek(key)  # a tier holds it: HIT_PENDING, promoted below if needed
                if s is KeyStatus.HIT_PENDING:
                    in_tiers.add(key)
            if s is KeyStatus.HIT:
                hits.append(key)
            elif s is KeyStatus.MISS:
                misses.append(key)
            else:
                pending.append(key)
            return s

        hashes = q.hashes()
        try:
            out = lk.lookup(ns.geometry, lk.LookupQuery(hashes, q.num_tokens,
                                                        q.num_prompt_tokens, q.local_tokens),
                            probe)
        except ValueError as exc:  # hashes that cannot cover the request, and the like
            raise _bad(f"request {q.req_id!r}: {exc}") from None
        return _Scan(out, hits, pending, misses, in_tiers)

    async def _scan_off_loop(self, ns: Namespace, q: p.LookupQuery) -> _Scan:
        """Scan in a worker thread; the loop only answers the shared store's questions (the
        few keys no local map knows) and checks the result still holds. A result that keeps
        moving is scanned on the loop once, the way short queries are."""
        known: dict[bytes, KeyStatus] = {}
        for _ in range(3):
            asks: list[bytes] = []
            scan = await asyncio.to_thread(self._scan, ns, q, known, asks)
            changed = False
            if asks:
                assert self.tiers is not None
                for key in asks:
                    known[key] = self.tiers.peek(ns, key)
                    changed = changed or known[key] is not KeyStatus.MISS
            if not changed and self._still_valid(ns, scan):
                return scan
        return self._scan(ns, q)

    def _still_valid(self, ns: Namespace, scan: _Scan) -> bool:
        """A scan made off the loop still holds if every key its hit loads is READY now (a
        key that arrived meanwhile only makes the answer shorter than it could be)."""
        ready = self.index.ready_slot
        return all(ready(ns, k) is not None for k in scan.out.load_keys)

    def _conclude(self, client: ClientState, ns: Namespace, q: p.LookupQuery, scan: _Scan,
                  pin: bool) -> tuple[p.LookupAnswer, list[bytes]]:
        """Promotions, tail decisions, miss reasons and pins: on the loop."""
        out, hits, pending, misses = scan.out, scan.hits, scan.pending, scan.misses
        tiers, in_tiers, hashes = self.tiers, scan.in_tiers, q.hashes()
        if tiers is not None and out.hit_tokens is None:
            # Promote only what the deferred answer waits for: a tail probed above a chunk hit
            # that is answered anyway would cost a pool slot (an eviction) and a read for
            # nothing.
            for key in out.deferred_keys:
                if key in in_tiers:
                    tiers.probe(ns, key)
        reason = None
        if ns.cost is not None and out.tail_boundary is not None and not ns.cost.load_tail(
                hashes, q.local_tokens, out.chunk_tokens, out.hit_tokens or 0,
                out.tail_boundary):
            out, hits = self._decline_tail(ns, q, out, hits, hashes)
            reason = "tail_below_threshold"
        if pin and out.hit_tokens and not self.client_alive(client):
            # The client's lease ended while this lookup was parked (it died, or said Bye):
            # a pin for it would never be released. Answer a miss, pin nothing.
            out = lk.LookupOutcome(0, 0, None, [], [], out.probes)
            reason = "client_gone"
        slots: list[int] = []
        if out.hit_tokens is None:
            pass
        elif out.hit_tokens == 0:
            reason = reason or self._miss_reason(ns, q, hits, misses)
        else:
            slots = [self.index.ready_slot(ns, k) or 0 for k in out.load_keys]
            if pin and self.quotas is not None and self.quotas.room_pins(client) < len(slots):
                # Pinning this hit would pass the client's share: a miss it can see, counted.
                self.quotas.refused("pins", len(slots))
                self.metrics.loads.labels("quota").inc(len(slots))
                out = lk.LookupOutcome(0, 0, None, [], [], out.probes)
                reason, slots = "quota", []
            elif pin:
                # Recency is updated when the load completes (complete_load), not here: a
                # lookup that loads nothing must not reorder the policy.
                for slot in slots:
                    take_pin(self.index, client, slot)
                self.metrics.loads.labels("pinned").inc(len(slots))
                self.metrics.loaded_bytes.inc(len(slots) * self.index.pool.slot_bytes)
            else:
                slots = []
        answer = p.LookupAnswer(req_id=q.req_id, hit_tokens=out.hit_tokens,
                                chunk_tokens=out.chunk_tokens, tail_boundary=out.tail_boundary,
                                load_keys=out.load_keys if out.hit_tokens else [], slots=slots,
                                hit_keys=hits, pending_keys=pending, miss_reason=reason)
        return answer, out.deferred_keys

    def _decline_tail(self, ns: Namespace, q: p.LookupQuery, out: lk.LookupOutcome,
                      hits: list[bytes], hashes: Sequence[bytes]
                      ) -> tuple[lk.LookupOutcome, list[bytes]]:
        """Fall back to the complete-chunk hit when the tail cannot repay its load.

        The tail's keys leave ``hit_keys`` too: a caller answering key by key (vLLM's
        manager.lookup) would otherwise re-derive the tail from them."""
        assert out.tail_boundary is not None
        tph = ns.geometry.tokens_per_hash
        tail_hash = hashes[out.tail_boundary // tph - 1]
        hits = [k for k in hits if k[:-4] != tail_hash]
        chunk = out.chunk_tokens
        keys = lk.plan_for(ns.geometry).load_keys(hashes, q.local_tokens, chunk, None) \
            if chunk else []
        self.metrics.tails_declined.labels("load").inc()
        return lk.LookupOutcome(chunk, chunk, None, keys, [], out.probes), hits

    def _miss_reason(self, ns: Namespace, q: p.LookupQuery, hits: list[bytes],
                     misses: list[bytes]) -> str:
        smallest = min(g.tokens_per_block for g in ns.geometry.groups)
        if q.num_prompt_tokens - q.local_tokens <= min(smallest, ns.geometry.tokens_per_hash):
            return "too_short"
        if misses and self.events.was_evicted(misses[0]):
            return "evicted"
        return "group_missing" if hits else "not_stored"

    def _report(self, ns: Namespace, q: p.LookupQuery, a: p.LookupAnswer,
                started: float) -> None:
        """Count one final answer and publish its lookup event."""
        self.events.lookup(ns, q, a, time.perf_counter() - started)
        t = self.totals
        t["lookups_total"] += 1
        requested = max(0, q.num_prompt_tokens - q.local_tokens)  # resumed: local > prompt
        t["requested_tokens_total"] += requested
        if a.hit_tokens:
            t["hit_tokens_total"] += a.hit_tokens
            t["chunk_hit_tokens_total"] += a.chunk_tokens
            t["tail_hit_tokens_total"] += a.hit_tokens - a.chunk_tokens
        m = self.metrics
        m.lookup_tokens.labels("requested").inc(requested)
        if a.hit_tokens is None:
            m.lookups.labels("deferred").inc()
        elif a.hit_tokens == 0:
            m.lookups.labels("miss").inc()
            m.lookup_misses.labels(a.miss_reason or "unknown").inc()
        else:
            m.lookups.labels("tail" if a.tail_boundary is not None else "chunk").inc()
            m.lookup_tokens.labels("hit").inc(a.hit_tokens)
            m.lookup_tokens.labels("chunk_hit").inc(a.chunk_tokens)
            m.lookup_tokens.labels("tail_hit").inc(a.hit_tokens - a.chunk_tokens)

    def _lookup_all(self, client: ClientState, msg: p.Lookup, ns: Namespace, final: bool,
                    started: float) -> tuple[list[p.LookupAnswer], list[bytes]]:
        answers, waits = [], []
        for q in msg.queries:
            a, deferred = self._lookup_one(client, ns, q, msg.pin)
            answers.append(a)
            waits.extend(deferred)
            if final or a.hit_tokens is not None:
                self._report(ns, q, a, started)
        return answers, waits

    def lookup(self, client: ClientState, ns: Namespace,
               msg: p.Lookup) -> p._Msg | Awaitable[p._Msg]:
        for q in msg.queries:
            self._validate_query(ns, q)
        started = time.perf_counter()
        if sum(len(q.hashes()) for q in msg.queries) > SLICE_HASHES:
            return self._lookup_sliced(client, msg, ns, started)
        answers, waits = self._lookup_all(client, msg, ns, msg.wait_ms <= 0, started)
        self.metrics.lookup_seconds.observe(time.perf_counter() - started)
        if not waits or msg.wait_ms <= 0:
            return p.LookupReply(rid=msg.rid, answers=answers)
        return self._lookup_waiting(client, msg, ns, answers, waits, started)

    async def _lookup_all_async(self, client: ClientState, msg: p.Lookup, ns: Namespace,
                                final: bool, started: float
                                ) -> tuple[list[p.LookupAnswer], list[bytes]]:
        """``_lookup_all`` for big messages: never more than about SLICE_HASHES hashes of
        work on the loop between two yields.

        Small queries are answered on the loop in slices; a query of THREAD_HASHES or more
        is scanned in a worker thread (the loop keeps running meanwhile, sharing the GIL) and
        concluded on the loop, re-scanned there only if a key its hit loads left meanwhile.
        Each query is still answered in one piece (its pins taken at once)."""
        answers: list[p.LookupAnswer] = []
        waits: list[bytes] = []
        budget = 0
        for q in msg.queries:
            n = len(q.hashes())
            if n >= THREAD_HASHES:
                scan = await self._scan_off_loop(ns, q)
                a, deferred = self._conclude(client, ns, q, scan, msg.pin)
                budget = 0
            else:
                if budget + n > SLICE_HASHES:
                    await asyncio.sleep(0)
                    budget = 0
                a, deferred = self._lookup_one(client, ns, q, msg.pin)
                budget += n
            answers.append(a)
            waits.extend(deferred)
            if final or a.hit_tokens is not None:
                self._report(ns, q, a, started)
        return answers, waits

    async def _lookup_sliced(self, client: ClientState, msg: p.Lookup, ns: Namespace,
                             started: float) -> p._Msg:
        answers, waits = await self._lookup_all_async(client, msg, ns, msg.wait_ms <= 0,
                                                      started)
        self.metrics.lookup_seconds.observe(time.perf_counter() - started)
        if not waits or msg.wait_ms <= 0:
            return p.LookupReply(rid=msg.rid, answers=answers)
        return await self._lookup_waiting(client, msg, ns, answers, waits, started)

    def stop_waiting(self) -> None:
        """Shutdown: every parked lookup answers now (a key still pending is a miss)."""
        self.draining = True
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(False)

    def _stop_future(self) -> asyncio.Future[bool]:
        if self._stop is None:
            self._stop = asyncio.get_running_loop().create_future()
        return self._stop

    async def _lookup_waiting(self, client: ClientState, msg: p.Lookup, ns: Namespace,
                              answers: list[p.LookupAnswer], waits: list[bytes],
                              started: float) -> p._Msg:
        """Park on the pending keys' futures; re-run the deferred queries when one resolves."""
        deadline = time.monotonic() + min(msg.wait_ms, MAX_WAIT_MS) / 1000
        # Keys can resolve between the first pass and this task's first step (a promotion's
        # read finishing in a thread): with no future left, look again once, do not give up.
        look_again = True
        while True:
            futures = [f for f in (self.index.wait(ns, k) or (
                self.tiers.wait(ns, k) if self.tiers is not None else None)  # store checks
                for k in waits) if f is not None]
            left = deadline - time.monotonic()
            if left <= 0 or self.draining or (not futures and not look_again):
                for f in futures:
                    f.cancel()
                break
            look_again = bool(futures)
            if futures:
                self.metrics.futures_waiting.inc()
                try:
                    await asyncio.wait([*futures, self._stop_future()], timeout=left,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    self.metrics.futures_waiting.dec()
                    for f in futures:
                        f.cancel()
            redo = p.Lookup(rid=msg.rid, engine=msg.engine, pin=msg.pin,
                            queries=[q for q, a in zip(msg.queries, answers, strict=True)
                                     if a.hit_tokens is None])
            final = time.monotonic() >= deadline or self.draining
            new_answers, waits = await self._lookup_all_async(client, redo, ns, final, started)
            by_id = {a.req_id: a for a in new_answers}
            answers = [by_id.get(a.req_id, a) if a.hit_tokens is None else a for a in answers]
            if not waits:
                break
        # Past the deadline a key still being written is a miss for this caller.
        answers = [p.LookupAnswer(req_id=a.req_id, hit_tokens=0, miss_reason="pending",
                                  hit_keys=a.hit_keys, pending_keys=a.pending_keys)
                   if a.hit_tokens is None else a for a in answers]
        for q, a in zip(msg.queries, answers, strict=True):
            if a.miss_reason == "pending":
                self._report(ns, q, a, started)
        return p.LookupReply(rid=msg.rid, answers=answers)
