"""Checks the daemon makes before it takes any resource, each ending in one line that names
the setting, the cause and the fix (raised as ``StartFault``; the CLI prints it and exits 1).

- Files and folders the daemon uses are its own: created by it (``O_EXCL``, mode 0600/0700)
  or, when they already exist, verified (not a symlink, the right type, owned by this user,
  not writable by others). A local user who pre-creates the pool file could otherwise read
  and overwrite stored KV; one who pre-creates the control folder could put an impostor
  socket in it.
- A lock held by someone else is reported with the holder's pid (from ``/proc/locks``).
- A pool larger than its filesystem's free space is refused before the file is sized: on
  tmpfs the first touch of a page beyond the limit is a SIGBUS, not an error.
- The state dir is probed (type, read-only, full) before recovery, so a bad one can make a
  cold start with a warning instead of a traceback (``state_dir_errors``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat
from pathlib import Path

# What a state dir needs at least to take a snapshot and some journal records.
STATE_DIR_MIN_FREE = 1 << 20


class StartFault(RuntimeError):
    """The daemon cannot start; the message is the one line the operator sees."""


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover - the loop always returns


def user_name(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def lock_holder(fd: int) -> int | None:
    """The pid holding a lock on the file behind ``fd``, if /proc/locks names one."""
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:2e:5678 0 EOF"; "->" marks a waiter.
        if "->" in parts:
            continue
        for i, part in enumerate(parts):
            if part == want and i > 0 and parts[i - 1].isdigit():
                pid = int(parts[i - 1])
                return pid if pid != os.getpid() else None
    return None


def held_by(fd: int) -> str:
    pid = lock_holder(fd)
    return f"pid {pid}" if pid is not None else "another process"


def _check_owned(st: os.stat_result, path: Path, what: str, setting: str) -> None:
    if st.st_uid != os.geteuid():
        raise StartFault(f"{setting} {path}: the {what} belongs to {user_name(st.st_uid)}, not "
                         f"to this daemon's {user_name(os.geteuid())}; another user may "
                         f"have created it to read or replace what is in it: remove it or "
                         f"choose another {setting}")


def secure_dir(path: Path, setting: str) -> None:
    """Create ``path`` (0700, parents too) or verify it: a real directory owned by us and not
    writable by others, or a shared sticky one like /tmp owned by root or us."""
    try:
        path.mkdir(mode=0o700, parents=True)
        return
    except FileExistsError:
        pass
    except OSError as exc:
        raise StartFault(f"{setting}: cannot create folder {path}: {exc.strerror}; create it "
                         "or choose another path") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise StartFault(f"{setting}: {path} is a symlink; the daemon only uses a folder it "
                         "owns: replace it with a real folder or choose another path")
    if not stat.S_ISDIR(st.st_mode):
        raise StartFault(f"{setting}: {path} is not a folder: remove it or choose another path")
    sticky = bool(st.st_mode & stat.S_ISVTX)
    if sticky and st.st_uid in (0, os.geteuid()):
        return  # /tmp-like: others cannot remove or rename what we create in it
    _check_owned(st, path, "folder", setting)
    if st.st_mode & 0o022:
        raise StartFault(f"{setting}: folder {path} is writable by other users (mode "
                         f"{stat.S_IMODE(st.st_mode):o}), so they could replace its socket: "
                         f"chmod 700 {path} or choose another path")


def open_owned(path: Path, setting: str, what: str) -> tuple[int, bool]:
    """Open (creating with O_EXCL, mode 0600) a file only this user can use; returns
    ``(fd, created)``. An existing file must be a regular file we own; its mode is narrowed
    to 0600."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600), True
    except FileExistsError:
        pass
    except OSError as exc:
        raise StartFault(f"{setting} {path}: cannot create the {what}: {exc.strerror}") from None
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StartFault(f"{setting} {path}: the {what} is a symlink; refusing to follow "
                             "it: remove it or choose another path") from None
        raise StartFault(f"{setting} {path}: cannot open the {what}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StartFault(f"{setting} {path}: the {what} is not a regular file: remove it "
                             "or choose another path")
        _check_owned(st, path, what, setting)
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o600)  # ours, but readable by others: no one else may map it
    except BaseException:
        os.close(fd)
        raise
    return fd, False


def check_space(fd: int, path: Path, size: int, setting: str = "pool_bytes") -> None:
    """Refuse a file of ``size`` bytes that its filesystem cannot hold (what it already holds
    of the file counts as available)."""
    vfs = os.fstatvfs(fd)
    free = vfs.f_bavail * vfs.f_frsize + os.fstat(fd).st_blocks * 512
    if size <= free:
        return
    hint = ""
    if str(path).startswith("/dev/shm/"):
        hint = ("; /dev/shm is a tmpfs that defaults to half of RAM, and in containers often "
                "to 64 MiB (docker --shm-size, or in Kubernetes a memory-backed emptyDir "
                "with sizeLimit: docs/operations.md)")
    raise StartFault(f"{setting} {human(size)} does not fit the filesystem of {path} "
                     f"({human(free)} free): lower --pool-bytes or make room{hint}")


def probe_state_dir(path: Path) -> str | None:
    """Why ``path`` cannot hold state, or None. Creates the folder when it is missing."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        try:
            path.mkdir(mode=0o700, parents=True)
        except OSError as exc:
            return f"cannot create it: {exc.strerror}"
        st = os.lstat(path)
    except OSError as exc:
        return exc.strerror or str(exc)
    if stat.S_ISLNK(st.st_mode) and not path.is_dir():
        return "it is a dangling symlink"
    if not path.is_dir():
        return "it is not a folder"
    vfs = os.statvfs(path)
    if vfs.f_flag & os.ST_RDONLY:
        return "its filesystem is read-only"
    if vfs.f_bavail * vfs.f_frsize < STATE_DIR_MIN_FREE:
        return f"its filesystem is full ({human(vfs.f_bavail * vfs.f_frsize)} free)"
    probe = path / f".probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"cannot write in it: {exc.strerror}"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def check_ipc_folders(endpoints: dict[str, str | None]) -> None:
    """Each ipc:// endpoint's folder must exist: ZMQ's own error names no setting."""
    for setting, ep in endpoints.items():
        if not ep or not ep.startswith("ipc://") or setting == "control":
            continue  # the control folder the daemon creates and secures itself
        folder = Path(ep[len("ipc://"):]).parent
        if not folder.is_dir():
            raise StartFault(f"--{setting.replace('_', '-')} {ep}: folder {folder} does not "
                             "exist: create it or choose an endpoint in an existing folder")
