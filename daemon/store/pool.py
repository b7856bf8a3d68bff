"""The shared-memory pool: one file, mapped once, split into equal slots.

Clients map the same file and copy into and out of slots themselves; the daemon only hands out
slot numbers. The file is locked (flock) for the daemon's lifetime so a second daemon on the
same path fails at once instead of corrupting the first one's blocks. Pages are touched at
start: first touch of a fresh /dev/shm page costs 10-30x a copy into a touched one, and that
cost must never land on an engine's copy path.

The file is the daemon's own (``private_files.py``): created fresh, ending with kvoffload's
mark after the ``pool_bytes`` engines map. A file a previous daemon of this user left (kill -9,
or kept with a state dir) is reused in place, same inode, so a warm restart finds its blocks
and engines keep their mapping; it is never made smaller in place: an engine still mapping
the old size would die of SIGBUS on its next touch past the new end. A smaller pool, or a
file whose mode was widened (someone else may hold it open), gets a new file instead.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
from array import array
from collections.abc import Iterable
from pathlib import Path

from kvoffload.daemon.preflight import StartFault, check_space, human, remove_folders, secure_dir
from kvoffload.daemon.store import private_files as pf

log = logging.getLogger("kvoffload.daemon")

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_SETTING, _WHAT = "pool_path", "pool file"


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
        self.created = False  # this run made the file (a refused start removes it again)
        self.made_dirs: list[Path] = []  # folders this run created for it

    @property
    def mapped(self) -> bool:
        return self._mm is not None

    def open(self) -> None:
        """Create (or verify and reuse) the pool file, lock it, check that its filesystem
        can hold it, then size, map and pre-fault it. Raises ``StartFault`` with one line;
        on failure nothing is left behind (a file or folder this call created is removed)."""
        self.made_dirs = secure_dir(self.path.parent, _SETTING)
        fd = None
        try:
            fd = self._acquire()
            self._mm = mmap.mmap(fd, self.pool_bytes, mmap.MAP_SHARED)
            if self.prefault:
                self._touch_all()
        except BaseException:
            if self._mm is not None:
                self._mm.close()
                self._mm = None
            if fd is not None:
                if self.created:
                    pf.remove(self.path, fd)  # while locked: no other daemon adopted it
                os.close(fd)
            self.created = False
            remove_folders(self.made_dirs)
            raise
        self._fd = fd

    def _acquire(self) -> int:
        """A locked descriptor of a pool file of ours that holds ``pool_bytes``."""
        for _ in range(3):
            try:
                old = pf.open_locked(self.path, setting=_SETTING, what=_WHAT)
            except pf.FileLocked as exc:
                raise PoolInUse(f"pool_path {self.path} is locked by {exc.holder} (another "
                                "kvoffload daemon): stop it or choose another --pool-path"
                                ) from None
            try:
                if old is not None:
                    pf.check_ours(old, self.path, kind=pf.KIND_POOL, setting=_SETTING,
                                  what=_WHAT)
                    why = self._not_reusable(old)
                    if why is None:
                        self._grow(old)
                        return old
                    log.warning("pool_path %s: %s; creating a new pool file (engines still "
                                "mapping the old one keep it until they map the new one)",
                                self.path, why)
                prev, old = old, None  # create_private closes it, whatever happens
                fd = pf.create_private(self.path, self.pool_bytes, kind=pf.KIND_POOL,
                                       setting=_SETTING, what=_WHAT, replacing=prev,
                                       lock=True, prepare=self._reserve)
            except pf.FileAppeared:
                continue  # another daemon created one meanwhile: its lock decides
            except BaseException:
                if old is not None:
                    os.close(old)
                raise
            self.created = True
            return fd
        raise pf.PrivateFileError(f"pool_path {self.path}: the pool file keeps changing while "
                                  "the daemon starts: another process creates and removes it")

    def _not_reusable(self, fd: int) -> str | None:
        """Why a pool file of ours must not be reused in place, or None."""
        st = os.fstat(fd)
        if stat.S_IMODE(st.st_mode) & 0o077:
            # Created 0600: a wider mode means someone chmodded it, and whoever opened it
            # meanwhile keeps a descriptor no chmod takes away. Narrowing is not enough.
            return (f"its mode was widened to {stat.S_IMODE(st.st_mode):o}, so another user "
                    "may hold it open")
        data = st.st_size - pf.MARK_BYTES
        if data > self.pool_bytes:
            return (f"it holds {human(data)} and pool_bytes is {human(self.pool_bytes)}: a file "
                    "engines map is never made smaller (they would die of SIGBUS)")
        return None

    def _grow(self, fd: int) -> None:
        """Reuse a file of ours: reserve its pages again, larger if pool_bytes grew (growing
        in place is safe: mappings of the old size stay valid)."""
        old = os.fstat(fd).st_size - pf.MARK_BYTES
        try:
            self._reserve(fd)
            if old != self.pool_bytes:
                os.pwrite(fd, bytes(pf.MARK_BYTES), old)  # the old mark is slot bytes now
            pf.write_mark(fd, self.pool_bytes, pf.KIND_POOL)
        except OSError as exc:
            raise StartFault(f"pool_path {self.path}: cannot size the pool file: "
                             f"{exc.strerror or exc}") from None

    def _reserve(self, fd: int) -> None:
        """With pre-faulting, reserve the whole file (a fs that fills up meanwhile is ENOSPC
        here, not a SIGBUS on first touch); without it, only set the size."""
        total = self.pool_bytes + pf.MARK_BYTES
        check_space(fd, self.path, total)
        if os.fstat(fd).st_size < self.pool_bytes:
            os.ftruncate(fd, self.pool_bytes)  # never smaller: the caller checked
        if not self.prefault:
            return
        try:
            os.posix_fallocate(fd, 0, total)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise StartFault(f"pool_bytes {human(self.pool_bytes)}: the filesystem of "
                                 f"{self.path} ran out of space while reserving it: lower "
                                 "--pool-bytes or make room") from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise

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

    def problem(self) -> str | None:
        """Why engines cannot map this pool now (its file was removed or replaced), or None."""
        if self._fd is None:
            return "the pool file is not open"
        if not pf.names(self.path, self._fd):
            return (f"the pool file {self.path} was removed or replaced after the daemon "
                    "created it (engines map the path): restart the daemon")
        return None

    def close(self, *, remove: bool) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                log.warning("pool still has exported views; leaving the mapping to the OS")
            self._mm = None
        if self._fd is not None:
            if remove:
                pf.remove(self.path, self._fd)  # ours only, and while the lock is held
            os.close(self._fd)  # releases the flock
            self._fd = None
