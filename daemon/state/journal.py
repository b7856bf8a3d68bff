"""Persistence of the index in ``--state-dir``: a snapshot plus an append-only journal.

Files (both a sequence of framed records, see ``docs/reliability.md``):

* ``index.snapshot``: the live blocks at one moment (written to a temp file, fsynced, renamed).
* ``index.journal``: commit and drop records since that snapshot, appended in batches.

Each file starts with a header record carrying an *epoch*; a journal is replayed only on top of
the snapshot of the same epoch. Compaction writes snapshot epoch E+1 and only then starts a new
journal of epoch E+1, so a crash between the two leaves an old journal that is ignored (its
records are in the new snapshot already).

Hot path: the index listeners only append a tuple to a deque. A writer thread wakes on the
first commit queued since its last batch (else every ``flush_ms``), checksums the committed slots (zlib.crc32 releases the GIL), writes the batch with
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
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvoffload.daemon.state.snapshot import (
    JOURNAL,
    MAX_RECOVERED_SLOTS,
    SNAPSHOT,
    VERSION,
    Entry,
    Recovery,
    State,
    StateFileError,
    _enc,
    fits_any,
    frame,
    load_state,
    restore,
    slot_checksum,
    validate,
    write_snapshot,
)
from kvoffload.daemon.store.index import BlockIndex, Namespace
from kvoffload.daemon.store.pool import Pool
from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("kvoffload.daemon")


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
        # An acknowledged commit is lost by kill -9 until it is written: wake the writer now
        # rather than at its next tick (once per batch: set only when it is not set yet).
        if not self._wake.is_set():
            self._wake.set()

    def _on_drop(self, ns: Namespace, key: bytes, slot: int) -> None:
        self._gen[slot] = self._gen.get(slot, 0) + 1  # before the slot can be handed out again
        if not self.failed:
            self._queue.append(("D", ns.id, key, slot))

    def _on_abort(self, ns: Namespace, key: bytes, slot: int) -> None:
        self._gen[slot] = self._gen.get(slot, 0) + 1

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, recovered: Iterable[tuple[Namespace, Entry]],
              epoch: int | None = None) -> None:
        """Begin a new epoch holding exactly the recovered blocks (ids of this daemon run).
        ``epoch``: the one recovered from (None: read it from the files)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if epoch is None:
            try:
                epoch = load_state(self.dir).epoch
            except StateFileError:  # replaced below by a fresh snapshot
                epoch = 0
        st = State(epoch=epoch + 1, slot_bytes=self.pool.slot_bytes,
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
                # A full or broken state disk must not take the cache down: stop journaling,
                # say so once, and start cold next time.
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
        while self._queue:
            self._flush_batch()

    def _flush_batch(self, limit: int = 8192) -> None:
        """Write up to ``limit`` queued records with one write (bounded memory under load)."""
        out: list[bytes] = []
        while self._queue and len(out) < limit:
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


class StateDirError(Exception):
    """The state dir cannot be used and ``state_dir_errors = "refuse"``: one line, why."""


def _unusable(path: Path, errors: str, why: str) -> None:
    """A state dir whose content cannot be used: refused, or one loud line and a cold start."""
    if errors == "refuse":
        raise StateDirError(f"state_dir {path}: {why}")
    log.error("state dir %s: %s: starting cold, nothing recovered", path, why)


def recover_state(state_dir: str | Path, index: BlockIndex, registry: CollectorRegistry,
                  slot_bytes: int = 0,
                  notify: Callable[[Namespace, bytes, int], None] | None = None,
                  errors: str = "cold") -> Journal:
    """At start, before clients: rebuild the index from the state dir and start journaling.

    ``slot_bytes`` is the configured slot size (0: the journal's, else the first engine's).
    Every recovered block is validated against the pool file; what fails is discarded and
    counted in ``kvoffload_recovery_blocks_total{outcome}``. A state dir that cannot be used
    at all (a file that is not one, an impossible header) raises ``StateDirError`` when
    ``errors`` is ``"refuse"``, else starts cold with one error line.
    """
    outcomes = Counter("kvoffload_recovery_blocks_total",
                       "Blocks found in the state dir at start, by outcome.", ["outcome"],
                       registry=registry)
    pool = index.pool
    state_path = Path(state_dir)
    state_path.mkdir(parents=True, exist_ok=True)
    try:
        state = load_state(state_path)
    except (StateFileError, OSError, MemoryError, RecursionError, ValueError) as exc:
        # Unreadable or absurd state is no reason not to serve (unless told to refuse).
        _unusable(state_path, errors, f"cannot be read ({exc})")
        state = State()
    if state.skipped:
        log.warning("state dir %s: %d corrupt, truncated or invalid journal records ignored",
                    state_path, state.skipped)
    if state.live and not pool.configured:
        size = slot_bytes or state.slot_bytes
        if not slot_bytes and not (0 < size <= pool.pool_bytes and
                                   pool.pool_bytes // size <= MAX_RECOVERED_SLOTS):
            _unusable(state_path, errors, f"records slot size {size}, impossible for a pool "
                      f"of {pool.pool_bytes} bytes (at most {MAX_RECOVERED_SLOTS} slots)")
        elif not slot_bytes and not fits_any(state, size):
            _unusable(state_path, errors, f"none of its namespaces is a valid geometry whose "
                      f"block fits its slot size {size}")
        else:
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
    journal.start(((ns, e) for (ns, _, _), (_, e) in zip(restored, rec.good, strict=True)),
                  epoch=state.epoch)
    journal.attach(index)
    return journal
