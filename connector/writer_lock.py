"""A worker's hold on its engine session's writers' lock while it copies into pool slots.

The daemon revokes a departed session's grants (new generation, ``daemon/store/reclaim.py``)
and gives the slots to another writer only once no process holds ``flock(LOCK_SH)`` on that
session's file (``daemon/store/session_file.py``). A worker therefore takes the lock *before*
its generation pre-check and keeps it until the copy is complete: a copy that passed the check
can never overlap another writer's, however long it is frozen (SIGSTOP, a stuck CUDA stream),
and a dead worker's lock is dropped by the kernel.

Ordering: the daemon publishes the new generation, then tries ``LOCK_EX``; the worker takes
``LOCK_SH``, then reads the generation. The two ``flock`` calls serialize on the inode's lock in
the kernel (a full barrier on every CPU), so a worker whose lock follows the daemon's test reads
the new generation and writes nothing.

Jobs are counted per session: the lock is taken by the first job in flight and dropped with the
last one (``flock`` locks belong to the open file description, so jobs share one).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os

log = logging.getLogger("kvoffload.connector")


class WriterLocks:
    def __init__(self) -> None:
        self._held: dict[str, tuple[int, int]] = {}  # path -> (fd, jobs in flight)
        self.refused = 0  # jobs that could not take the lock (session gone or being revoked)

    def acquire(self, path: str) -> bool:
        """Count one job in flight under ``path``'s lock; False: the session is gone or
        being revoked right now, so nothing may be written for it."""
        held = self._held.get(path)
        if held is not None:
            self._held[path] = (held[0], held[1] + 1)
            return True
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            self.refused += 1
            return False  # the daemon removed it: the session ended
        try:
            # Never blocks: the daemon holds LOCK_EX only for the instant of its test, and a
            # refusal then means its grants are being revoked anyway.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            self.refused += 1
            return False
        self._held[path] = (fd, 1)
        return True

    def release(self, path: str) -> None:
        """One job under ``path`` is complete (its bytes are all written or abandoned)."""
        held = self._held.get(path)
        if held is None:
            return
        fd, jobs = held
        if jobs > 1:
            self._held[path] = (fd, jobs - 1)
            return
        del self._held[path]
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def jobs(self, path: str) -> int:
        held = self._held.get(path)
        return held[1] if held is not None else 0

    def close(self) -> None:
        for path in list(self._held):
            self._held[path] = (self._held[path][0], 1)
            self.release(path)
