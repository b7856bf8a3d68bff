"""Issue 26: whatever a state dir holds, a start is a warm start of what checks out, a cold
start, or (``state_dir_errors = "refuse"``) a one-line refusal; never a traceback.

A fuzz of corrupt snapshots and journals against ``recover_state`` on a real pool (truncated,
flipped, wrong types, duplicate namespaces, slots out of range, keys of no group), then real
daemon processes on the cases that used to stop the start (one namespace name with two
geometries) or could hang or exhaust it (a FIFO, a symlink to /dev/zero, a folder where a
file belongs).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from kvoffload.bench.suites.load import metric_sum, scrape_metrics
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, KeyStatus, make_key
from kvoffload.daemon.state import journal as jn
from kvoffload.daemon.state import snapshot as js
from kvoffload.daemon.store.index import BlockIndex
from kvoffload.daemon.store.pool import Pool
from prometheus_client import CollectorRegistry

from tests.daemon_helpers import run_daemon
from tests.mistake_helpers import cli, one_line, pool_path, serve_args

SLOT = 1024
SLOTS = 32
GEOM = Geometry(namespace="m", groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16, SLOT),),
                tokens_per_hash=16)
# The same name with another block size: Register refuses it next to GEOM, so must recovery.
OTHER = msgspec.structs.replace(GEOM, groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16, 512),))


def _key(i: int) -> bytes:
    return make_key(i.to_bytes(32, "big"), 0)


def _fill(slot: int) -> bytes:
    return bytes([slot % 251 + 1]) * SLOT


def _valid_records(n: int = 12) -> list[list[Any]]:
    """A snapshot a daemon could have written: n blocks, block i in slot i."""
    recs: list[list[Any]] = [["H", js.VERSION, 3, SLOT, SLOTS * SLOT],
                             ["N", 0, js._enc.encode(GEOM)]]
    recs += [["C", 0, _key(i), i, 16 * (i + 1), False, zlib.crc32(_fill(i))]
             for i in range(n)]
    return recs


def _write(state_dir: Path, name: str, recs: list[list[Any]]) -> bytes:
    data = b"".join(js.frame(r) for r in recs)
    (state_dir / name).write_bytes(data)
    return data


# -- fuzz, in process ------------------------------------------------------------------------

_JUNK: list[Any] = [None, -1, 1 << 40, (1 << 64) - 1, "x", b"", b"\x00" * 3, 1.5, True, [], {},
                    [1, 2], b"\xff" * 200]


def _crafted(rng: random.Random) -> list[list[Any]]:
    """Records whose frames are intact (crc32 holds) but whose content is wrong."""
    recs = _valid_records()
    action = rng.randrange(7)
    if action == 0:  # a wrong type or value in one field of one record
        rec = recs[rng.randrange(len(recs))]
        rec[rng.randrange(1, len(rec))] = rng.choice(_JUNK)
    elif action == 1:  # one namespace name, two geometries (issue 26), blocks in both
        recs.append(["N", 1, js._enc.encode(OTHER)])
        recs += [["C", 1, _key(100 + i), 20 + i, 16, False, zlib.crc32(_fill(20 + i))]
                 for i in range(3)]
    elif action == 2:  # one name, one geometry, two ids holding the same key
        recs.append(["N", 1, js._enc.encode(GEOM)])
        recs.append(["C", 1, _key(0), 25, 16, False, zlib.crc32(_fill(25))])
    elif action == 3:  # slots out of range or held twice
        recs.append(["C", 0, _key(50), rng.choice([SLOTS, SLOTS + 1, 1 << 31, 3]), 16,
                     False, 0])
    elif action == 4:  # a key naming a group the geometry does not have
        recs.append(["C", 0, _key(60)[:-4] + b"\x00\x00\x00\x07", 26, 16, False,
                     zlib.crc32(_fill(26))])
    elif action == 5:  # a geometry that is not one, or one Register would refuse
        recs[1][2] = rng.choice([b"\xc1", js._enc.encode({"namespace": 1}),
                                 js._enc.encode(msgspec.structs.replace(GEOM, groups=())),
                                 js._enc.encode(msgspec.structs.replace(GEOM, namespace=""))])
    else:  # a header with an absurd slot size or pool size
        recs[0] = ["H", js.VERSION, 3, rng.choice([1, 7, 1 << 40]), rng.choice([0, 1 << 62])]
    return recs


def _mutate(rng: random.Random, state_dir: Path) -> None:
    """One corrupt state dir: crafted records, then maybe torn or flipped bytes."""
    data = _write(state_dir, js.SNAPSHOT, _crafted(rng))
    (state_dir / js.JOURNAL).unlink(missing_ok=True)
    if rng.random() < 0.5:  # a journal continuing it, with its own damage
        jrecs: list[list[Any]] = [["H", js.VERSION, 3, SLOT, SLOTS * SLOT],
                                  ["D", 0, _key(1), 1], ["C", 0, _key(1), 27, 16, False,
                                                         zlib.crc32(_fill(27))]]
        if rng.random() < 0.3:
            jrecs[0][2] = rng.choice([2, 4, "3"])  # of another epoch: ignored
        jdata = b"".join(js.frame(r) for r in jrecs)
        if rng.random() < 0.5:
            jdata = jdata[:rng.randrange(len(jdata))]  # torn by a crash
        (state_dir / js.JOURNAL).write_bytes(jdata)
    if rng.random() < 0.4:
        raw = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        if rng.random() < 0.5:
            raw = raw[:rng.randrange(len(raw))]
        (state_dir / js.SNAPSHOT).write_bytes(bytes(raw))


@pytest.fixture
def pool_file() -> Iterator[str]:
    path = f"/dev/shm/kvoffload-bad-state-{uuid.uuid4().hex[:10]}"
    yield path
    Path(path).unlink(missing_ok=True)


def _pool(path: str) -> Pool:
    """A pool whose slots hold the bytes every journaled checksum describes (written through
    the file: the slots are not sized before recovery does it)."""
    pool = Pool(path, SLOTS * SLOT, prefault=False)
    pool.open()
    with open(path, "r+b") as f:
        f.write(b"".join(_fill(slot) for slot in range(SLOTS)))
    return pool


def _check_recovered(index: BlockIndex) -> int:
    """Every recovered block holds the bytes it was stored with, is in one namespace of a
    valid geometry once, and its slot can never be handed out while it is READY."""
    seen: set[int] = set()
    assert len({ns.geometry.namespace for ns in index.namespaces}) == len(index.namespaces)
    for ns in index.namespaces:
        assert ns.geometry in (GEOM, OTHER)  # the first valid one of the name; never both
        for slot in ns.keys.values():
            assert slot not in seen
            seen.add(slot)
            with index.pool.view(slot) as mv:
                assert bytes(mv) == _fill(slot)
            index.pin(slot)  # pinned: evicting it is not allowed, only a free slot is granted
    if seen:
        ns = index.namespaces[0]
        for i in range(SLOTS):
            got = index.prepare(ns, _key(1000 + i), 16, False)
            if got.slot is None:
                break
            assert got.slot not in seen, "a recovered READY slot was still in the free list"
    return len(seen)


@pytest.mark.parametrize("errors", ["cold", "refuse"])
def test_fuzzed_state_dirs_recover_only_what_checks_out(tmp_path: Path, pool_file: str,
                                                        errors: str) -> None:
    rng = random.Random(2600 + len(errors))
    outcomes: dict[str, int] = {"refused": 0, "recovered": 0, "cold": 0}
    for _ in range(150):
        state_dir = tmp_path / "state"
        shutil.rmtree(state_dir, ignore_errors=True)
        state_dir.mkdir()
        _mutate(rng, state_dir)
        pool = _pool(pool_file)
        index = BlockIndex(pool)
        try:
            jn.recover_state(state_dir, index, CollectorRegistry(), errors=errors).close()
        except jn.StateDirError as exc:
            assert errors == "refuse" and "\n" not in str(exc)
            assert not index.namespaces  # refused before anything was restored
            outcomes["refused"] += 1
        else:
            n = _check_recovered(index)
            outcomes["recovered" if n else "cold"] += 1
        pool.close(remove=True)
    print(errors, outcomes)
    assert outcomes["recovered"] > 0 and outcomes["cold"] + outcomes["refused"] > 0, outcomes
    assert (outcomes["refused"] > 0) == (errors == "refuse"), outcomes


def test_one_name_two_geometries_keeps_the_first(tmp_path: Path, pool_file: str) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    recs = _valid_records(4) + [["N", 1, js._enc.encode(OTHER)],
                                ["C", 1, _key(9), 9, 16, False, zlib.crc32(_fill(9))]]
    _write(state_dir, js.SNAPSHOT, recs)
    pool = _pool(pool_file)
    pool.configure(SLOT)
    state = js.load_state(state_dir)
    rec = js.validate(state, pool)
    assert [e.key for _, e in rec.good] == [_key(i) for i in range(4)]
    assert dict(rec.discarded) == {"geometry_conflict": 1}
    pool.close(remove=True)


# -- real daemon processes -------------------------------------------------------------------


@contextlib.contextmanager
def _workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvo-bs-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_daemon_starts_on_a_snapshot_with_one_name_two_geometries(tmp_path: Path) -> None:
    """The issue's crafted snapshot stopped the start with a ValueError traceback. The pool
    is fresh (zeros), so blocks of zero bytes are what a checksum can vouch for."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    zero = zlib.crc32(bytes(SLOT))
    _write(state_dir, js.SNAPSHOT, [
        ["H", js.VERSION, 0, SLOT, 8 << 20], ["N", 0, js._enc.encode(GEOM)],
        ["N", 1, js._enc.encode(OTHER)], ["C", 0, _key(1), 1, 16, False, zero],
        ["C", 1, _key(2), 2, 16, False, zero]])
    with run_daemon(tmp_path, "--state-dir", str(state_dir), "--state-dir-errors", "refuse",
                    pool_bytes=8 << 20, slot_bytes=SLOT) as d:
        assert "Traceback" not in d.log()
        metrics = scrape_metrics(d.http_url)
        assert metric_sum(metrics, "kvoffload_recovery_blocks_total", outcome="recovered") == 1
        assert metric_sum(metrics, "kvoffload_recovery_blocks_total", outcome="discarded") == 1
        c = DaemonClient(d.control, timeout_ms=10_000)
        c.register(GEOM)
        assert c.probe([_key(1), _key(2)]) == [KeyStatus.HIT, KeyStatus.MISS]
        c.close()


def _plant(kind: str, state_dir: Path) -> None:
    target = state_dir / js.SNAPSHOT
    if kind == "fifo":
        os.mkfifo(target)  # reading it would wait for a writer forever
    elif kind == "dev_zero":
        target.symlink_to("/dev/zero")  # reading it would fill memory
    elif kind == "folder":
        target.mkdir()  # neither readable nor replaceable by a snapshot
    else:  # "too_large": sparse, longer than any snapshot a daemon writes
        with open(target, "wb") as f:
            f.truncate(js.MAX_STATE_FILE + 1)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder", "too_large"])
def test_unreadable_state_files_refuse_in_one_line_or_start_cold(kind: str) -> None:
    with _workdir() as work:
        state_dir = work / "state"
        state_dir.mkdir()
        _plant(kind, state_dir)
        pool = pool_path()
        try:
            proc = cli(*serve_args(work, pool, "--state-dir", str(state_dir),
                                   "--state-dir-errors", "refuse"), timeout=60)
            one_line(proc, 1, f"state_dir {state_dir}", js.SNAPSHOT, 'state_dir_errors = "cold"')
        finally:
            Path(pool).unlink(missing_ok=True)
        with run_daemon(work, "--state-dir", str(state_dir)) as d:  # cold (the default)
            log = d.log()
            assert "Traceback" not in log
            assert "starting cold" in log or "STATE DIR UNUSABLE" in log
            c = DaemonClient(d.control, timeout_ms=10_000)
            c.register(GEOM)
            assert c.probe([_key(1)]) == [KeyStatus.MISS]  # it serves
            c.close()
