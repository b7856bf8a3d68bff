"""``store/private_files.py``: files next to the pool are created fresh and private, a previous
one is replaced only when a kvoffload daemon of this user made it, anything else is refused in
one line and left exactly as it was."""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvoffload.daemon.store import private_files as pf

OTHER_UID = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "files"
    d.mkdir(mode=0o700)
    yield d


def create(path: Path, size: int = 100, **kw: object) -> int:
    return pf.create_private(path, size, kind=pf.KIND_INDEX, setting="pool_path",
                             what="shared index", **kw)  # type: ignore[arg-type]


def snapshot(path: Path) -> tuple[int, int, int, bytes]:
    st = os.lstat(path)
    body = os.readlink(path).encode() if stat.S_ISLNK(st.st_mode) else path.read_bytes()
    return st.st_ino, st.st_mode, st.st_uid, body


def test_a_new_file_is_0600_marked_and_alone_in_its_folder(folder: Path) -> None:
    path = folder / "pool.index"
    old = os.umask(0)  # a permissive umask must not widen it
    try:
        fd = create(path)
    finally:
        os.umask(old)
    try:
        st = os.fstat(fd)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_nlink == 1
        assert st.st_size == 100 + pf.MARK_BYTES
        assert path.read_bytes()[:100] == bytes(100)  # what its readers map: zeros
        assert pf.has_mark(fd, pf.KIND_INDEX) and not pf.has_mark(fd, pf.KIND_POOL)
        assert sorted(p.name for p in folder.iterdir()) == ["pool.index"]  # no temp file
    finally:
        os.close(fd)


def test_a_previous_file_of_ours_is_replaced_by_a_new_inode(folder: Path) -> None:
    path = folder / "pool.index"
    os.close(create(path))
    old = os.stat(path).st_ino
    keep = os.open(path, os.O_RDONLY)  # the inode stays alive: a new one cannot reuse it
    try:
        os.close(create(path))
        assert os.stat(path).st_ino != old
    finally:
        os.close(keep)


def test_a_legacy_file_is_recognized_only_by_its_own_form(folder: Path) -> None:
    path = folder / "pool.index"
    path.write_bytes(b"KVOIDX01" + bytes(100))
    with pytest.raises(pf.PrivateFileError):
        create(path)  # no legacy form given: not ours
    os.close(create(path, legacy=pf.starts_with(b"KVOIDX01")))
    assert path.stat().st_size == 100 + pf.MARK_BYTES


def _plant(kind: str, path: Path, folder: Path) -> None:
    if kind == "symlink":
        target = folder / "target"
        target.write_bytes(b"precious")
        os.symlink(target, path)
    elif kind == "unmarked":
        path.write_bytes(b"someone's data")
        path.chmod(0o666)
    elif kind == "hard_link":
        os.close(create(path))
        os.link(path, folder / "second-name")
    elif kind == "other_kind":  # a pool file where an index belongs
        os.close(pf.create_private(path, 10, kind=pf.KIND_POOL, setting="pool_path",
                                   what="pool file"))
    elif kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:  # another user's, marked like ours: marks do not make a file ours
        os.close(create(path))
        os.chown(path, OTHER_UID, OTHER_UID)


@pytest.mark.parametrize(("kind", "why"), [
    ("symlink", "symlink"), ("unmarked", "not created by a kvoffload daemon"),
    ("hard_link", "2 hard links"), ("other_kind", "not created by a kvoffload daemon"),
    ("folder", "not a regular file"), ("fifo", "not a regular file"),
    pytest.param("other_user", f"uid {OTHER_UID}", marks=needs_root)])
def test_anything_else_is_refused_in_one_line_and_left_as_it_was(folder: Path, kind: str,
                                                                 why: str) -> None:
    path = folder / "pool.index"
    _plant(kind, path, folder)
    before = snapshot(path) if kind not in ("folder", "fifo") else os.lstat(path).st_ino
    names = sorted(p.name for p in folder.iterdir())
    with pytest.raises(pf.PrivateFileError) as exc:
        create(path)
    line = str(exc.value)
    assert "\n" not in line and why in line and f"pool_path {path}" in line, line
    after = snapshot(path) if kind not in ("folder", "fifo") else os.lstat(path).st_ino
    assert after == before
    assert sorted(p.name for p in folder.iterdir()) == names  # no temp file left either
    assert pf.problem(path, kind=pf.KIND_INDEX, setting="pool_path", what="shared index")


def test_a_lock_is_taken_before_the_file_appears_and_refused_while_held(folder: Path) -> None:
    path = folder / "control.sock.lock"
    fd, created = pf.open_lock(path, setting="control", what="control lock file")
    assert created and pf.has_mark(fd, pf.KIND_LOCK)
    with pytest.raises(pf.FileLocked) as exc:
        pf.open_lock(path, setting="control", what="control lock file")
    assert exc.value.holder  # "pid N" or "another process" (the holder is this process)
    os.close(fd)
    fd2, created2 = pf.open_lock(path, setting="control", what="control lock file")
    assert not created2  # a lock file of ours is reused: its inode is what others lock
    os.close(fd2)


def test_an_empty_lock_file_of_an_earlier_daemon_is_ours(folder: Path) -> None:
    path = folder / "control.sock.lock"
    path.touch(mode=0o600)
    fd, created = pf.open_lock(path, setting="control", what="control lock file")
    assert not created
    os.close(fd)
    path.write_bytes(b"not a lock")
    with pytest.raises(pf.PrivateFileError, match="not created by a kvoffload daemon"):
        pf.open_lock(path, setting="control", what="control lock file")


def test_a_file_replaced_while_being_locked_is_looked_at_again(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon whose refused start removes its lock file, while a second one has opened it
    and not yet locked it: the second must not keep a lock on the unlinked inode (a third
    daemon would create a new file and lock that one too)."""
    path = folder / "control.sock.lock"
    fd, _ = pf.open_lock(path, setting="control", what="control lock file")
    os.close(fd)
    real = fcntl.flock
    raced: list[int] = []

    def racing(fd: int, op: int) -> None:
        if not raced:  # between the open and the lock: the file is replaced
            raced.append(fd)
            path.unlink()
            os.close(pf.create_private(path, 0, kind=pf.KIND_LOCK, setting="control",
                                       what="control lock file"))
        real(fd, op)

    monkeypatch.setattr(pf.fcntl, "flock", racing)
    fd, created = pf.open_lock(path, setting="control", what="control lock file")
    try:
        assert raced and not created
        assert pf.names(path, fd)  # the lock is on the file at the path now
    finally:
        os.close(fd)


def test_remove_never_unlinks_a_file_that_replaced_ours(folder: Path) -> None:
    path = folder / "pool.index"
    fd = create(path)
    path.unlink()
    path.write_bytes(b"someone else's")
    pf.remove(path, fd)
    os.close(fd)
    assert path.read_bytes() == b"someone else's"
