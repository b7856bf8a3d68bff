"""The daemon's index, published in shared memory so that engines read it without a message.

vLLM's scheduler asks its offloading manager one key at a time, dozens of times per request
(``shared/spec/engine-path.md``): a round trip per request already costs more than vLLM's whole
in-process scan. So the daemon, the single writer of its index, mirrors every slot's state into
a file next to the pool, and each engine's manager keeps a local dict up to date from it:

* a **slot table**: one 64-byte entry (a cache line) per pool slot (key, namespace, state,
  flags, and one aligned 8-byte *ident* word: the writer generation in its low half, a tag of
  the key in its high half), written under a per-entry sequence lock (odd while being written;
  the lock word is never zeroed or rewritten with the fields), and
* a **change ring**: the slot number of every entry write, in order. Its write position
  (``head``) is the index **epoch**. A reader applies ``ring[applied:head]`` by re-reading those
  entries (one integer read when nothing changed); a reader that fell a whole ring behind
  rescans the table. Re-reading the latest entry makes replays idempotent.

Chosen over an open-addressing table read in place: a probe in shared memory from Python costs
a few microseconds per key (hash, unpack, compare), a local dict ~50 ns, and vLLM asks ~50-80
keys per 32k-token request. The ring costs one integer per change and the reader's dict the
keys of its own namespace only.

**Generations.** A slot's ``gen`` grows each time the slot is handed to a new writer, and when
a grant is revoked. A worker that copied slot ``s`` expecting ident ``(g, tag(key))`` checks the
ident word, one aligned 8-byte load that cannot tear, after the copy (and that no newer daemon
superseded this file): if the slot was handed on meanwhile, the bytes may be another block's and
the load is reported as failed, never used.

**Ordering.** Entry writes: seq odd, store-store fence, fields, store-store fence, seq even,
ring slot, store-store fence, head. Readers mirror it with load-load fences (``fence.py``; the
argument is in docs/architecture.md, "Memory ordering").

**Heartbeat.** The daemon stamps ``CLOCK_MONOTONIC`` (one clock for every process on the host)
into the header several times a second; a reader that sees a stale stamp treats the daemon as
down and answers MISS, without sending anything.

**Sessions.** Each index-reading engine session gets its own small file (``session_file.py``):
its reader record (written by that engine alone) and the lock its writers hold while they copy.

Layout (little-endian): a 4 KiB header, the table, then the ring of ``ring_capacity`` u32.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import time
import zlib
from pathlib import Path

import numpy as np
from kvoffload.daemon.store import fence
from kvoffload.daemon.store import private_files as pf

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
# seq (odd while written), namespace, state, flags, ident (gen | tag << 32), key length, key
ENTRY = struct.Struct("<IHBBQB7x40s")
ENTRY_BYTES = ENTRY.size  # 64: one cache line
SEQ_WORD, IDENT_OFFSET = 0, 8  # offsets in an entry (4- and 8-byte aligned)
_FIELDS = struct.Struct("<HBB")  # at entry + 4: never covers the sequence word
_KEY = struct.Struct("<B7x40s")  # at entry + 16
SEQ = struct.Struct("<I")
U64 = struct.Struct("<Q")
GEN_MASK = 0xFFFFFFFF
# Earmarked grants (``daemon/store/earmarks.py``): a slot granted while it still holds a READY
# block is written only once the daemon has handed it over (its generation moves from the one
# before the grant's to the grant's). The daemon hands over no later than HANDOVER_S after the
# claim's stamp (else it burns the grant: the generation skips the granted one); a worker
# waits HANDOVER_WAIT_S from the same stamp, so once it gives up no handover can follow.
# Twice the 0.25 s a stuck reader may hold reclamation (reclaim.HOLD_S): one stuck engine
# delays the others' handovers, it does not burn them.
HANDOVER_S = 0.5
HANDOVER_WAIT_S = 2 * HANDOVER_S

# Entry states (what a reader acts on). FREE entries carry no key.
FREE, PENDING, READY = 0, 1, 2
# Entry flags.
FLAG_TAIL = 1
FLAG_NOT_WORTH = 2  # a tail that cannot repay its load under the namespace's time model


def key_tag(key: bytes | None) -> int:
    """32 bits of a key, never 0 for a key: the ident word binds a generation to its key."""
    return (zlib.crc32(key) | 1) if key else 0


def ident(gen: int, key: bytes | None) -> int:
    """The ident word a worker checks: generation and key tag in one aligned 8-byte load."""
    return (gen & GEN_MASK) | key_tag(key) << 32


def index_path_for(pool_path: str | Path) -> Path:
    return Path(f"{pool_path}.index")


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
        if os.fstat(fd).st_size < HEADER_BYTES:
            return False
        with mmap.mmap(fd, HEADER_BYTES) as mm:
            if mm[:8] != MAGIC:
                return False  # not an index: left as it is (creating ours then refuses it)
            (flags,) = SEQ.unpack_from(mm, FLAGS_OFFSET)
            SEQ.pack_into(mm, FLAGS_OFFSET, flags | FLAG_SUPERSEDED)
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)
    return True


class SharedIndexWriter:
    """The daemon's side: creates the file and writes every slot change into it."""

    def __init__(self, path: str | Path, num_slots: int, daemon_id: str) -> None:
        self.path = Path(path)
        self.num_slots = num_slots
        self.ring_capacity = ring_capacity_for(num_slots)
        self._ring_off = HEADER_BYTES + num_slots * ENTRY_BYTES
        supersede(self.path)
        size = file_bytes(num_slots)
        # Readable by the engines (which run as other users in some deployments: the same
        # rule as the pool file), written by the daemon alone. Created fresh (private_files):
        # a file or symlink planted at this path is refused in one line, never used.
        fd = pf.create_private(self.path, size, kind=pf.KIND_INDEX, setting="pool_path",
                               what="shared index", legacy=pf.starts_with(MAGIC))
        try:
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        # Word views: one numpy item assignment is one aligned store of that width.
        self._u32 = np.frombuffer(self._mm, dtype="<u4")
        self._u64 = np.frombuffer(self._mm, dtype="<u8", count=size // 8)
        self.head = 0
        HEADER.pack_into(self._mm, 0, MAGIC, VERSION, 0, num_slots, self.ring_capacity, 0,
                         now_ns(), daemon_id.encode()[:32])

    @property
    def bytes_per_slot(self) -> float:
        return file_bytes(self.num_slots) / max(1, self.num_slots)

    def write(self, slot: int, gen: int, ns: int, state: int, flags: int,
              key: bytes | None) -> None:
        """Publish one slot's new state, then append it to the ring (the epoch moves)."""
        mm, off = self._mm, HEADER_BYTES + slot * ENTRY_BYTES
        k = key if key is not None and len(key) <= KEY_MAX else b""
        word = off // 4
        seq = int(self._u32[word]) & ~1
        self._u32[word] = (seq + 1) & GEN_MASK  # odd: readers retry
        fence.store_store()  # the odd word is visible before any field changes
        _FIELDS.pack_into(mm, off + 4, ns, state, flags)
        self._u64[(off + IDENT_OFFSET) // 8] = ident(gen, k)
        _KEY.pack_into(mm, off + 16, len(k), k)
        fence.store_store()  # every field is visible before the word is even again
        self._u32[word] = (seq + 2) & GEN_MASK
        self._u32[(self._ring_off // 4) + self.head % self.ring_capacity] = slot
        fence.store_store()  # the entry and its ring record before the head that covers them
        self.head += 1
        self._u64[HEAD_OFFSET // 8] = self.head

    def heartbeat(self) -> None:
        self._u64[HEARTBEAT_OFFSET // 8] = now_ns()

    def close(self, *, remove: bool = True) -> None:
        with contextlib.suppress(ValueError, OSError):
            (flags,) = SEQ.unpack_from(self._mm, FLAGS_OFFSET)
            # Readers must stop trusting it: no daemon answers for these slots any more.
            SEQ.pack_into(self._mm, FLAGS_OFFSET, flags | FLAG_SUPERSEDED)
            del self._u32, self._u64
            self._mm.close()
        if remove:
            self.path.unlink(missing_ok=True)
