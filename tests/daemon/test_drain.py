"""SIGTERM drains (issue 23 item 5): a load pinned when the signal comes keeps its slot's entry
and an index that is not superseded until the pin is released or ``drain_ms`` passes; new
reservations, pins and stores answer ``shutting_down``; the daemon exits 0. Real processes.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, make_key
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.store import shared_index as si

from tests.daemon_helpers import DaemonHandle, run_daemon

SLOT = 4096
GEOM = Geometry(namespace="drain", groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16, SLOT),),
                tokens_per_hash=16)
KEY = make_key(b"k" * 32, 0)
OTHER = make_key(b"o" * 32, 0)


def superseded(mm: mmap.mmap) -> bool:
    return bool(si.SEQ.unpack_from(mm, si.FLAGS_OFFSET)[0] & si.FLAG_SUPERSEDED)


def entry(mm: mmap.mmap, slot: int) -> bytes:
    """The slot's whole entry (generation included): what a worker checks after its copy."""
    off = si.HEADER_BYTES + slot * si.ENTRY_BYTES
    return bytes(mm[off:off + si.ENTRY_BYTES])


def readyz(d: DaemonHandle) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{d.http_url}/readyz", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@contextmanager
def pinned_block(tmp_path: Path, drain_ms: int) -> Iterator[tuple[DaemonHandle, DaemonClient,
                                                                   int, mmap.mmap]]:
    """A daemon, a client holding a load pin on one stored block, the index mapped."""
    with run_daemon(tmp_path, pool_bytes=8 << 20,
                    env={"KVOFFLOAD_DRAIN_MS": str(drain_ms)}) as d:
        c = DaemonClient(d.control, timeout_ms=5000, lease_ms=600_000)
        reg = c.register(GEOM)
        grant = c.prepare_store([p.StoreItem(key=KEY, end_token=16)])
        assert grant.outcomes == [p.StoreOutcome.GRANTED]
        assert c.commit_store([KEY]) == 1
        [slot] = c.pin_load([KEY])
        assert slot >= 0
        with open(reg.index_path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        try:
            yield d, c, slot, mm
        finally:
            mm.close()
            c.close()


def sigterm_and_wait_for_drain(d: DaemonHandle, c: DaemonClient) -> None:
    """SIGTERM, then wait until the daemon refuses new stores (it is draining)."""
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    for _ in range(500):
        try:
            c.prepare_store([p.StoreItem(key=OTHER, end_token=16)])
        except p.ProtocolError as exc:
            assert exc.code == p.ErrorCode.SHUTTING_DOWN, exc
            return
        time.sleep(0.01)
    raise AssertionError("the daemon never started draining")


def test_sigterm_waits_for_the_pinned_load_then_supersedes(tmp_path: Path) -> None:
    with pinned_block(tmp_path, drain_ms=600_000) as (d, c, slot, mm):
        assert d.proc is not None
        before = entry(mm, slot)
        assert not superseded(mm)
        sigterm_and_wait_for_drain(d, c)
        # Draining: nothing new is granted, and /readyz takes the daemon out of rotation...
        with pytest.raises(p.ProtocolError) as refused:
            c.pin_load([KEY])
        assert refused.value.code == p.ErrorCode.SHUTTING_DOWN
        status, body = readyz(d)
        assert status == 503 and body["checks"]["accepting"] is False
        # ...but the load in flight stays valid: a worker's check after its copy passes.
        time.sleep(0.5)  # what an immediate shutdown needs to supersede: it must not
        assert d.proc.poll() is None
        assert not superseded(mm) and entry(mm, slot) == before
        assert c.complete_load([KEY]) == 1  # the load finishes: the drain ends
        assert d.proc.wait(30) == 0
        assert superseded(mm)  # and only now do engines stop trusting the index
        assert "signal received: draining" in d.log()


def test_drain_ms_bounds_the_wait_for_a_pin_never_released(tmp_path: Path) -> None:
    with pinned_block(tmp_path, drain_ms=300) as (d, c, slot, mm):
        assert d.proc is not None
        sigterm_and_wait_for_drain(d, c)
        assert d.proc.wait(30) == 0  # the client never completes its load
        assert superseded(mm)
        assert "drain ended (drain_ms 300 passed) with slots still pinned (1)" in d.log()


def test_a_second_signal_ends_the_drain_at_once(tmp_path: Path) -> None:
    with pinned_block(tmp_path, drain_ms=600_000) as (d, c, slot, mm):
        assert d.proc is not None
        sigterm_and_wait_for_drain(d, c)
        d.proc.send_signal(signal.SIGINT)
        assert d.proc.wait(30) == 0  # not the 10 minutes of drain_ms
        assert superseded(mm)
        assert "another signal" in d.log()


def test_sigterm_without_pins_does_not_wait(tmp_path: Path) -> None:
    with run_daemon(tmp_path, env={"KVOFFLOAD_DRAIN_MS": "600000"}) as d:
        c = DaemonClient(d.control, timeout_ms=5000)
        c.register(GEOM)
        c.close()
        assert d.stop(timeout=30) == 0
        assert not os.path.exists(d.pool_path)
