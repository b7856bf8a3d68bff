"""Local disk tier: blocks evicted from the pool, one file each, bounded, LRU, checksummed.

Layout under ``--disk-dir`` (survives restarts; nothing else is needed to find blocks again)::

    <disk_dir>/<namespace hash>/<h[:2]>/<h>.kvb      h = blake2b(key, 16 bytes), hex

The namespace hash is a hash of the engine's whole geometry (name, groups, TP layout), so a
block is never promoted into an engine whose bytes it does not fit. A file is::

    header (44 bytes, little endian): magic "KVOB", version, key length, meta length,
                                      namespace hash (16), data length, data crc32, header crc32
    key | meta (msgpack: end token, tail flag, the block's published event) | data

Files are written to ``.tmp`` and renamed, so a crash leaves no half file under a real name;
a torn or rotten file still fails the length or checksum check on read and is dropped. No
fsync: this is a cache, a block lost on power loss is only a miss.

Threads: writes of one key always go to the same single-thread lane (so a write, an unlink
and a rewrite of one key happen in order), reads go to a small pool. The event loop only does
dictionary work and, for blocks not yet on disk, a memcpy.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from kvoffload.daemon.base import key_group
from kvoffload.daemon.ops.metrics import DaemonMetrics
from kvoffload.daemon.store.index import Namespace
from kvoffload.daemon.tiers.base import BlockMeta, Tier, TierStats
from kvoffload.daemon.tiers.disk.files import (
    HEAD,
    CorruptBlock,
    encode_meta,
    read_file,
    read_prefix,
    write_file,
)

log = logging.getLogger("kvoffload.daemon")

_WRITE_LANES = 4
_READ_THREADS = 4
_DEGRADED_AFTER = 8  # consecutive I/O errors
_MAX_BACKLOG = 256 << 20  # bytes copied out of the pool but not yet on disk


def namespace_hash(ns: Namespace) -> bytes:
    return hashlib.blake2b(msgspec.msgpack.encode(ns.geometry), digest_size=16).digest()


@dataclass(slots=True)
class _Entry:
    path: str
    size: int  # bytes the file takes (header + key + meta + data)
    data_len: int
    meta: BlockMeta  # record dropped once announced: memory per disk block stays small
    data: bytes | None = None  # set while the write is in flight: reads are served from it
    busy: int = 0  # reads in flight: never evicted under them
    announced: tuple[Any, ...] | None = None  # hashes of the STORAGE BlockStored published


class DiskTier(Tier):
    name = "disk"
    medium = "STORAGE"

    def __init__(self, root: str, capacity: int, metrics: DaemonMetrics, events: Any = None,
                 *, max_backlog: int = _MAX_BACKLOG) -> None:
        self.root = Path(root)
        self._stats = TierStats(capacity_bytes=capacity)
        self.metrics = metrics
        self.events = events  # DaemonEvents or None: STORAGE BlockStored / BlockRemoved
        self.max_backlog = max_backlog
        self._entries: OrderedDict[tuple[bytes, bytes], _Entry] = OrderedDict()  # LRU first
        self._ns_hash: dict[int, bytes] = {}
        self._lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"kvo-disk-w{i}")
                       for i in range(_WRITE_LANES)]
        self._readers = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="kvo-disk-r")
        self._inflight: set[Future[Any]] = set()
        self._backlog = 0
        self._errors = 0  # consecutive I/O errors
        metrics.tier_bytes.labels(self.name, "total").set(capacity)

    # -- bookkeeping ------------------------------------------------------------------

    @property
    def stats(self) -> TierStats:
        return self._stats

    @property
    def degraded(self) -> bool:
        return self._errors >= _DEGRADED_AFTER

    def _io(self, ok: bool) -> None:
        self._errors = 0 if ok else self._errors + 1
        self.metrics.tier_degraded.labels(self.name).set(int(self.degraded))

    def _count(self, op: str, n: int = 1) -> None:
        self.metrics.tier_ops.labels(self.name, op).inc(n)

    def _gauges(self) -> None:
        s = self._stats
        s.blocks = len(self._entries)
        self.metrics.tier_bytes.labels(self.name, "used").set(s.used_bytes)
        # Bytes handed to the writer threads and not yet on disk (their reads come from memory).
        self.metrics.tier_bytes.labels(self.name, "writing").set(self._backlog)
        self.metrics.tier_blocks.labels(self.name).set(s.blocks)

    def _nsh(self, ns: Namespace) -> bytes:
        h = self._ns_hash.get(ns.id)
        if h is None:
            h = self._ns_hash[ns.id] = namespace_hash(ns)
        return h

    def _path(self, nsh: bytes, key: bytes) -> str:
        h = hashlib.blake2b(key, digest_size=16).hexdigest()
        return str(self.root / nsh.hex() / h[:2] / f"{h}.kvb")

    def _lane(self, key: bytes) -> ThreadPoolExecutor:
        return self._lanes[zlib.crc32(key) % len(self._lanes)]

    def _submit(self, ex: ThreadPoolExecutor, fn: Any, *args: Any) -> asyncio.Future[Any]:
        cf = ex.submit(fn, *args)
        self._inflight.add(cf)
        cf.add_done_callback(self._inflight.discard)
        return asyncio.wrap_future(cf)

    # -- Tier -------------------------------------------------------------------------

    def contains(self, ns: Namespace, key: bytes) -> bool:
        return (self._nsh(ns), key) in self._entries

    def meta(self, ns: Namespace, key: bytes) -> BlockMeta | None:
        e = self._entries.get((self._nsh(ns), key))
        return None if e is None else e.meta

    def touch(self, ns: Namespace, key: bytes) -> None:
        k = (self._nsh(ns), key)
        if k in self._entries:
            self._entries.move_to_end(k)

    def block_size(self, ns: Namespace, key: bytes) -> int | None:
        e = self._entries.get((self._nsh(ns), key))
        return None if e is None else e.data_len

    def write(self, ns: Namespace, key: bytes, data: bytes, meta: BlockMeta) -> bool:
        nsh = self._nsh(ns)
        k = (nsh, key)
        if k in self._entries:  # same key, same bytes (keys are content hashes)
            self._entries.move_to_end(k)
            self._count("write_skipped")
            return False
        blob = encode_meta(meta)
        size = HEAD.size + len(key) + len(blob) + len(data)
        if (size > self._stats.capacity_bytes or self._backlog + len(data) > self.max_backlog
                or not self._make_room(size)):
            self._stats.writes_skipped += 1
            self._count("write_skipped")
            return False
        path = self._path(nsh, key)
        entry = _Entry(path, size, len(data), meta, data=data)
        self._entries[k] = entry
        self._stats.used_bytes += size
        self._backlog += len(data)
        fut = self._submit(self._lane(key), write_file, path, nsh, key, blob, data)
        fut.add_done_callback(lambda f: self._written(k, entry, f))
        self._gauges()
        return True

    def _written(self, k: tuple[bytes, bytes], entry: _Entry, fut: asyncio.Future[Any]) -> None:
        self._backlog -= entry.data_len
        entry.data = None
        self._gauges()
        exc = None if fut.cancelled() else fut.exception()
        if fut.cancelled() or exc is not None:
            log.warning("disk tier: write of %s failed: %s", entry.path, exc)
            self._stats.write_errors += 1
            self._count("write_error")
            self._io(False)
            if self._entries.get(k) is entry:
                self._forget(k, entry, unlink=True)
            return
        self._io(True)
        self._stats.writes += 1
        self._count("write")
        rec = entry.meta.record
        if self._entries.get(k) is entry and rec is not None and self.events is not None:
            self.events.storage_stored(rec)
            entry.announced = rec.hashes
        entry.meta = BlockMeta(entry.meta.end_token, entry.meta.tail)

    def _forget(self, k: tuple[bytes, bytes], entry: _Entry, *, unlink: bool) -> None:
        del self._entries[k]
        self._stats.used_bytes -= entry.size
        if unlink:
            self._submit(self._lane(k[1]), _unlink, entry.path)
        if entry.announced is not None and self.events is not None:
            self.events.storage_removed(list(entry.announced), key_group(k[1]))
        self._gauges()

    def _make_room(self, size: int) -> bool:
        s = self._stats
        if s.used_bytes + size <= s.capacity_bytes:
            return True
        victims = []
        free = s.capacity_bytes - s.used_bytes
        for k, e in self._entries.items():  # oldest first
            if e.busy:
                continue  # being read (a write in flight may go: its unlink queues behind it)
            victims.append((k, e))
            free += e.size
            if free >= size:
                break
        if free < size:
            return False
        for k, e in victims:
            self._forget(k, e, unlink=True)
            s.evictions += 1
            self._count("eviction")
        return True

    def remove(self, ns: Namespace, key: bytes) -> bool:
        k = (self._nsh(ns), key)
        e = self._entries.get(k)
        if e is None:
            return False
        self._forget(k, e, unlink=True)
        return True

    async def read_into(self, ns: Namespace, key: bytes,
                        buf: memoryview) -> BlockMeta | None:
        k = (self._nsh(ns), key)
        e = self._entries.get(k)
        if e is None or e.data_len > len(buf):
            return None
        self._entries.move_to_end(k)
        if e.data is not None:  # still on its way to disk: the bytes are right here
            buf[:e.data_len] = e.data
            self._stats.reads += 1
            self._count("read_memory")
            return e.meta
        e.busy += 1
        started = time.perf_counter()
        try:
            meta: BlockMeta = await self._submit(self._readers, read_file, e.path, k[0], key,
                                                 buf[:e.data_len])
        except CorruptBlock as exc:
            log.warning("disk tier: dropping corrupt block %s: %s", e.path, exc)
            self._stats.corrupt += 1
            self.metrics.tier_corrupt.labels(self.name).inc()
            self._drop_if_current(k, e)
            return None
        except OSError as exc:
            log.warning("disk tier: read of %s failed: %s", e.path, exc)
            self._stats.read_errors += 1
            self._count("read_error")
            self._io(False)
            self._drop_if_current(k, e)
            return None
        finally:
            e.busy -= 1
        self._io(True)
        self._stats.reads += 1
        self._count("read")
        self.metrics.tier_read_seconds.labels(self.name).observe(time.perf_counter() - started)
        return meta

    def _drop_if_current(self, k: tuple[bytes, bytes], e: _Entry) -> None:
        if self._entries.get(k) is e:
            self._forget(k, e, unlink=True)

    async def read(self, ns: Namespace, key: bytes) -> bytes | None:
        n = self.block_size(ns, key)
        if n is None:
            return None
        buf = bytearray(n)
        return bytes(buf) if await self.read_into(ns, key, memoryview(buf)) else None

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        found, corrupt = await loop.run_in_executor(self._readers, _scan, self.root)
        for k, entry in found:
            self._entries[k] = entry
            self._stats.used_bytes += entry.size
        if corrupt:
            self._stats.corrupt += corrupt
            self.metrics.tier_corrupt.labels(self.name).inc(corrupt)
        self._make_room(0)  # a smaller disk_bytes than last time: evict the oldest now
        self._gauges()
        log.info("disk tier %s: %d blocks (%d bytes of %d) found, %d corrupt files dropped",
                 self.root, len(self._entries), self._stats.used_bytes,
                 self._stats.capacity_bytes, corrupt)

    async def aclose(self, timeout: float = 10.0) -> None:
        """Let queued writes and unlinks finish (bounded), then stop the threads."""
        if self._inflight:
            await asyncio.wait([asyncio.wrap_future(f) for f in list(self._inflight)],
                               timeout=timeout)
        for ex in (*self._lanes, self._readers):
            ex.shutdown(wait=False, cancel_futures=True)


# -- blocking file work, run in threads -------------------------------------------------


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _scan(root: Path) -> tuple[list[tuple[tuple[bytes, bytes], _Entry]], int]:
    """Every block file under ``root`` with a sound header, oldest first; drop the rest."""
    found: list[tuple[float, tuple[bytes, bytes], _Entry]] = []
    corrupt = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if name.endswith(".tmp"):  # a write cut short by a crash
                _unlink(path)
                continue
            if not name.endswith(".kvb"):
                continue
            try:
                with open(path, "rb") as f:
                    nsh, key, meta, dlen, _ = read_prefix(f, path, None, None)
                    st = os.fstat(f.fileno())
            except (CorruptBlock, OSError):
                corrupt += 1
                _unlink(path)
                continue
            found.append((st.st_mtime, (nsh, key), _Entry(path, st.st_size, dlen, BlockMeta(
                meta.end_token, meta.tail), announced=None)))
    found.sort(key=lambda t: t[0])
    return [(k, e) for _, k, e in found], corrupt

