"""Checks the daemon makes before it takes any resource, each ending in one line that names
the setting, the cause and the fix (raised as ``StartFault``; the CLI prints it and exits 1).

- Folders the daemon uses are its own: created by it (0700) or, when they already exist,
  verified (not a symlink, a folder, owned by this user, not writable by others): one who
  pre-creates the control folder could otherwise put an impostor socket in it. Files next to
  the pool and the control lock are created fresh by ``store/private_files.py``.
- A lock held by someone else is reported with the holder's pid (from ``/proc/locks``).
- A pool larger than its filesystem's free space is refused before the file is sized: on
  tmpfs the first touch of a page beyond the limit is a SIGBUS, not an error.
- The state dir is probed (type, read-only, full) before recovery, so a bad one can make a
  cold start with a warning instead of a traceback (``state_dir_errors``).
"""

from __future__ import annotations

import contextlib
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


def secure_dir(path: Path, setting: str) -> list[Path]:
    """Create ``path`` (0700, parents too) or verify it: a real directory owned by us and not
    writable by others, or a shared sticky one like /tmp owned by root or us. Returns the
    folders it created, outermost first, so that a refused start can remove them again."""
    missing: list[Path] = []
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    made: list[Path] = []
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            continue  # created meanwhile: verified below like any existing folder
        except OSError as exc:
            raise StartFault(f"{setting}: cannot create folder {folder}: {exc.strerror}; "
                             "create it or choose another path") from None
        made.append(folder)
    if made and made[-1] == path:
        return made
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise StartFault(f"{setting}: {path} is a symlink; the daemon only uses a folder it "
                         "owns: replace it with a real folder or choose another path")
    if not stat.S_ISDIR(st.st_mode):
        raise StartFault(f"{setting}: {path} is not a folder: remove it or choose another path")
    sticky = bool(st.st_mode & stat.S_ISVTX)
    if sticky and st.st_uid in (0, os.geteuid()):
        return made  # /tmp-like: others cannot remove or rename what we create in it
    _check_owned(st, path, "folder", setting)
    if st.st_mode & 0o022:
        raise StartFault(f"{setting}: folder {path} is writable by other users (mode "
                         f"{stat.S_IMODE(st.st_mode):o}), so they could replace its socket: "
                         f"chmod 700 {path} or choose another path")
    return made


def remove_folders(made: list[Path]) -> None:
    """Remove folders ``secure_dir`` created (innermost first), each only if empty."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            return  # not empty (someone uses it) or gone: leave it and its parents


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
