"""Files the daemon keeps next to its pool (the pool, ``.index`` and its companions, the
control lock): created private, replaced only when a kvoffload daemon of this user made them.

Engines map these files, so whoever can plant one at the path before the daemon starts could
read or overwrite stored KV through a descriptor they opened first (chmod later narrows the
mode, not their descriptor), or make the daemon write through a symlink. So a file is never
adopted: it is created fresh (``O_CREAT|O_EXCL|O_NOFOLLOW``, 0600, under a temporary name,
published with ``link``, which fails rather than replace what appeared meanwhile), and a file
already at the path is acted on only when it is a regular file of this user with one link
and carries our **mark**: 16 bytes at its very end, ``KVOFILE1`` and the kind (``pool``,
``index``, ...). The mark sits after the bytes the file's readers use, so no offset of theirs
moves. Anything else is a ``PrivateFileError``: one line naming the setting, what is wrong
and the fix, and the file is left exactly as it was.

Locks (``lock=True``) are taken on the new file before it appears at the path, so no other
daemon can ever lock a file of ours first; an existing file is locked, then checked to be still
the one at the path (``open_locked``): a daemon that removed its file (a refused start) or
replaced it after we opened it must not leave us holding a lock on an unlinked inode.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from kvoffload.daemon.preflight import StartFault, held_by, secure_dir, user_name

MAGIC = b"KVOFILE1"
MARK_BYTES = 16  # MAGIC, then the kind padded to 8 bytes
KIND_POOL, KIND_INDEX, KIND_LOCK = b"pool", b"index", b"lock"  # any other: up to 8 bytes

# Recognizes a file an earlier daemon wrote before files carried a mark: (fd, its stat).
Legacy = Callable[[int, os.stat_result], bool]


class PrivateFileError(StartFault):
    """A file at a daemon path that the daemon may not use or replace; the message is the
    one line the operator sees."""


class FileAppeared(PrivateFileError):
    """Something appeared at the path while the daemon was creating its file there."""


class FileLocked(PrivateFileError):
    """Another process holds the lock on the file at the path (``holder``: who)."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"locked by {holder}")
        self.holder = holder


def mark(kind: bytes) -> bytes:
    assert 0 < len(kind) <= 8
    return MAGIC + kind.ljust(8, b"\0")


def starts_with(magic: bytes) -> Legacy:
    """A legacy file recognized by ``magic`` at its start (the shared index's header)."""
    def check(fd: int, st: os.stat_result) -> bool:
        return st.st_size >= len(magic) and os.pread(fd, len(magic), 0) == magic
    return check


def empty(fd: int, st: os.stat_result) -> bool:
    """A legacy lock file: earlier daemons created it empty."""
    return st.st_size == 0


def has_mark(fd: int, kind: bytes) -> bool:
    size = os.fstat(fd).st_size
    return size >= MARK_BYTES and os.pread(fd, MARK_BYTES, size - MARK_BYTES) == mark(kind)


def write_mark(fd: int, at: int, kind: bytes) -> None:
    """Put the mark at byte ``at``; the file ends right after it. Written before anything
    past it is cut, so the file never goes without a mark (a crash in between)."""
    if os.pwrite(fd, mark(kind), at) != MARK_BYTES:
        raise OSError(errno.EIO, "short write of the file's mark")
    os.ftruncate(fd, at + MARK_BYTES)


def names(path: Path, fd: int) -> bool:
    """Whether ``path`` (not followed) is the file open as ``fd``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def open_existing(path: Path, *, setting: str, what: str) -> int | None:
    """A read-write descriptor of the file already at ``path``, or None when there is none.
    Raises ``PrivateFileError`` unless it is a regular file (not a symlink) of this user with
    no other hard link: only then may the daemon touch it at all."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise PrivateFileError(f"{setting} {path}: the {what} is a symlink; refusing to follow "
                               "it: remove it or choose another path")
    if not stat.S_ISREG(st.st_mode):
        raise PrivateFileError(f"{setting} {path}: the {what} is not a regular file: remove "
                               "it or choose another path")
    try:  # O_NONBLOCK: a FIFO swapped in since the lstat must not hang the start
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PrivateFileError(f"{setting} {path}: the {what} is a symlink; refusing to "
                                   "follow it: remove it or choose another path") from None
        raise PrivateFileError(f"{setting} {path}: cannot open the {what}: "
                               f"{exc.strerror}") from None
    try:
        st = os.fstat(fd)
        why = ""
        if not stat.S_ISREG(st.st_mode):
            why = "is not a regular file"
        elif st.st_uid != os.geteuid():
            why = (f"belongs to {user_name(st.st_uid)}, not to this daemon's "
                   f"{user_name(os.geteuid())}; another user may have created it to read or "
                   "replace what is in it")
        elif st.st_nlink != 1:
            why = (f"has {st.st_nlink} hard links; another name for it would keep what the "
                   "daemon stores reachable")
        if why:
            raise PrivateFileError(f"{setting} {path}: the {what} {why}: remove it or choose "
                                   f"another {setting}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_ours(fd: int, path: Path, *, kind: bytes, setting: str, what: str,
               legacy: Legacy | None = None) -> None:
    """Refuse (one line) a file that carries no mark of ``kind`` (nor the ``legacy`` form)."""
    if has_mark(fd, kind) or (legacy is not None and legacy(fd, os.fstat(fd))):
        return
    raise PrivateFileError(f"{setting} {path}: the {what} was not created by a kvoffload "
                           "daemon (it does not end with kvoffload's mark), so it is left as "
                           f"it is: remove it if it is a leftover, or choose another {setting}")


def check_previous(path: Path, *, kind: bytes, setting: str, what: str,
                   legacy: Legacy | None = None) -> bool:
    """Whether a file of ours (``kind``) is at ``path``; raises ``PrivateFileError`` when a
    file is there that the daemon may not replace. Changes nothing."""
    fd = open_existing(path, setting=setting, what=what)
    if fd is None:
        return False
    try:
        check_ours(fd, path, kind=kind, setting=setting, what=what, legacy=legacy)
    finally:
        os.close(fd)
    return True


def problem(path: Path, *, kind: bytes, setting: str, what: str,
            legacy: Legacy | None = None) -> str | None:
    """Why the file at ``path`` is not a usable one of ours (for /readyz), or None."""
    try:
        if not check_previous(path, kind=kind, setting=setting, what=what, legacy=legacy):
            return f"the {what} {path} does not exist"
    except PrivateFileError as exc:
        return str(exc)
    return None


def open_locked(path: Path, *, setting: str, what: str) -> int | None:
    """The file at ``path`` (see ``open_existing``), exclusively flock-ed, or None when there
    is none. Raises ``FileLocked`` when another process holds it."""
    for _ in range(3):
        fd = open_existing(path, setting=setting, what=what)
        if fd is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = held_by(fd)
            os.close(fd)
            raise FileLocked(holder) from None
        if names(path, fd):
            return fd
        os.close(fd)  # removed or replaced after we opened it: look again
    raise PrivateFileError(f"{setting} {path}: the {what} keeps changing while the daemon "
                           "starts: another process creates and removes it; stop it")


def create_private(path: Path, size: int, *, kind: bytes, setting: str, what: str,
                   replacing: int | None = None, lock: bool = False,
                   prepare: Callable[[int], None] | None = None,
                   legacy: Legacy | None = None) -> int:
    """Create ``path`` anew and return a read-write descriptor of it.

    The file holds ``size`` bytes for its users (zeros), then the 16-byte mark of ``kind``
    (``MARK_BYTES``): map ``size`` bytes, or the whole file. It is created 0600 with
    ``O_CREAT|O_EXCL|O_NOFOLLOW`` under a temporary name in the same folder (which must pass
    ``preflight.secure_dir``: checked here), sized, marked, flock-ed when ``lock``, and only
    then published at ``path``.

    A file already at ``path`` is removed first only if it is ours: a regular file of this
    user with one link, ending with the mark of ``kind`` (or matching ``legacy``, the form an
    earlier daemon wrote). Anything else raises ``PrivateFileError`` (one line) and is left
    untouched. ``replacing``: a descriptor the caller opened on the file now at ``path`` and
    checked (``open_locked`` + ``check_ours``); it is unlinked if ``path`` still names it and
    then closed (so its space counts as free while the new file is sized). ``prepare(fd)``
    sizes the data part itself instead of ``ftruncate(size)`` (the pool reserves its pages);
    it may raise its own ``StartFault``. Raises ``FileAppeared`` when something took the path
    meanwhile. On failure nothing new is left behind (a file it replaced is gone already).
    """
    if replacing is not None:
        try:
            with contextlib.suppress(FileNotFoundError):
                if names(path, replacing):
                    path.unlink()
        finally:
            os.close(replacing)
    secure_dir(path.parent, setting)
    if replacing is None and check_previous(path, kind=kind, setting=setting, what=what,
                                            legacy=legacy):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:
        raise PrivateFileError(f"{setting} {path}: cannot create the {what}: "
                               f"{exc.strerror}") from None
    try:
        try:
            os.fchmod(fd, 0o600)  # whatever the umask: exactly owner read/write
            if prepare is not None:
                prepare(fd)
            write_mark(fd, size, kind)
            if lock:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new inode: nobody has it
            os.link(tmp, path)  # never replaces: what appeared meanwhile is not ours
        except FileExistsError:
            raise FileAppeared(f"{setting} {path}: a file appeared there while the daemon "
                               f"was creating its {what}: another process is using the "
                               "path; stop it or choose another path") from None
        except OSError as exc:
            raise PrivateFileError(f"{setting} {path}: cannot create the {what}: "
                                   f"{exc.strerror or exc}") from None
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return fd


def open_lock(path: Path, *, setting: str, what: str) -> tuple[int, bool]:
    """A lock file at ``path``, flock-ed: ``(fd, created)``. Raises ``FileLocked`` when a
    live process holds it, ``PrivateFileError`` for a file that is not ours."""
    for _ in range(3):
        fd = open_locked(path, setting=setting, what=what)
        if fd is not None:
            try:
                check_ours(fd, path, kind=KIND_LOCK, setting=setting, what=what, legacy=empty)
            except BaseException:
                os.close(fd)
                raise
            return fd, False
        try:
            return create_private(path, 0, kind=KIND_LOCK, setting=setting, what=what,
                                  lock=True), True
        except FileAppeared:
            continue  # another daemon created it first: its lock decides
    raise PrivateFileError(f"{setting} {path}: the {what} keeps changing while the daemon "
                           "starts: another process creates and removes it; stop it")


def remove(path: Path, fd: int) -> None:
    """Unlink ``path`` if it is still the file open as ``fd`` (never someone else's)."""
    with contextlib.suppress(OSError):
        if names(path, fd):
            path.unlink()
