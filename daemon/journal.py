"""Persistence of the index in ``--state-dir``: a snapshot plus an append-only journal.

Files (both a sequence of framed records, see ``docs/reliability.md``):

* ``index.snapshot``: the live blocks at one moment (written to a temp file, fsynced, renamed).
* ``index.journal``: commit and drop records since that snapshot, appended in batches.

Each file starts with a header record carrying an *epoch*; a journal is replayed only on top of
the snapshot of the same epoch. Compaction writes snapshot epoch E+1 and only then starts a new
journal of epoch E+1, so a crash between the two leaves an old journal that is ignored (its
records are in the new snapshot already).

Hot path: the index listeners only append a tuple to a deque. A writer thread wakes every
``flush_ms``, checksums the committed slots (zlib.crc32 releases the GIL), writes the batch with
one ``write`` and fsyncs at most every ``fsync_ms``. A crash loses at most the records not yet
written; those blocks are not recovered, never served wrong. A commit is journaled only if its
slot was not dropped while the checksum ran (a per-slot drop generation), so a checksum always
describes the bytes the committed block had.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from kvoffload.daemon.index import BlockIndex, Namespace
from kvoffload.daemon.pool import Pool
from kvoffload.daemon.types import Geometry
from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("kvoffload.daemon")

VERSION = 1
SNAPSHOT = "index.snapshot"
JOURNAL = "index.journal"
_FRAME = struct.Struct("<II")  # payload length, crc32 of the payload
_MAX_RECORD = 1 << 20  # a longer length field is garbage: stop reading there
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()
_geom_dec = msgspec.msgpack.Decoder(Geometry)

# Record payloads are msgpack arrays tagged by their first element:
#   ["H", version, epoch, slot_bytes, pool_bytes]      header, first record of every file
#   ["N", ns_id, geometry (msgpack bytes)]             a namespace, before its first commit
#   ["C", ns_id, key, slot, end_token, tail, crc32]    a committed block and its slot checksum
#   ["D", ns_id, key, slot]                            the block left the pool


def checksum(data: memoryview | bytes) -> int:
    return zlib.crc32(data)


def frame(record: list[Any]) -> bytes:
    payload = _enc.encode(record)
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def read_records(path: Path) -> tuple[list[list[Any]], int]:
    """All intact records of a file and how many were skipped as corrupt.

    A record whose checksum fails is skipped; a truncated tail (a crash mid-write) or a length
    beyond ``_MAX_RECORD`` ends the file: nothing after it can be framed reliably.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    out: list[list[Any]] = []
    bad = off = 0
    while off + _FRAME.size <= len(data):
        n, crc = _FRAME.unpack_from(data, off)
        start = off + _FRAME.size
        if n > _MAX_RECORD or start + n > len(data):
            bad += 1
            break
        payload = data[start:start + n]
        off = start + n
        try:
            if zlib.crc32(payload) != crc:
                raise ValueError("record checksum mismatch")
            rec = _dec.decode(payload)
            if not isinstance(rec, list) or not rec or not isinstance(rec[0], str):
                raise ValueError("not a record")
        except (ValueError, msgspec.DecodeError):
            bad += 1
            continue
        out.append(rec)
    if 0 < len(data) - off < _FRAME.size:
        bad += 1  # a torn frame header
    return out, bad


@dataclass(slots=True)
class Entry:
    ns: int
    key: bytes
    slot: int
    end_token: int
    tail: bool
    crc: int


@dataclass
class State:
    """What a sequence of records describes: header values, namespaces and live blocks."""

    epoch: int = 0
    slot_bytes: int = 0
    pool_bytes: int = 0
    geometries: dict[int, bytes] = field(default_factory=dict)
    live: dict[tuple[int, bytes], Entry] = field(default_factory=dict)
    by_slot: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    skipped: int = 0  # corrupt or unusable records

    def apply(self, rec: list[Any]) -> None:
        try:
            tag = rec[0]
            if tag == "H":
                _, _version, self.epoch, self.slot_bytes, self.pool_bytes = rec
            elif tag == "N":
                self.geometries[int(rec[1])] = bytes(rec[2])
            elif tag == "C":
                _, ns, key, slot, end, tail, crc = rec
                self.commit(Entry(int(ns), bytes(key), int(slot), int(end), bool(tail),
                                  int(crc)))
            elif tag == "D":
                _, ns, key, slot = rec
                e = self.live.get((ns, key))
                if e is not None and e.slot == slot:
                    del self.live[(ns, key)]
                    self.by_slot.pop(slot, None)
            else:
                self.skipped += 1
        except (ValueError, TypeError):
            self.skipped += 1

    def commit(self, e: Entry) -> None:
        # A slot holds one block: a later commit to it supersedes whatever it held before.
        old = self.by_slot.pop(e.slot, None)
        if old is not None:
            self.live.pop(old, None)
        prev = self.live.get((e.ns, e.key))
        if prev is not None:
            self.by_slot.pop(prev.slot, None)
        self.live[(e.ns, e.key)] = e
        self.by_slot[e.slot] = (e.ns, e.key)

    def records(self) -> Iterator[list[Any]]:
        """This state as snapshot records (after the header)."""
        used = {e.ns for e in self.live.values()}
        for ns, geom in self.geometries.items():
            if ns in used:
                yield ["N", ns, geom]
        for e in self.live.values():
            yield ["C", e.ns, e.key, e.slot, e.end_token, e.tail, e.crc]


def load_state(state_dir: Path) -> State:
    """The snapshot, plus the journal when it continues that snapshot (same epoch)."""
    state = State()
    snap, bad = read_records(state_dir / SNAPSHOT)
    state.skipped += bad
    for rec in snap:
        state.apply(rec)
    journal, bad = read_records(state_dir / JOURNAL)
    if journal and journal[0][0] == "H" and len(journal[0]) == 5:
        # A fresh daemon's first snapshot has no slot size yet (no engine had registered).
        if journal[0][2] == state.epoch and state.slot_bytes in (0, journal[0][3]):
            state.skipped += bad
            for rec in journal:
                state.apply(rec)
        else:
            log.info("journal of epoch %s does not continue snapshot epoch %s: ignored",
                     journal[0][2], state.epoch)
    elif journal:
        state.skipped += len(journal) + bad
    return state


def write_snapshot(state_dir: Path, state: State) -> None:
    """Atomically replace the snapshot: temp file, fsync, rename, fsync the directory."""
    tmp = state_dir / f"{SNAPSHOT}.tmp"
    with open(tmp, "wb") as f:
        f.write(frame(["H", VERSION, state.epoch, state.slot_bytes, state.pool_bytes]))
        f.write(b"".join(frame(r) for r in state.records()))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(state_dir / SNAPSHOT)
    _fsync_dir(state_dir)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Recovery:
    """Outcome of validating a recovered state against the pool file."""

    good: list[tuple[Geometry, Entry]]
    discarded: collections.Counter[str]

    @property
    def n_discarded(self) -> int:
        return sum(self.discarded.values())


def validate(state: State, pool: Pool, workers: int = 4) -> Recovery:
    """Keep the entries whose slot is in range, unique and holds the journaled checksum.

    The pool must be configured already; a journal written with another slot size describes
    a different slot layout, so nothing of it can be trusted.
    """
    discarded: collections.Counter[str] = collections.Counter()
    entries = list(state.live.values())
    if not entries:
        return Recovery([], discarded)
    if state.slot_bytes != pool.slot_bytes:
        log.warning("state dir journal has slot size %d, the pool uses %d: discarding all %d "
                    "recovered blocks", state.slot_bytes, pool.slot_bytes, len(entries))
        discarded["slot_size_mismatch"] = len(entries)
        return Recovery([], discarded)
    geoms: dict[int, Geometry | None] = {}
    candidates: list[tuple[Geometry, Entry]] = []
    seen: set[int] = set()
    for e in entries:
        if e.ns not in geoms:
            try:
                g: Geometry | None = _geom_dec.decode(state.geometries[e.ns])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
                g = None
            geoms[e.ns] = g if g is not None and g.slot_bytes() <= pool.slot_bytes else None
        geom = geoms[e.ns]
        if geom is None:
            discarded["geometry"] += 1
        elif not 0 <= e.slot < pool.num_slots or e.slot in seen:
            discarded["slot_range"] += 1
        else:
            seen.add(e.slot)
            candidates.append((geom, e))
    with ThreadPoolExecutor(max_workers=workers) as ex:  # crc32 releases the GIL
        crcs = list(ex.map(lambda e: slot_checksum(pool, e.slot), (e for _, e in candidates)))
    good = []
    for (geom, e), crc in zip(candidates, crcs, strict=True):
        if crc == e.crc:
            good.append((geom, e))
        else:
            discarded["checksum"] += 1
    return Recovery(good, discarded)


def slot_checksum(pool: Pool, slot: int) -> int:
    with pool.view(slot) as mv:  # released at once: a live view would block pool.close
        return checksum(mv)


def restore(index: BlockIndex, recovery: Recovery) -> list[tuple[Namespace, bytes, int]]:
    """Re-admit validated blocks as READY; returns (namespace, key, slot) of each."""
    out: list[tuple[Namespace, bytes, int]] = []
    for geom, e in recovery.good:
        ns = index.namespace(geom)
        index.restore(ns, e.key, e.slot, e.end_token, e.tail)
        out.append((ns, e.key, e.slot))
    index.pool.claim(slot for _, _, slot in out)
    return out


class Journal:
    """Index listener that journals commits and drops from a background writer thread.

    ``start(state)`` takes the recovered (validated) state, writes it as snapshot epoch+1 and
    starts the writer; ``attach(index)`` hooks the listeners; ``close()`` drains the queue and
    compacts into a final snapshot (blocking: call it off the event loop).
    """

    def __init__(self, state_dir: str | Path, pool: Pool, *, flush_ms: int = 20,
                 fsync_ms: int = 1000, compact_min: int = 100_000) -> None:
        self.dir = Path(state_dir)
        self.pool = pool
        self.flush_s = flush_ms / 1000
        self.fsync_s = fsync_ms / 1000
        self.compact_min = compact_min
        self.state = State()  # the writer's mirror of what the files describe
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self._gen: dict[int, int] = {}  # slot -> drops seen; a changed value voids a checksum
        self._known_ns: set[int] = set()
        self._index: BlockIndex | None = None
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._records = 0  # records in the current journal file
        self._last_fsync = 0.0
        self._dirty = False
        self.written = 0  # commit records written (for tests and logs)
        self.failed = False  # the state disk failed: journaling stopped, nothing is queued

    # -- event loop side: O(1) per event, never touches the disk ------------------------

    def attach(self, index: BlockIndex) -> None:
        self._index = index
        index.on_ready.append(self._on_ready)
        index.on_drop.append(self._on_drop)
        index.on_abort.append(self._on_abort)

    def _on_ready(self, ns: Namespace, key: bytes, slot: int) -> None:
        if self.failed:
            return
        if ns.id not in self._known_ns:
            self._known_ns.add(ns.id)
            self._queue.append(("N", ns.id, _enc.encode(ns.geometry)))
        idx = self._index
        assert idx is not None
        self._queue.append(("C", ns.id, key, slot, idx.end_token[slot], bool(idx.tail[slot]),
                            self._gen.get(slot, 0)))

    def _on_drop(self, ns: Namespace, key: bytes, slot: int) -> None:
        self._gen[slot] = self._gen.get(slot, 0) + 1  # before the slot can be handed out again
        if not self.failed:
            self._queue.append(("D", ns.id, key, slot))

    def _on_abort(self, ns: Namespace, key: bytes, slot: int) -> None:
        self._gen[slot] = self._gen.get(slot, 0) + 1

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, recovered: Iterable[tuple[Namespace, Entry]]) -> None:
        """Begin a new epoch holding exactly the recovered blocks (ids of this daemon run)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        old = load_state(self.dir)
        st = State(epoch=old.epoch + 1, slot_bytes=self.pool.slot_bytes,
                   pool_bytes=self.pool.pool_bytes)
        for ns, e in recovered:
            if ns.id not in st.geometries:
                st.geometries[ns.id] = _enc.encode(ns.geometry)
                self._known_ns.add(ns.id)
            st.commit(Entry(ns.id, e.key, e.slot, e.end_token, e.tail, e.crc))
        self.state = st
        write_snapshot(self.dir, st)
        (self.dir / JOURNAL).unlink(missing_ok=True)
        self._thread = threading.Thread(target=self._run, name="kvoffload-journal", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Write everything queued, then compact into a snapshot. Blocks until done."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            stopping = self._stop
            try:
                self._flush()
                if stopping:
                    self._compact()
                    return
                if self._records > max(self.compact_min, 2 * len(self.state.live)):
                    self._compact()
            except OSError:
                # A full or broken state disk must not take the cache down: stop journaling
                # (the next start recovers what was written) and say so once.
                log.exception("journal write failed: warm restart state is no longer updated")
                self.failed = True
                self._queue.clear()
                self._close_fd()
                # The files on disk may now miss drops: make sure the next start trusts none.
                for name in (SNAPSHOT, JOURNAL):
                    with contextlib.suppress(OSError):
                        (self.dir / name).unlink()
                return

    def _flush(self) -> None:
        out: list[bytes] = []
        while self._queue:
            rec = self._queue.popleft()
            if rec[0] == "C":
                slot, gen = rec[3], rec[6]
                crc = slot_checksum(self.pool, slot)
                # Dropped while we read it: the bytes may already be another block's.
                if self._gen.get(slot, 0) != gen:
                    continue
                _, ns, key, slot, end, tail, gen = rec
                full = ["C", ns, key, slot, end, tail, crc]
                out.append(frame(full))
                self.state.apply(full)
                self.written += 1
            else:
                out.append(frame(list(rec)))
                self.state.apply(list(rec))
        if out:
            if self._fd is None:
                self._open_journal()
            assert self._fd is not None
            os.write(self._fd, b"".join(out))
            self._records += len(out)
            self._dirty = True
        now = time.monotonic()
        if self._dirty and self._fd is not None and now - self._last_fsync >= self.fsync_s:
            os.fsync(self._fd)
            self._last_fsync, self._dirty = now, False

    def _open_journal(self) -> None:
        st = self.state
        if not st.slot_bytes:  # fresh start: the first engine configured the pool since
            st.slot_bytes, st.pool_bytes = self.pool.slot_bytes, self.pool.pool_bytes
        fd = os.open(self.dir / JOURNAL, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
                     0o600)
        os.write(fd, frame(["H", VERSION, st.epoch, st.slot_bytes, st.pool_bytes]))
        self._fd, self._records = fd, 1

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _compact(self) -> None:
        """Snapshot the mirror as the next epoch, then start an empty journal for it."""
        st = self.state
        if not st.slot_bytes:
            st.slot_bytes, st.pool_bytes = self.pool.slot_bytes, self.pool.pool_bytes
        st.epoch += 1
        write_snapshot(self.dir, st)  # from here on the old journal is ignored
        self._close_fd()
        (self.dir / JOURNAL).unlink(missing_ok=True)
        self._records, self._dirty = 0, False
        log.debug("journal compacted: %d blocks in snapshot epoch %d", len(st.live), st.epoch)


def recover_state(state_dir: str | Path, index: BlockIndex, registry: CollectorRegistry,
                  slot_bytes: int = 0,
                  notify: Callable[[Namespace, bytes, int], None] | None = None) -> Journal:
    """At start, before clients: rebuild the index from the state dir and start journaling.

    ``slot_bytes`` is the configured slot size (0: the journal's, else the first engine's).
    Every recovered block is validated against the pool file; what fails is discarded and
    counted in ``kvoffload_recovery_blocks_total{outcome}``.
    """
    outcomes = Counter("kvoffload_recovery_blocks_total",
                       "Blocks found in the state dir at start, by outcome.", ["outcome"],
                       registry=registry)
    pool = index.pool
    state_path = Path(state_dir)
    state_path.mkdir(parents=True, exist_ok=True)
    state = load_state(state_path)
    if state.skipped:
        log.warning("state dir %s: %d corrupt or truncated journal records ignored",
                    state_path, state.skipped)
    if state.live and not pool.configured:
        size = slot_bytes or state.slot_bytes
        if 0 < size <= pool.pool_bytes:
            index.configure(size)
    if state.live and not pool.configured:
        rec = Recovery([], collections.Counter(slot_size_invalid=len(state.live)))
    elif state.live:
        rec = validate(state, pool)
    else:
        rec = Recovery([], collections.Counter())
    restored = restore(index, rec)
    outcomes.labels("recovered").inc(len(restored))
    outcomes.labels("discarded").inc(rec.n_discarded)
    if state.live:
        log.info("warm restart from %s: %d blocks recovered, %d discarded %s", state_path,
                 len(restored), rec.n_discarded, dict(rec.discarded))
    if notify is not None:
        for ns, key, slot in restored:
            notify(ns, key, slot)
    journal = Journal(state_path, pool)
    journal.start((ns, e) for (ns, _, _), (_, e) in zip(restored, rec.good, strict=True))
    journal.attach(index)
    return journal
