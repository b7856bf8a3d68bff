"""The daemon's index, published in shared memory so that engines read it without a message.

vLLM's scheduler asks its offloading manager one key at a time, dozens of times per request
(``shared/spec/engine-path.md``): a round trip per request already costs more than vLLM's whole
in-process scan. So the daemon, the single writer of its index, mirrors every slot's state into
a file next to the pool, and each engine's manager keeps a local dict up to date from it:

* a **slot table**: one 56-byte entry per pool slot (key, namespace, state, flags, generation),
  written under a per-entry sequence lock (odd while being written), and
* a **change ring**: the slot number of every entry write, in order. Its write position
  (``head``) is the index **epoch**. A reader applies ``ring[applied:head]`` by re-reading those
  entries (one integer read when nothing changed); a reader that fell a whole ring behind
  rescans the table. Re-reading the latest entry makes replays idempotent.

Chosen over an open-addressing table read in place: a probe in shared memory from Python costs
a few microseconds per key (hash, unpack, compare), a local dict ~50 ns, and vLLM asks ~50-80
keys per 32k-token request. The ring costs one integer per change and the reader's dict the
keys of its own namespace only.

**Generations.** A slot's ``gen`` grows each time the slot is handed to a new writer. A worker
that copied slot ``s`` expecting generation ``g`` checks ``gen[s] == g`` (and that no newer
daemon superseded this file) after the copy: if the slot was handed on meanwhile, the bytes may
be another block's and the load is reported as failed, never used.

**Heartbeat.** The daemon stamps ``CLOCK_MONOTONIC`` (one clock for every process on the host)
into the header several times a second; a reader that sees a stale stamp treats the daemon as
down and answers MISS, without sending anything.

**Readers.** Each engine's manager owns one record in a second file (``<index>.readers``,
written by the engines, read by the daemon): the epoch it applied, whether it is inside a
scheduler step (``busy``), and how many control messages it has sent. Between steps a manager
is quiescent (it re-reads the index before its next decision), so an idle engine holds no
freed slot back; ``reclaim.py`` says how the daemon combines records and messages.

Layout (little-endian): a 4 KiB header, the table, then the ring of ``ring_capacity`` u32.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import time
from pathlib import Path

log = logging.getLogger("kvoffload.daemon")

MAGIC = b"KVOIDX01"
VERSION = 1
HEADER_BYTES = 4096
KEY_MAX = 40  # vLLM keys: a 32-byte block hash + 4 bytes of group id
# magic, version, flags, num_slots, ring_capacity, head, heartbeat_ns, daemon_id
HEADER = struct.Struct("<8sIIIIQQ32s")
FLAGS_OFFSET = 12
HEAD_OFFSET = 24
HEARTBEAT_OFFSET = 32
FLAG_SUPERSEDED = 1  # a newer daemon owns the pool now: nothing here may be trusted
# seq (odd while written), gen, namespace, state, flags, key length, key
ENTRY = struct.Struct("<IIHBBB3x40s")
ENTRY_BYTES = ENTRY.size  # 56
SEQ = struct.Struct("<I")
U64 = struct.Struct("<Q")

# One reader record: seq (odd while written), busy, epoch applied, control messages sent.
READER = struct.Struct("<IIQQ8x")
READER_BYTES = READER.size  # 32

# Entry states (what a reader acts on). FREE entries carry no key.
FREE, PENDING, READY = 0, 1, 2
# Entry flags.
FLAG_TAIL = 1
FLAG_NOT_WORTH = 2  # a tail that cannot repay its load under the namespace's time model


def index_path_for(pool_path: str | Path) -> Path:
    return Path(f"{pool_path}.index")


def readers_path_for(index_path: str | Path) -> Path:
    return Path(f"{index_path}.readers")


def ring_capacity_for(num_slots: int) -> int:
    """A power of two >= the slot count: a full turn of the pool fits before a rescan."""
    cap = 1024
    while cap < num_slots:
        cap <<= 1
    return cap


def file_bytes(num_slots: int) -> int:
    return HEADER_BYTES + num_slots * ENTRY_BYTES + 4 * ring_capacity_for(num_slots)


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def supersede(path: Path) -> bool:
    """Mark an index a previous daemon left behind as superseded, then unlink it.

    Engines still mapping it (and their workers' generation checks) see the flag from now on;
    it is set before this daemon touches the pool, so no slot is handed to a new writer while
    an old reader could still trust its generation.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("cannot open the old shared index %s to supersede it: %s", path, exc)
        return False
    try:
        if os.fstat(fd).st_size >= HEADER_BYTES:
            with mmap.mmap(fd, HEADER_BYTES) as mm:
                if mm[:8] == MAGIC:
                    (flags,) = SEQ.unpack_from(mm, FLAGS_OFFSET)
                    SEQ.pack_into(mm, FLAGS_OFFSET, flags | FLAG_SUPERSEDED)
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)
    return True


class SharedIndexWriter:
    """The daemon's side: creates the file and writes every slot change into it."""

    def __init__(self, path: str | Path, num_slots: int, daemon_id: str,
                 max_readers: int = 1024) -> None:
        self.path = Path(path)
        self.num_slots = num_slots
        self.ring_capacity = ring_capacity_for(num_slots)
        self._ring_off = HEADER_BYTES + num_slots * ENTRY_BYTES
        supersede(self.path)
        size = file_bytes(num_slots)
        # Readable by the engines (which run as other users in some deployments: the same
        # rule as the pool file), written by the daemon alone.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.head = 0
        # Reader records: engines map this file read-write (same user as the pool file).
        self.max_readers = max_readers
        self.readers_path = readers_path_for(self.path)
        self.readers_path.unlink(missing_ok=True)
        rfd = os.open(self.readers_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                      0o600)
        try:
            os.ftruncate(rfd, max_readers * READER_BYTES)
            self._readers: mmap.mmap | None = mmap.mmap(rfd, max_readers * READER_BYTES,
                                                        mmap.MAP_SHARED)
        finally:
            os.close(rfd)
        HEADER.pack_into(self._mm, 0, MAGIC, VERSION, 0, num_slots, self.ring_capacity, 0,
                         now_ns(), daemon_id.encode()[:32])

    @property
    def bytes_per_slot(self) -> float:
        return file_bytes(self.num_slots) / max(1, self.num_slots)

    def write(self, slot: int, gen: int, ns: int, state: int, flags: int,
              key: bytes | None) -> None:
        """Publish one slot's new state, then append it to the ring (the epoch moves)."""
        mm, off = self._mm, HEADER_BYTES + slot * ENTRY_BYTES
        (seq,) = SEQ.unpack_from(mm, off)
        SEQ.pack_into(mm, off, (seq + 1) | 1)  # odd: readers retry
        k = key if key is not None and len(key) <= KEY_MAX else b""
        ENTRY.pack_into(mm, off, (seq + 1) | 1, gen & 0xFFFFFFFF, ns, state, flags, len(k), k)
        SEQ.pack_into(mm, off, ((seq + 1) | 1) + 1)  # even again: consistent
        SEQ.pack_into(mm, self._ring_off + 4 * (self.head % self.ring_capacity), slot)
        self.head += 1
        U64.pack_into(mm, HEAD_OFFSET, self.head)

    def read_reader(self, record: int) -> tuple[int, int, int] | None:
        """(busy, epoch, messages sent) of one reader record; None while it is being written."""
        if self._readers is None or not 0 <= record < self.max_readers:
            return None
        for _ in range(8):
            seq, busy, epoch, sent = READER.unpack_from(self._readers, record * READER_BYTES)
            if not seq & 1 and SEQ.unpack_from(self._readers, record * READER_BYTES)[0] == seq:
                return busy, epoch, sent
        return None

    def clear_reader(self, record: int) -> None:
        if self._readers is not None and 0 <= record < self.max_readers:
            READER.pack_into(self._readers, record * READER_BYTES, 0, 0, 0, 0)

    def heartbeat(self) -> None:
        U64.pack_into(self._mm, HEARTBEAT_OFFSET, now_ns())

    def close(self, *, remove: bool = True) -> None:
        with contextlib.suppress(ValueError, OSError):
            (flags,) = SEQ.unpack_from(self._mm, FLAGS_OFFSET)
            # Readers must stop trusting it: no daemon answers for these slots any more.
            SEQ.pack_into(self._mm, FLAGS_OFFSET, flags | FLAG_SUPERSEDED)
            self._mm.close()
            if self._readers is not None:
                self._readers.close()
                self._readers = None
        if remove:
            self.path.unlink(missing_ok=True)
            self.readers_path.unlink(missing_ok=True)
