"""Moving blocks between the pool and the tiers below it.

Down: the index tells us (``on_evict``) about a capacity eviction while the slot still holds
the block; we copy the slot (one memcpy, the slot is reused right after) and hand the copy to
the first tier, which writes it in the background.

Up: a lookup's probe that finds a key MISS in the pool asks ``probe``. If a tier holds the
key, a pool slot is reserved through the index's ordinary ``prepare`` (a PENDING entry, like a
store: it only evicts ready, unpinned blocks), the tier reads into the slot in a thread, and
``commit`` (or ``abort``) resolves the key's futures: a lookup parked with ``wait_ms`` wakes
then, one without it finds a HIT next time. No polling. No room in the pool: MISS, the block
stays in its tier.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from kvoffload.daemon.base import KeyStatus
from kvoffload.daemon.lookup.cost import TailCost, TimeModel
from kvoffload.daemon.ops.metrics import DaemonMetrics
from kvoffload.daemon.store.index import BlockIndex, Namespace, SlotState
from kvoffload.daemon.tiers.base import BlockMeta, Tier

log = logging.getLogger("kvoffload.daemon")


class Promoter:
    def __init__(self, index: BlockIndex, tiers: list[Tier], metrics: DaemonMetrics,
                 events: Any = None, on_change: Callable[[], None] | None = None,
                 read_bytes_per_s: float = 6e9) -> None:
        self.index = index
        self.read_bytes_per_s = read_bytes_per_s  # the first tier's, for keeping tails
        self._keep_cost: dict[int, TailCost] = {}  # namespace id -> its cost model at that rate
        self.tiers = tiers
        self.metrics = metrics
        self.events = events  # DaemonEvents: payload of evicted blocks, events of promoted ones
        self.on_change = on_change  # pool gauges
        self._tasks: set[asyncio.Task[None]] = set()
        index.on_evict.append(self._evicted)
        index.has_tiers = True  # promotions need free slots: evict-ahead keeps them so

    # -- down -------------------------------------------------------------------------

    def _evicted(self, ns: Namespace, key: bytes, slot: int) -> None:
        if not self.tiers:
            return
        tier = self.tiers[0]
        if tier.contains(ns, key):  # promoted earlier, still there: same key, same bytes
            tier.touch(ns, key)
            return
        if self.index.tail[slot] and not self._worth_keeping(ns, self.index.end_token[slot]):
            self.metrics.tier_ops.labels(tier.name, "write_not_worth").inc()
            return
        view = self.index.pool.view(slot)
        try:
            data = bytes(view)  # the copy must happen now: the slot is reused right after
        finally:
            view.release()
        record = self.events.record_of(slot) if self.events is not None else None
        meta = BlockMeta(self.index.end_token[slot], bool(self.index.tail[slot]), record)
        tier.write(ns, key, data, meta)

    def _worth_keeping(self, ns: Namespace, end_token: int) -> bool:
        """Keep a tail below the pool only if, read back at this tier's rate, it would still
        repay its load (the engine's time model; without one every block is kept)."""
        if ns.cost is None:
            return True
        cost = self._keep_cost.get(ns.id)
        model = ns.cost.model
        rate = min(model.copy_bytes_per_s, self.read_bytes_per_s)  # bytes as the geometry
        if cost is None or cost.model.copy_bytes_per_s != rate:
            cost = TailCost(ns.geometry, TimeModel(model.prefill_tokens_per_s, rate))
            self._keep_cost[ns.id] = cost
        return cost.admit_tail(end_token)

    # -- up ---------------------------------------------------------------------------

    def _holder(self, ns: Namespace, key: bytes) -> Tier | None:
        """The first usable tier holding ``key``, if any."""
        for tier in self.tiers:
            if tier.degraded or not tier.contains(ns, key):
                continue
            size = tier.block_size(ns, key)
            if size is not None and size > self.index.pool.slot_bytes:
                continue  # written under a bigger slot size: cannot come back
            return tier
        return None

    def peek(self, ns: Namespace, key: bytes) -> KeyStatus:
        """What ``probe`` would answer, without starting anything: HIT_PENDING when a tier
        holds the key. A lookup peeks while it scans and promotes only the keys its answer
        then waits for; promoting every probed tail would evict pool blocks for nothing."""
        return KeyStatus.HIT_PENDING if self._holder(ns, key) is not None else KeyStatus.MISS

    # Whether ``peek`` may need the loop for a key ``peek_local`` answers MISS (a question
    # to a shared store); local tiers answer from memory alone.
    asks_remote = False

    def peek_local(self, ns: Namespace, key: bytes) -> KeyStatus:
        """``peek`` from the tiers' in-memory maps only: reads, no tasks, so a worker thread
        may call it while the loop runs (dict reads are atomic under the GIL)."""
        return Promoter.peek(self, ns, key)

    def probe(self, ns: Namespace, key: bytes) -> KeyStatus:
        """Status of a key the pool does not hold; starts its promotion when a tier has it."""
        tier = self._holder(ns, key)
        if tier is not None:
            meta = tier.meta(ns, key) or BlockMeta(0, False)
            tier.touch(ns, key)  # most recent: the evictions prepare may cause spare it
            got = self.index.prepare(ns, key, meta.end_token, meta.tail)
            if got.evicted:
                self.metrics.evictions.labels(self.index.policy.name, "capacity").inc(
                    len(got.evicted))
            if got.slot is None:
                self.metrics.tier_promotions.labels(tier.name, "no_room").inc()
                return KeyStatus.HIT_PENDING if got.exists else KeyStatus.MISS
            self.metrics.tier_promotions.labels(tier.name, "started").inc()
            task = asyncio.get_running_loop().create_task(
                self._promote(tier, ns, key, got.slot))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            if self.on_change is not None:
                self.on_change()
            return KeyStatus.HIT_PENDING
        return KeyStatus.MISS

    async def _promote(self, tier: Tier, ns: Namespace, key: bytes, slot: int) -> None:
        started = time.perf_counter()
        # Yield once first: the lookup that started us parks on the key's future in a task
        # scheduled right after this one. A read served from memory would otherwise commit
        # before that lookup parks, and it would find no future to wait on.
        await asyncio.sleep(0)
        meta: BlockMeta | None = None
        view = self.index.pool.view(slot)
        try:
            meta = await tier.read_into(ns, key, view)
        except Exception:
            log.exception("promotion of a block from the %s tier failed", tier.name)
        finally:
            view.release()
        if ns.keys.get(key) != slot or self.index.state[slot] != SlotState.PENDING:
            return  # cannot happen today (only we commit it); never touch another's slot
        if meta is None:
            self.metrics.tier_promotions.labels(tier.name, "failed").inc()
            self.index.abort(ns, key)  # parked lookups re-run and see a MISS
        else:
            if meta.record is not None and self.events is not None:
                self.events.restored(slot, meta.record)
            self.index.commit(ns, key)
            self.metrics.tier_promotions.labels(tier.name, "ok").inc()
            self.metrics.tier_promote_seconds.labels(tier.name).observe(
                time.perf_counter() - started)
        if self.on_change is not None:
            self.on_change()

    def wait(self, ns: Namespace, key: bytes) -> asyncio.Future[bool] | None:
        """A future for a key answered RETRY (a shared tier asking its store); none here."""
        return None

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        for tier in self.tiers:
            await tier.start()

    async def aclose(self, timeout: float = 5.0) -> None:
        """Finish promotions (their threads write into the pool: it must stay mapped until
        they are done), then close the tiers."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
        for tier in self.tiers:
            await tier.aclose()
