"""The index journal (daemon/state/journal.py): round trip, compaction, torn and corrupt records."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, make_key
from kvoffload.daemon.state import journal as jn
from kvoffload.daemon.state import snapshot as js
from kvoffload.daemon.store.index import BlockIndex
from kvoffload.daemon.store.pool import Pool
from prometheus_client import CollectorRegistry

SLOT = 4096
GEOM = Geometry(namespace="m", groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16, SLOT),),
                tokens_per_hash=16)


@pytest.fixture
def pool_path() -> Iterator[str]:
    path = f"/dev/shm/kvoffload-jtest-{uuid.uuid4().hex[:10]}"
    yield path
    Path(path).unlink(missing_ok=True)


def make_index(path: str, slots: int = 64) -> BlockIndex:
    pool = Pool(path, slots * SLOT, prefault=False)
    pool.open()
    return BlockIndex(pool)


def fill(index: BlockIndex, n: int, start: int = 0) -> list[bytes]:
    ns = index.namespace(GEOM)
    keys = []
    for i in range(start, start + n):
        key = make_key(i.to_bytes(8, "big"), 0)
        got = index.prepare(ns, key, 16 * (i + 1), False)
        assert got.slot is not None
        with index.pool.view(got.slot) as mv:
            mv[:] = bytes([i % 251]) * SLOT
        assert index.commit(ns, key)
        keys.append(key)
    return keys


def restart(tmp_path: Path, index: BlockIndex, path: str) -> tuple[BlockIndex, CollectorRegistry]:
    index.pool.close(remove=False)
    fresh = make_index(path)
    reg = CollectorRegistry()
    fresh.journal = jn.recover_state(tmp_path, fresh, reg)  # type: ignore[attr-defined]
    return fresh, reg


def recovered(reg: CollectorRegistry, outcome: str) -> float:
    return reg.get_sample_value("kvoffload_recovery_blocks_total", {"outcome": outcome}) or 0.0


def test_round_trip_with_drops(tmp_path: Path, pool_path: str) -> None:
    index = make_index(pool_path)
    journal = jn.recover_state(tmp_path, index, CollectorRegistry())
    index.configure(SLOT)
    keys = fill(index, 20)
    ns = index.namespace(GEOM)
    assert index.drop(ns, keys[3])
    journal.close()
    fresh, reg = restart(tmp_path, index, pool_path)
    fns = fresh.namespace(GEOM)
    assert set(fns.keys) == set(keys) - {keys[3]}
    for key, slot in fns.keys.items():
        assert slot == ns.keys[key]
        assert fresh.end_token[slot] == index.end_token[slot]
    assert recovered(reg, "recovered") == 19 and recovered(reg, "discarded") == 0
    assert fresh.pool.free_slots == 64 - 19
    fresh.journal.close()  # type: ignore[attr-defined]


def test_kill_without_close_keeps_flushed_records(tmp_path: Path, pool_path: str) -> None:
    """No close(): what the writer thread flushed (every flush_ms) is recovered."""
    index = make_index(pool_path)
    journal = jn.recover_state(tmp_path, index, CollectorRegistry())
    index.configure(SLOT)  # as the first engine's registration does, after the start
    keys = fill(index, 10)
    deadline = time.monotonic() + 5
    while journal.written < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    journal._compact = lambda: None  # type: ignore[method-assign]  # the "crash": no snapshot
    journal.close()
    assert (tmp_path / js.JOURNAL).exists()
    fresh, reg = restart(tmp_path, index, pool_path)
    assert set(fresh.namespace(GEOM).keys) == set(keys)
    assert recovered(reg, "recovered") == 10
    fresh.journal.close()  # type: ignore[attr-defined]


def test_compaction_and_epochs(tmp_path: Path, pool_path: str) -> None:
    index = make_index(pool_path)
    index.configure(SLOT)
    journal = jn.Journal(tmp_path, index.pool, compact_min=10)
    journal.start([])
    journal.attach(index)
    keys = fill(index, 30)
    ns = index.namespace(GEOM)
    for key in keys[:25]:
        index.drop(ns, key)
    journal.close()
    state = js.load_state(tmp_path)
    assert {k for _, k in state.live} == set(keys[25:])
    assert not (tmp_path / js.JOURNAL).exists()  # close compacts into the snapshot
    # A journal of an older epoch (crash between snapshot rename and journal reset) is ignored.
    (tmp_path / js.JOURNAL).write_bytes(
        js.frame(["H", js.VERSION, state.epoch - 1, SLOT, 64 * SLOT])
        + js.frame(["D", 0, keys[26], ns.keys.get(keys[26], 0)]))
    assert {k for _, k in js.load_state(tmp_path).live} == set(keys[25:])


def _key(i: int) -> bytes:
    return make_key(i.to_bytes(8, "big"), 0)


def _journal_file(tmp_path: Path, records: list[list[object]]) -> bytes:
    data = js.frame(["H", js.VERSION, 0, SLOT, 64 * SLOT])
    data += b"".join(js.frame(r) for r in records)
    (tmp_path / js.JOURNAL).write_bytes(data)
    return data


def test_truncated_tail_record_ignored(tmp_path: Path) -> None:
    recs: list[list[object]] = [["C", 0, _key(i), i, 16, False, 0] for i in range(5)]
    data = _journal_file(tmp_path, recs)
    (tmp_path / js.JOURNAL).write_bytes(data[:-3])  # crash in the middle of the last write
    state = js.load_state(tmp_path)
    assert sorted(e.slot for e in state.live.values()) == [0, 1, 2, 3]
    assert state.skipped == 1


def test_corrupt_record_ignored(tmp_path: Path) -> None:
    recs: list[list[object]] = [["C", 0, _key(i), i, 16, False, 0] for i in range(5)]
    data = bytearray(_journal_file(tmp_path, recs))
    second = len(js.frame(["H", js.VERSION, 0, SLOT, 64 * SLOT])) + len(js.frame(recs[0]))
    data[second + 12] ^= 0xFF  # a flipped bit inside record 1's payload
    (tmp_path / js.JOURNAL).write_bytes(bytes(data))
    state = js.load_state(tmp_path)
    assert sorted(e.slot for e in state.live.values()) == [0, 2, 3, 4]
    assert state.skipped == 1


def journaled(state_dir: Path, pool_path: str, n: int) -> tuple[BlockIndex, list[bytes]]:
    """An index whose ``n`` committed blocks the journal has written out (and closed)."""
    index = make_index(pool_path)
    index.configure(SLOT)
    journal = jn.recover_state(state_dir, index, CollectorRegistry())
    keys = fill(index, n)
    journal.close()
    return index, keys


def test_validation_discards_bad_slots(tmp_path: Path, pool_path: str) -> None:
    index, keys = journaled(tmp_path, pool_path, 8)
    ns = index.namespace(GEOM)
    with index.pool.view(ns.keys[keys[2]]) as mv:
        mv[100] ^= 0xFF  # one corrupted byte in one slot
    fresh, reg = restart(tmp_path, index, pool_path)
    assert set(fresh.namespace(GEOM).keys) == set(keys) - {keys[2]}
    assert recovered(reg, "recovered") == 7 and recovered(reg, "discarded") == 1
    fresh.journal.close()  # type: ignore[attr-defined]
    # A daemon configured with another slot size trusts nothing of the journal.
    fresh.pool.close(remove=False)
    other = make_index(pool_path, slots=32)
    other.configure(2 * SLOT)
    reg2 = CollectorRegistry()
    jn.recover_state(tmp_path, other, reg2, 2 * SLOT).close()
    assert recovered(reg2, "recovered") == 0 and recovered(reg2, "discarded") == 7
    other.pool.close(remove=False)


def test_validation_trusts_no_slot_twice_and_no_other_slot_size(tmp_path: Path,
                                                                   pool_path: str) -> None:
    """Crafted or damaged state that the checksums alone would pass: a second key claiming a
    slot whose journaled checksum it copied, and a header with another slot size over bytes
    that still match. Neither is restored."""
    index, keys = journaled(tmp_path, pool_path, 3)
    state = js.load_state(tmp_path)
    assert len(state.live) == 3
    first = next(e for e in state.live.values() if e.key == keys[0])
    twin = make_key((99).to_bytes(8, "big"), 0)  # another key, the same slot and checksum
    state.live[(first.ns, twin)] = js.Entry(first.ns, twin, first.slot, 16, False, first.crc)
    rec = js.validate(state, index.pool)
    assert len(rec.good) == 3 and rec.discarded == {"slot_range": 1}
    assert len({e.slot for _, e in rec.good}) == 3  # one key per slot
    state.slot_bytes = 2 * SLOT  # every checksum still matches the pool's bytes
    rec = js.validate(state, index.pool)
    assert rec.good == [] and rec.discarded == {"slot_size_mismatch": 4}
    index.pool.close(remove=True)


def test_checksum_voided_when_slot_dropped_meanwhile(tmp_path: Path, pool_path: str) -> None:
    """A commit whose slot was dropped before its checksum was taken is never journaled."""
    index = make_index(pool_path)
    index.configure(SLOT)
    journal = jn.Journal(tmp_path, index.pool, flush_ms=10_000)
    journal.start([])
    journal.attach(index)
    keys = fill(index, 2)
    index.drop(index.namespace(GEOM), keys[0])  # before the writer ran
    journal.close()
    assert {k for _, k in js.load_state(tmp_path).live} == {keys[1]}
    assert journal.written == 1
    index.pool.close(remove=True)


@pytest.mark.parametrize("new_length", [0x7FFF, 0x0102, 3, 0])
def test_a_flipped_length_costs_one_record_not_the_rest(tmp_path: Path, new_length: int) -> None:
    """A damaged length (far too long, a bit too long, too short) is skipped by finding the
    next valid frame; the records after it survive (before: all of them were dropped)."""
    recs: list[list[object]] = [["C", 0, _key(i), i, 16, False, 0] for i in range(6)]
    data = bytearray(_journal_file(tmp_path, recs))
    second = len(js.frame(["H", js.VERSION, 0, SLOT, 64 * SLOT])) + len(js.frame(recs[0]))
    data[second:second + 4] = new_length.to_bytes(4, "little")
    (tmp_path / js.JOURNAL).write_bytes(bytes(data))
    state = js.load_state(tmp_path)
    assert sorted(e.slot for e in state.live.values()) == [0, 2, 3, 4, 5]
    assert state.skipped == 1


def _state_file(tmp_path: Path, name: str, records: list[list[object]]) -> None:
    (tmp_path / name).write_bytes(b"".join(js.frame(r) for r in records))


def test_crafted_records_with_valid_checksums_never_block_a_start(
        tmp_path: Path, pool_path: str, caplog: pytest.LogCaptureFixture) -> None:
    """Records whose crc32 holds but whose content is absurd: skipped or refused with a loud
    line, and the daemon starts cold instead of failing (or allocating) at every start."""
    big = (1 << 30) // SLOT  # a sparse 1 GiB pool: a 64-byte slot would make 16M slots
    index = make_index(pool_path, slots=big)
    geom = js._enc.encode(GEOM)
    _state_file(tmp_path, js.SNAPSHOT, [
        ["H", js.VERSION, 0, 64, big * SLOT],  # slot size from the file: 16M slots
        ["N", 0, geom],
        ["C", 0, _key(1), 1, 16, False, 0]])
    caplog.set_level("WARNING", logger="kvoffload.daemon")
    reg = CollectorRegistry()
    jn.recover_state(tmp_path, index, reg).close()
    assert not index.pool.configured  # the first engine will size it, as on a cold start
    assert recovered(reg, "recovered") == 0
    assert "starting cold" in caplog.text
    index.pool.close(remove=False)
    # Wrong types in every field a crafted record can hold: each one skipped and counted.
    index = make_index(pool_path)
    index.configure(SLOT)
    bad_geom = js._enc.encode(msgspec.structs.replace(GEOM, tokens_per_hash=0))
    _state_file(tmp_path, js.SNAPSHOT, [
        ["H", js.VERSION, 0, SLOT, 64 * SLOT],
        ["N", 0, geom], ["N", 1, bad_geom], ["N", "x", geom],
        ["C", 0, 10**12, 2, 16, False, 0],  # bytes(10**12) would allocate a terabyte
        ["C", 0, _key(3), "3", 16, False, 0], ["C", 0, _key(4), 4, -1, False, 0],
        ["C", 0, b"\x00" * 4096, 5, 16, False, 0], ["H", js.VERSION, "e", SLOT, 1],
        ["C", 1, _key(6), 6, 16, False, 0]])
    (tmp_path / js.JOURNAL).unlink(missing_ok=True)
    state = js.load_state(tmp_path)
    assert state.skipped == 6 and list(state.live) == [(1, _key(6))]
    reg = CollectorRegistry()
    jn.recover_state(tmp_path, index, reg).close()
    assert recovered(reg, "recovered") == 0 and recovered(reg, "discarded") == 1  # geometry
    index.pool.close(remove=False)
