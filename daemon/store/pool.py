"""The shared-memory pool: one file, mapped once, split into equal slots.

Clients map the same file and copy into and out of slots themselves; the daemon only hands out
slot numbers. The file is locked (flock) for the daemon's lifetime so a second daemon on the
same path fails at once instead of corrupting the first one's blocks. Pages are touched at
start: first touch of a fresh /dev/shm page costs 10-30x a copy into a touched one, and that
cost must never land on an engine's copy path.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
from array import array
from collections.abc import Iterable
from pathlib import Path

from kvoffload.daemon.preflight import (
    StartFault,
    check_space,
    held_by,
    human,
    open_owned,
    secure_dir,
)

log = logging.getLogger("kvoffload.daemon")

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class PoolInUse(StartFault):
    """Another live process holds the pool file."""


class Pool:
    def __init__(self, path: str, pool_bytes: int, *, prefault: bool = True) -> None:
        self.path = Path(path)
        self.pool_bytes = pool_bytes
        self.prefault = prefault
        self.slot_bytes = 0
        self.num_slots = 0
        self._free = array("I")
        self._fd: int | None = None
        self._mm: mmap.mmap | None = None

    @property
    def mapped(self) -> bool:
        return self._mm is not None

    def open(self) -> None:
        """Create (or verify and reuse) the pool file, lock it, check that its filesystem
        can hold it, then size, map and pre-fault it. Raises ``StartFault`` with one line;
        on failure nothing is left behind (a file this call created is removed)."""
        secure_dir(self.path.parent, "pool_path")
        fd, created = open_owned(self.path, "pool_path", "pool file")
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise PoolInUse(f"pool_path {self.path} is locked by {held_by(fd)} (another "
                                "kvoffload daemon): stop it or choose another --pool-path"
                                ) from None
            check_space(fd, self.path, self.pool_bytes)
            self._size(fd)
            self._mm = mmap.mmap(fd, self.pool_bytes, mmap.MAP_SHARED)
            if self.prefault:
                self._touch_all()
        except BaseException:
            if self._mm is not None:
                self._mm.close()
                self._mm = None
            if created:
                self.path.unlink(missing_ok=True)
            os.close(fd)
            raise
        self._fd = fd

    def _size(self, fd: int) -> None:
        """With pre-faulting, reserve the whole file (a fs that fills up meanwhile is ENOSPC
        here, not a SIGBUS on first touch); without it, only set the size."""
        if os.fstat(fd).st_size > self.pool_bytes:
            os.ftruncate(fd, self.pool_bytes)  # a smaller pool than last run: shrink first
        if not self.prefault:
            os.ftruncate(fd, self.pool_bytes)
            return
        try:
            os.posix_fallocate(fd, 0, self.pool_bytes)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise StartFault(f"pool_bytes {human(self.pool_bytes)}: the filesystem of "
                                 f"{self.path} ran out of space while reserving it: lower "
                                 "--pool-bytes or make room") from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, self.pool_bytes)  # fallocate unsupported: size only

    def _touch_all(self) -> None:
        assert self._mm is not None
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE)
            return
        except (OSError, ValueError):
            pass  # kernels before 5.14: touch one byte per page by hand
        page = mmap.PAGESIZE
        mv = memoryview(self._mm)
        for off in range(0, self.pool_bytes, page):
            mv[off] = mv[off]
        mv.release()

    def configure(self, slot_bytes: int) -> None:
        """Fix the slot size (once); every slot is free afterwards."""
        if slot_bytes <= 0 or slot_bytes > self.pool_bytes:
            raise ValueError(f"slot size {slot_bytes} does not fit a pool of {self.pool_bytes}")
        self.slot_bytes = slot_bytes
        self.num_slots = self.pool_bytes // slot_bytes
        # Hand out low slots first: pop() from the end of a reversed array. An array of
        # 4-byte cells, not a list of int objects: 4 MB instead of ~36 MB at 1M slots.
        self._free = array("I", range(self.num_slots - 1, -1, -1))

    @property
    def configured(self) -> bool:
        return self.slot_bytes > 0

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def claim(self, slots: Iterable[int]) -> None:
        """Take slots recovered at start out of the free list (keeps low-first order)."""
        taken = set(slots)
        self._free = array("I", (s for s in self._free if s not in taken))

    def view(self, slot: int) -> memoryview:
        """The bytes of one slot (for tests and checksums; clients map the file themselves)."""
        assert self._mm is not None
        start = slot * self.slot_bytes
        return memoryview(self._mm)[start:start + self.slot_bytes]

    def close(self, *, remove: bool) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                log.warning("pool still has exported views; leaving the mapping to the OS")
            self._mm = None
        if self._fd is not None:
            if remove:
                self.path.unlink(missing_ok=True)
            os.close(self._fd)  # releases the flock
            self._fd = None
