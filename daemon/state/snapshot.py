"""The state-dir file format and recovery: framed records, snapshot state, slot validation.

Written by ``daemon/state/journal.py``'s writer; read back at start by ``recover_state`` there. See
``docs/reliability.md`` for the format.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import stat
import struct
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from kvoffload.daemon.base import Geometry
from kvoffload.daemon.control.errors import MAX_KEY_BYTES, RequestError
from kvoffload.daemon.control.registration import MAX_NAMESPACES, validate_geometry
from kvoffload.daemon.store.index import BlockIndex, Namespace
from kvoffload.daemon.store.pool import Pool

log = logging.getLogger("kvoffload.daemon")

VERSION = 1
SNAPSHOT = "index.snapshot"
JOURNAL = "index.journal"
_FRAME = struct.Struct("<II")  # payload length, crc32 of the payload
_MAX_RECORD = 1 << 20  # a longer length field is garbage: resynchronise after it
_TAGS = frozenset("HNCD")
_U32 = 1 << 32
# A state dir is untrusted input: its slot size may not make the pool hold more slots than a
# client could make it (service.py bounds a first engine's block the same way), else one
# crafted header would make every start allocate bookkeeping for billions of slots.
MAX_RECOVERED_SLOTS = 1 << 21
# Longer than any file a daemon writes (2M blocks of ~100-byte records, a journal compacted at
# twice that): a larger one is not read into memory.
MAX_STATE_FILE = 1 << 30
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


def _record_at(data: memoryview, off: int) -> tuple[list[Any], int] | None:
    """The record framed at ``off`` and the offset after it, or None if none is there."""
    if off + _FRAME.size > len(data):
        return None
    n, crc = _FRAME.unpack_from(data, off)
    start = off + _FRAME.size
    if n > _MAX_RECORD or start + n > len(data):
        return None
    payload = data[start:start + n]
    if zlib.crc32(payload) != crc:
        return None
    try:
        rec = _dec.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(rec, list) or not rec or rec[0] not in _TAGS:
        return None
    return rec, start + n


class StateFileError(Exception):
    """A state file that cannot be read as one (not a regular file, too large): the whole
    state dir is unusable, which ``state_dir_errors`` turns into a refusal or a cold start."""


def _read_file(path: Path) -> bytes | None:
    """The file's bytes, or None when it does not exist. Opened without following a symlink
    and without blocking (a FIFO planted there would hang the start, /dev/zero fill memory)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StateFileError(f"{path.name} is a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateFileError(f"{path.name} is not a regular file")
        if st.st_size > MAX_STATE_FILE:
            raise StateFileError(f"{path.name} is {st.st_size} bytes, more than any state "
                                 f"file a daemon writes ({MAX_STATE_FILE})")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(MAX_STATE_FILE + 1)
    finally:
        os.close(fd)


def read_records(path: Path) -> tuple[list[list[Any]], int]:
    """All intact records of a file and how many damaged stretches were skipped.

    A frame that fails (checksum, impossible length, not a record) is skipped by scanning
    forward, byte by byte, to the next offset where a whole valid frame starts: one flipped
    length byte costs one record, not the rest of the file. A torn tail (a crash mid-write)
    has no valid frame after it and ends the file. A valid frame found by the scan is as
    trustworthy as any other (its own crc32 holds), and replay validates every block against
    the pool's bytes anyway.
    """
    raw = _read_file(path)
    if raw is None:
        return [], 0
    data = memoryview(raw)
    out: list[list[Any]] = []
    bad = off = 0
    while off < len(data):
        got = _record_at(data, off)
        if got is not None:
            out.append(got[0])
            off = got[1]
            continue
        bad += 1  # a damaged stretch: find where the next record starts
        off += 1
        while off < len(data) and (got := _record_at(data, off)) is None:
            off += 1
    return out, bad


def _u(v: Any, bound: int = _U32) -> bool:
    """A non-negative int below ``bound`` (bool is an int to Python; not here)."""
    return type(v) is int and 0 <= v < bound


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
        """Apply one record; one of the wrong shape or types is skipped and counted.

        Every field is type-checked, never coerced: the files are input like any other
        (``bytes(10**12)`` of a crafted key would allocate a terabyte)."""
        if not self._valid(rec):
            self.skipped += 1
            return
        tag = rec[0]
        if tag == "H":
            _, _version, self.epoch, self.slot_bytes, self.pool_bytes = rec
        elif tag == "N":
            self.geometries[rec[1]] = rec[2]
        elif tag == "C":
            _, ns, key, slot, end, tail, crc = rec
            self.commit(Entry(ns, key, slot, end, tail, crc))
        else:
            _, ns, key, slot = rec
            e = self.live.get((ns, key))
            if e is not None and e.slot == slot:
                del self.live[(ns, key)]
                self.by_slot.pop(slot, None)

    @staticmethod
    def _valid(rec: list[Any]) -> bool:
        tag = rec[0] if rec else None
        if tag == "H":
            return len(rec) == 5 and rec[1] == VERSION and all(_u(v, 1 << 63) for v in rec[2:])
        if tag == "N":
            return len(rec) == 3 and _u(rec[1], 1 << 16) and isinstance(rec[2], bytes)
        if tag in ("C", "D"):
            if len(rec) != (7 if tag == "C" else 4) or not _u(rec[1], 1 << 16) or \
                    not isinstance(rec[2], bytes) or not 4 < len(rec[2]) <= MAX_KEY_BYTES or \
                    not _u(rec[3]):
                return False
            return tag == "D" or (_u(rec[4]) and type(rec[5]) is bool and _u(rec[6]))
        return False

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
    if journal and journal[0][0] == "H" and State._valid(journal[0]):
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
    a different slot layout, so nothing of it can be trusted. Everything ``restore`` relies
    on is checked here, before the index changes: a namespace name holds one geometry (the
    lowest namespace id of a name wins, the others' blocks are discarded), a key is in one
    namespace once and names one of its groups, a slot holds one block.
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
    geoms, why = _namespaces(state, pool, {e.ns for e in entries})
    candidates: list[tuple[Geometry, Entry]] = []
    seen: set[int] = set()
    names: set[tuple[str, bytes]] = set()
    for e in entries:
        geom = geoms.get(e.ns)
        if geom is None:
            discarded[why[e.ns]] += 1
        elif not 0 <= e.slot < pool.num_slots or e.slot in seen:
            discarded["slot_range"] += 1
        elif not _key_of(geom, e.key):
            discarded["key"] += 1
        elif (geom.namespace, e.key) in names:  # two ids of one name: the key once
            discarded["duplicate"] += 1
        else:
            seen.add(e.slot)
            names.add((geom.namespace, e.key))
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


def _namespaces(state: State, pool: Pool, ids: set[int]
                ) -> tuple[dict[int, Geometry], dict[int, str]]:
    """The usable geometry of each namespace id, and why each other id is not usable."""
    geoms: dict[int, Geometry] = {}
    why: dict[int, str] = {}
    by_name: dict[str, Geometry] = {}
    for ns in sorted(ids):  # the lowest id of a name first: the same winner at every start
        g = _geometry(state, ns, pool.slot_bytes)
        if g is None:
            why[ns] = "geometry"
        elif by_name.setdefault(g.namespace, g) != g:
            why[ns] = "geometry_conflict"  # Register would refuse the second one too
        elif len(by_name) > MAX_NAMESPACES:
            del by_name[g.namespace]
            why[ns] = "namespaces"
        else:
            geoms[ns] = g
    return geoms, why


def _geometry(state: State, ns: int, slot_bytes: int) -> Geometry | None:
    """Namespace ``ns``'s recorded geometry if it passes Register's checks and fits a slot."""
    try:
        g = _geom_dec.decode(state.geometries[ns])
        validate_geometry(g, 0)
        return g if 0 < g.slot_bytes() <= slot_bytes else None
    except (KeyError, msgspec.DecodeError, msgspec.ValidationError, RequestError, ValueError,
            ZeroDivisionError, TypeError, OverflowError):
        return None


def fits_any(state: State, slot_bytes: int) -> bool:
    """Whether a block of the state could be kept in slots of ``slot_bytes``: a state that
    holds none must not size the pool (the first engine does, as on a cold start)."""
    return any(_geometry(state, ns, slot_bytes) is not None
               for ns in {e.ns for e in state.live.values()})


def _key_of(g: Geometry, key: bytes) -> bool:
    """The key names one of the geometry's groups (the metrics and events look it up)."""
    try:
        g.group_pos(key)
        return True
    except ValueError:
        return False


def slot_checksum(pool: Pool, slot: int) -> int:
    with pool.view(slot) as mv:  # released at once: a live view would block pool.close
        return checksum(mv)


def restore(index: BlockIndex, recovery: Recovery) -> list[tuple[Namespace, bytes, int]]:
    """Re-admit validated blocks as READY; returns (namespace, key, slot) of each.

    Namespaces first, then the slots leave the free list, then the blocks: nothing here can
    fail on what ``validate`` passed, and no slot is ever READY while it is still free."""
    spaces = {id(geom): index.namespace(geom) for geom, _ in recovery.good}
    index.pool.claim(e.slot for _, e in recovery.good)
    out: list[tuple[Namespace, bytes, int]] = []
    for geom, e in recovery.good:
        ns = spaces[id(geom)]
        index.restore(ns, e.key, e.slot, e.end_token, e.tail)
        out.append((ns, e.key, e.slot))
    return out
