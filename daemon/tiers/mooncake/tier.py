"""Shared tier on a Mooncake Store cluster: daemons on several nodes share blocks through it.

Keys and values (``values.py``): a block only ever reaches an engine whose bytes it fits, and
a torn or foreign object is a counted miss.

Down: with ``mooncake_put = "commit"`` every committed block is pushed (other nodes can use it
while it is still in our pool); with ``"evict"`` only blocks the pool evicts. Puts are queued
(bounded bytes) and sent as batches from one thread. Leases, replication and eviction are the
store's.

Up: the pool does not know what the store holds, and a lookup runs on the event loop, so a
pool miss answers RETRY and queues the key for one batched existence check in a thread. When
it answers, present keys start an ordinary promotion (pending slot, batched get in a thread,
commit), then the futures of lookups parked on the check resolve: they look again, find the
pending slot and park on it until the commit. Nothing polls. Answers are remembered
(``answers.py``) so a miss costs one check per key.

Unreachable or not yet connected store (degraded state, the bounded queue of puts made
before the first connect, readiness): docs/tiers.md, "The shared tier on Mooncake Store".
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvoffload.daemon.base import KeyStatus
from kvoffload.daemon.ops.metrics import DaemonMetrics
from kvoffload.daemon.store.index import BlockIndex, Namespace
from kvoffload.daemon.tiers.base import BlockMeta, Tier, TierStats
from kvoffload.daemon.tiers.disk.files import encode_meta
from kvoffload.daemon.tiers.disk.tier import namespace_hash
from kvoffload.daemon.tiers.mooncake.answers import StoreAnswers
from kvoffload.daemon.tiers.mooncake.values import (
    close_store,
    connect_store,
    decode_into,
    encode_value,
    load_store_class,
    metadata_url,
    object_name,
)

log = logging.getLogger("kvoffload.daemon")

_BATCH = 64  # keys per existence check / get batch
_DEGRADED_AFTER = 3  # consecutive failed operations
_HEALTH_PERIOD = 1.0


class MooncakeTier(Tier):
    name = "mooncake"
    medium = "CPU"

    def __init__(self, config: Any, index: BlockIndex, metrics: DaemonMetrics,
                 events: Any = None) -> None:
        self.config = config
        self.index = index
        self.metrics = metrics
        self.events = events
        self.put_on: str = config.mooncake_put
        self.metadata = metadata_url(config)
        self._stats = TierStats(capacity_bytes=config.mooncake_segment_bytes)
        self._store: Any = None
        self._setup_thread: threading.Thread | None = None
        self._healthy = False
        self._connected_once = False  # until then, puts queue (bounded) instead of dropping
        self._errors = 0
        self._io = ThreadPoolExecutor(4, thread_name_prefix="kvo-mc-io")
        self._puts = ThreadPoolExecutor(1, thread_name_prefix="kvo-mc-put")
        self._nsh: dict[int, bytes] = {}
        self._answers = StoreAnswers(self._blocks_known)
        self._checks: dict[tuple[bytes, bytes], list[asyncio.Future[bool]]] = {}
        self._check_queue: list[tuple[Namespace, bytes]] = []
        self._reads: list[tuple[str, memoryview, asyncio.Future[BlockMeta | None]]] = []
        self._put_queue: list[tuple[tuple[bytes, bytes], bytes, bytes]] = []
        self._put_bytes = 0
        self._put_running = False
        self._max_backlog = 4 * config.mooncake_buffer_bytes
        self._flushing: set[str] = set()
        self._tasks: set[asyncio.Future[Any]] = set()
        self._health: asyncio.Task[None] | None = None
        self.skip_teardown = False  # see aclose
        # Set by SharedPromoter: starts a promotion (pending slot + read) for a present key.
        self.promote: Callable[[Namespace, bytes], KeyStatus] | None = None
        metrics.tier_bytes.labels(self.name, "total").set(config.mooncake_segment_bytes)
        metrics.tier_degraded.labels(self.name).set(1)

    # -- state ------------------------------------------------------------------------

    @property
    def stats(self) -> TierStats:
        return self._stats

    @property
    def degraded(self) -> bool:
        return self._store is None or not self._healthy or self._errors >= _DEGRADED_AFTER

    def readiness(self) -> str:
        if not self._connected_once:
            return (f"degraded: not connected to {self.config.mooncake_master} yet "
                    f"({len(self._put_queue)} blocks queued)")
        if self._store is None:
            return f"degraded: not connected to {self.config.mooncake_master}"
        return "degraded: store unreachable" if self.degraded else "ok"

    def _result(self, ok: bool) -> None:
        self._errors = 0 if ok else self._errors + 1
        self.metrics.tier_degraded.labels(self.name).set(int(self.degraded))

    def _count(self, op: str, n: int = 1) -> None:
        self.metrics.tier_ops.labels(self.name, op).inc(n)

    def _k(self, ns: Namespace, key: bytes) -> tuple[bytes, bytes]:
        h = self._nsh.get(ns.id)
        if h is None:
            h = self._nsh[ns.id] = namespace_hash(ns)
        return h, key

    store_key = staticmethod(object_name)

    def _blocks_known(self, n: int) -> None:
        self._stats.blocks = n
        self.metrics.tier_blocks.labels(self.name).set(n)

    def _submit(self, ex: ThreadPoolExecutor, fn: Any, *args: Any) -> asyncio.Future[Any]:
        fut = asyncio.wrap_future(ex.submit(fn, *args))
        self._tasks.add(fut)
        fut.add_done_callback(self._tasks.discard)
        return fut

    def _soon(self, what: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` once after the current loop step: the keys of one lookup go together."""
        if what not in self._flushing:
            self._flushing.add(what)

            def run() -> None:
                self._flushing.discard(what)
                fn()
            asyncio.get_running_loop().call_soon(run)

    # -- Tier: up ---------------------------------------------------------------------

    def contains(self, ns: Namespace, key: bytes) -> bool:
        return not self.degraded and self._answers.present(self._k(ns, key))

    def ask(self, ns: Namespace, key: bytes) -> KeyStatus:
        """A pool miss the store may hold: RETRY while an existence check runs, else MISS."""
        if self.degraded:
            return KeyStatus.MISS
        k = self._k(ns, key)
        if self._answers.known_absent(k):
            return KeyStatus.MISS
        if k not in self._checks:
            self._checks[k] = []
            self._check_queue.append((ns, key))
            self._soon("checks", self._flush_checks)
        return KeyStatus.RETRY

    def wait(self, ns: Namespace, key: bytes) -> asyncio.Future[bool] | None:
        """A future resolving when the existence check of ``key`` answers."""
        waiters = self._checks.get(self._k(ns, key))
        if waiters is None:
            return None
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        return fut

    def _flush_checks(self) -> None:
        while self._check_queue:
            batch, self._check_queue = self._check_queue[:_BATCH], self._check_queue[_BATCH:]
            names = [self.store_key(self._k(ns, key)) for ns, key in batch]
            self._count("exist_check", len(batch))
            fut = self._submit(self._io, self._store.batch_is_exist, names)
            fut.add_done_callback(lambda f, b=batch: self._checked(b, f))  # type: ignore[misc]

    def _checked(self, batch: list[tuple[Namespace, bytes]], fut: asyncio.Future[Any]) -> None:
        codes: list[int] = [-1] * len(batch)
        if not fut.cancelled() and fut.exception() is None:
            codes = list(fut.result())
        else:
            log.warning("mooncake tier: existence check failed: %s",
                        None if fut.cancelled() else fut.exception())
        self._result(all(c >= 0 for c in codes))
        for (ns, key), code in zip(batch, codes, strict=True):
            k = self._k(ns, key)
            if code == 1:
                self._answers.mark_present(k)
                self._count("exist_hit")
                # Promote only for a lookup parked on this check (its answer waits for the
                # key); an unwaited check just marks the key present for the next lookup.
                if self.promote is not None and not self.degraded and self._checks.get(k):
                    self.promote(ns, key)  # pending slot first: the woken lookup parks on it
            else:
                self._count("exist_miss" if code == 0 else "exist_error")
                self._answers.mark_absent(k)
            for w in self._checks.pop(k, ()):
                if not w.done():
                    w.set_result(code == 1)

    async def read_into(self, ns: Namespace, key: bytes,
                        buf: memoryview) -> BlockMeta | None:
        """Gets of one loop step go to the store as one batch (see ``_flush_reads``)."""
        k = self._k(ns, key)
        fut: asyncio.Future[BlockMeta | None] = asyncio.get_running_loop().create_future()
        self._reads.append((self.store_key(k), buf, fut))
        self._soon("reads", self._flush_reads)
        started = time.perf_counter()
        meta = await fut
        if meta is None:
            self._answers.mark_absent(k)  # gone from the store (its eviction) or failed its checks
            return None
        self.metrics.tier_read_seconds.labels(self.name).observe(time.perf_counter() - started)
        slot = ns.keys.get(key)
        if slot is not None:  # reserved before the meta was known: fix what it recorded
            self.index.end_token[slot] = meta.end_token
            self.index.tail[slot] = meta.tail
        rec = meta.record
        if rec is not None:  # announced as CPU (it is in our pool now), fetched from afar
            rec = dataclasses.replace(rec, medium="CPU", locality="REMOTE")
        return BlockMeta(meta.end_token, meta.tail, rec)

    def _flush_reads(self) -> None:
        while self._reads:
            batch, self._reads = self._reads[:_BATCH], self._reads[_BATCH:]
            fut = self._submit(self._io, self._get_batch, batch)
            fut.add_done_callback(lambda f, b=batch: self._got(b, f))  # type: ignore[misc]

    def _get_batch(self, batch: list[tuple[str, memoryview, Any]]
                   ) -> tuple[list[BlockMeta | None], int]:
        """In a thread: one batched get, each value checked and copied into its slot.
        Returns the metas (None: missing or failed a check) and how many failed a check."""
        values = self._store.get_batch([name for name, _, _ in batch])
        out: list[BlockMeta | None] = []
        corrupt = 0
        for (_, buf, _), value in zip(batch, values, strict=True):
            meta = None
            if value:
                try:
                    meta = decode_into(value, buf)
                except Exception:  # a foreign or rotten object
                    meta = None
                corrupt += meta is None
            out.append(meta)
        return out, corrupt

    def _got(self, batch: list[tuple[str, memoryview, asyncio.Future[Any]]],
             fut: asyncio.Future[Any]) -> None:
        metas: list[BlockMeta | None] = [None] * len(batch)
        if not fut.cancelled() and fut.exception() is None:
            metas, corrupt = fut.result()
            if corrupt:
                self._stats.corrupt += corrupt
                self.metrics.tier_corrupt.labels(self.name).inc(corrupt)
            self._result(True)
            self._stats.reads += sum(m is not None for m in metas)
            self._count("read", sum(m is not None for m in metas))
            self._count("read_miss", sum(m is None for m in metas))
        else:
            log.warning("mooncake tier: get failed: %s",
                        None if fut.cancelled() else fut.exception())
            self._result(False)
            self._stats.read_errors += len(batch)
            self._count("read_error", len(batch))
        for (_, _, w), meta in zip(batch, metas, strict=True):
            if not w.done():
                w.set_result(meta)

    async def read(self, ns: Namespace, key: bytes) -> bytes | None:
        buf = bytearray(self.index.pool.slot_bytes)
        meta = await self.read_into(ns, key, memoryview(buf))
        return None if meta is None else bytes(buf)

    # -- Tier: down -------------------------------------------------------------------

    def write(self, ns: Namespace, key: bytes, data: bytes, meta: BlockMeta) -> bool:
        k = self._k(ns, key)
        waiting = not self._connected_once
        limit = self.config.mooncake_buffer_bytes if waiting else self._max_backlog
        if (self.degraded and not waiting) or self._answers.present(k) or \
                self._put_bytes + len(data) > limit:
            self._stats.writes_skipped += 1
            self._count("write_skipped")
            return False
        if waiting:
            self._count("write_queued")
        self._answers.mark_present(k)  # ours to read back from now (reads fall back to a miss)
        self._put_queue.append((k, data, encode_meta(meta)))
        self._put_bytes += len(data)
        self._soon("puts", self._flush_puts)
        return True

    def copy_slot(self, ns: Namespace, key: bytes, slot: int) -> None:
        """Push a pool block: from an index listener (commit or eviction)."""
        if self._answers.present(self._k(ns, key)):
            return  # fetched from the store, or pushed already: same key, same bytes
        if self.degraded and self._connected_once:  # before the first connect: queued
            self._stats.writes_skipped += 1
            self._count("write_skipped")
            return
        view = self.index.pool.view(slot)
        try:
            data = bytes(view)  # now: an evicted slot is reused right after
        finally:
            view.release()
        record = self.events.record_of(slot) if self.events is not None else None
        self.write(ns, key, data, BlockMeta(self.index.end_token[slot],
                                            bool(self.index.tail[slot]), record))

    def _flush_puts(self) -> None:
        if self._put_running or not self._put_queue or not self._connected_once:
            return
        limit = self.config.mooncake_buffer_bytes // 2
        batch: list[tuple[tuple[bytes, bytes], bytes, bytes]] = []
        size = 0
        while self._put_queue and len(batch) < _BATCH and (
                not batch or size + len(self._put_queue[0][1]) <= limit):
            item = self._put_queue.pop(0)
            batch.append(item)
            size += len(item[1])
        self._put_running = True
        fut = self._submit(self._puts, self._put_batch, batch)
        fut.add_done_callback(lambda f: self._put_done(batch, size, f))

    def _put_batch(self, batch: list[tuple[tuple[bytes, bytes], bytes, bytes]]) -> int:
        """In a thread: build the values (header + meta + data) and put them in one call."""
        names = [self.store_key(k) for k, _, _ in batch]
        values = [encode_value(data, blob) for _, data, blob in batch]
        return int(self._store.put_batch(names, values))

    def _put_done(self, batch: list[tuple[tuple[bytes, bytes], bytes, bytes]], size: int,
                  fut: asyncio.Future[Any]) -> None:
        self._put_running = False
        self._put_bytes -= size
        failed = fut.cancelled() or fut.exception() is not None
        rc = -1 if failed else fut.result()
        if rc == 0:
            self._stats.writes += len(batch)
            self._count("write", len(batch))
        else:
            log.warning("mooncake tier: put of %d blocks failed (%s)", len(batch),
                        "cancelled" if fut.cancelled() else fut.exception() or rc)
            self._stats.write_errors += len(batch)
            self._count("write_error", len(batch))
            for k, _, _ in batch:
                self._answers.forget(k)
        # A full store refuses puts (no space) while answering: not an outage.
        self._result(rc == 0 or rc == -600)
        self._flush_puts()

    def remove(self, ns: Namespace, key: bytes) -> bool:
        """Not used by the daemon: shared blocks leave by the store's own eviction."""
        return self._answers.forget(self._k(ns, key))

    # -- lifecycle --------------------------------------------------------------------

    def _setup(self) -> None:
        """In a daemon thread (setup can block for minutes): connect when the master answers."""
        self._store = connect_store(self.config, self.metadata)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._store is None:
                if self._setup_thread is None or not self._setup_thread.is_alive():
                    self._setup_thread = threading.Thread(target=self._setup, daemon=True,
                                                          name="kvo-mc-setup")
                    self._setup_thread.start()
            else:
                try:
                    rc = await loop.run_in_executor(self._io, self._store.health_check)
                except Exception:
                    rc = -1
                was = self.degraded
                self._healthy = rc == 0
                if self._healthy and was:
                    self._errors = 0  # reachable again: let operations prove it
                if self._healthy and not self._connected_once:
                    self._connected_once = True
                    if self._put_queue:
                        log.info("mooncake tier: pushing %d blocks stored before it connected",
                                 len(self._put_queue))
                    self._flush_puts()
                if self.degraded != was:
                    log.warning("mooncake tier: %s", self.readiness())
                self.metrics.tier_degraded.labels(self.name).set(int(self.degraded))
            await asyncio.sleep(_HEALTH_PERIOD)

    async def start(self) -> None:
        load_store_class()  # fail at start, with the reason, when the wheel cannot load
        self._health = asyncio.get_running_loop().create_task(self._watch())

    async def aclose(self, timeout: float = 5.0) -> None:
        if self._health is not None:
            self._health.cancel()
        for waiters in self._checks.values():
            for w in waiters:
                if not w.done():
                    w.set_result(False)
        self._checks.clear()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
        for ex in (self._io, self._puts):
            ex.shutdown(wait=False, cancel_futures=True)
        store = self._store
        if store is None:
            return
        # Unmount our segment now rather than at the master's TTL; when that cannot finish,
        # server.run exits without the client's C++ teardown (see close_store).
        closed = not self.degraded and await asyncio.get_running_loop().run_in_executor(
            None, close_store, store, timeout)
        self.skip_teardown = not closed
