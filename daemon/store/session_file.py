"""One engine session's file next to the shared index: its reader record and its writers' lock.

The daemon creates one per registered client that reads the index in place
(``<index>.s-<random>``, 0600, ``O_EXCL | O_NOFOLLOW``) and removes it when the session ends.
A file per session, never a slot in a shared table, so that:

* **a record is written by its engine alone**: no other client is told its name, and a record
  is never handed to a new session while an old owner may still write it (a frozen engine that
  wakes up writes into its own, forgotten file);
* **"its writers are gone" is a fact, not a timeout**: every process that copies into this
  session's grants (each TP rank's worker) holds ``flock(LOCK_SH)`` on the file from before
  its generation pre-check until its copy is complete. The daemon's ``writers_gone()`` is a
  non-blocking ``flock(LOCK_EX)``: it succeeds only when no such copy can still run, including
  after a SIGKILL (the kernel drops a dead process's locks) and never for a SIGSTOPped or stuck
  writer. Revoked grants stay quarantined until then (``reclaim.py``).

Record layout (little-endian, at offset 0): seq (odd while written), busy, epoch applied,
control messages sent -- written under the sequence lock by the scheduler thread -- then, in
its own aligned 8-byte word, the heartbeat the session's background thread stamps
(``CLOCK_MONOTONIC`` ns): an idle engine, which vLLM does not step, keeps its lease with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import struct
import time
from pathlib import Path

import numpy as np
from kvoffload.daemon.store import fence

RECORD = struct.Struct("<IIQQ")  # seq, busy, epoch, sent
HEARTBEAT_OFFSET = 24
FILE_BYTES = 64
PREFIX = ".s-"
CHECK_S = 0.02  # how often a lock is tried (a system call each)


def session_glob(index_path: str | Path) -> str:
    """The pattern of every session file of an index (an earlier daemon's included)."""
    p = Path(index_path)
    return f"{p.name}{PREFIX}*"


class PreviousSessions:
    """The session files a previous daemon of this index left (killed, so never removed),
    opened only to wait for their writers; each is removed once its lock is free. A symlink or
    a file too short to be one, planted under such a name, is removed, never followed."""

    def __init__(self, index_path: str | Path) -> None:
        self.files: list[SessionFile] = []
        self._next_check = 0.0
        for path in sorted(Path(index_path).parent.glob(session_glob(index_path))):
            try:
                self.files.append(SessionFile(index_path, path=path))
            except (OSError, ValueError):
                with contextlib.suppress(OSError):
                    path.unlink()

    def __len__(self) -> int:
        return len(self.files)

    def gone(self) -> bool:
        """True once none of their writers can still copy (tried at most every 20 ms)."""
        now = time.monotonic()
        if self.files and now >= self._next_check:
            self._next_check = now + CHECK_S
            keep = []
            for f in self.files:
                (f.close() if f.writers_gone() else keep.append(f))
            self.files = keep
        return not self.files


class SessionFile:
    """The daemon's handle on one session's file (it keeps the descriptor for the lock)."""

    def __init__(self, index_path: str | Path, *, path: str | Path | None = None) -> None:
        """Create a fresh session file next to ``index_path``, or (``path``) open one an
        earlier daemon left (only to wait for its writers)."""
        if path is None:
            for _ in range(8):  # a name taken (planted, or a collision) is skipped, never used
                name = f"{index_path}{PREFIX}{secrets.token_hex(8)}"
                try:
                    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                                 0o600)
                    break
                except FileExistsError:
                    continue
            else:
                raise OSError(f"cannot create a session file next to {index_path}")
            self.path = Path(name)
            os.ftruncate(fd, FILE_BYTES)
        else:
            self.path = Path(path)
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        self._fd = fd
        self._mm: mmap.mmap | None = mmap.mmap(fd, FILE_BYTES, mmap.MAP_SHARED)
        self._u64 = np.frombuffer(self._mm, dtype="<u8")

    def read(self) -> tuple[int, int, int] | None:
        """(busy, epoch, messages sent); None while it is being written (or torn)."""
        mm = self._mm
        if mm is None:
            return None
        for _ in range(8):
            (seq,) = struct.unpack_from("<I", mm, 0)
            fence.load_load()
            _, busy, epoch, sent = RECORD.unpack_from(mm, 0)
            fence.load_load()
            if not seq & 1 and struct.unpack_from("<I", mm, 0)[0] == seq:
                return busy, epoch, sent
        return None

    def heartbeat_ns(self) -> int:
        return int(self._u64[HEARTBEAT_OFFSET // 8]) if self._mm is not None else 0

    def writers_gone(self) -> bool:
        """True when no process holds the writers' lock: no copy into this session's grants
        can still run (a dead writer's lock is gone with it)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError:
            return False
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return True

    def unlink(self) -> None:
        """Remove the name (no new writer can open it); the lock stays testable."""
        with contextlib.suppress(OSError):
            self.path.unlink()

    def close(self, *, remove: bool = True) -> None:
        if self._mm is not None:
            del self._u64
            self._mm.close()
            self._mm = None
            os.close(self._fd)
        if remove:
            with contextlib.suppress(OSError):
                self.path.unlink()
