"""Earmarked reservations through a daemon process (``--earmark-reservations``): a full pool
grants READY blocks that stay loadable until a ``Step`` claims them; the claim evicts the
block, the commit lands at the granted generation; a departed engine's unclaimed earmarks
are burnt in the shared index a worker reads; a Step with a non-finite stamp is refused and
changes nothing."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from kvoffload.connector.client import DaemonClient
from kvoffload.connector.index_map import SlotGenerations
from kvoffload.daemon.base import KeyStatus
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.store.shared_index import GEN_MASK, index_path_for

from tests.daemon.control.test_steps import GEOMETRY, SLOTS, _keys
from tests.daemon_helpers import DaemonHandle, run_daemon


def _fill(c: DaemonClient) -> list[bytes]:
    keys = _keys("old", SLOTS)
    for key in keys:  # one at a time: keys[0] is the least recently used
        grant = c.prepare_store([p.StoreItem(key=key, end_token=16)])
        assert grant.outcomes == [p.StoreOutcome.GRANTED], grant
        c.commit_store([key])
    return keys


def _step(c: DaemonClient, engine: int, **fields: object) -> p.StepReply:
    reply = c.call(p.Step(rid=c.rid(), engine=engine, epoch=0, **fields))  # type: ignore[arg-type]
    assert isinstance(reply, p.StepReply), reply
    return reply


def _daemon_id(c: DaemonClient) -> str:
    reply = c.call(p.Stats(rid=c.rid()))
    assert isinstance(reply, p.StatsReply), reply
    return str(reply.stats["daemon_id"])


def _gens(pool_path: str, daemon_id: str, slots: list[int]) -> list[int]:
    view = SlotGenerations(str(index_path_for(pool_path)), daemon_id)
    try:
        table = view._table()
        out = [int(table["ident"][s]) & GEN_MASK for s in slots]
        del table
        return out
    finally:
        view.close()


@contextlib.contextmanager
def _full_pool(tmp_path) -> Iterator[tuple[DaemonHandle, DaemonClient, int, list[bytes]]]:
    """A daemon with earmarks on, its pool full of one client's READY blocks."""
    with run_daemon(tmp_path, "--earmark-reservations", pool_bytes=SLOTS * 1024,
                    slot_bytes=1024) as d:
        c = DaemonClient(d.control, timeout_ms=5000)
        engine = c.register(GEOMETRY).engine
        yield d, c, engine, _fill(c)
        c.close()


def test_a_claim_evicts_the_earmarked_block_and_its_commit_lands(tmp_path) -> None:
    with _full_pool(tmp_path) as (d, c, engine, old):
        granted = _step(c, engine, reserve=2).granted
        assert len(granted) == 2
        slots = [s for s, _ in granted]
        did = _daemon_id(c)
        # Granted one generation ahead of what the index shows: nothing moved yet.
        assert [g - 1 for _, g in granted] == _gens(d.pool_path, did, slots)
        assert c.probe(old[:2]) == [KeyStatus.HIT, KeyStatus.HIT]  # still loadable
        new = _keys("new", 1)[0]
        (slot, gen) = granted[0]
        reply = _step(c, engine, claims=[p.StoreClaim(item=p.StoreItem(key=new, end_token=16),
                                                      slot=slot, gen=gen)],
                      stamp=time.monotonic())
        assert not reply.refused and not reply.exists
        assert c.probe([old[0], old[1], new]) == [KeyStatus.MISS, KeyStatus.HIT,
                                                  KeyStatus.HIT_PENDING]
        assert _gens(d.pool_path, did, [slot]) == [gen]  # no reader: handed over at once
        done = _step(c, engine, commits=[p.SlotRef(new, slot, gen)])
        assert not done.refused and c.probe([new]) == [KeyStatus.HIT]


def test_a_lapsed_engines_unclaimed_earmarks_are_burnt(tmp_path) -> None:
    with run_daemon(tmp_path, "--earmark-reservations", "--lease-ms", "300",
                    pool_bytes=SLOTS * 1024, slot_bytes=1024) as d:
        filler = DaemonClient(d.control, timeout_ms=5000)
        filler.register(GEOMETRY)
        old = _fill(filler)
        did = _daemon_id(filler)
        a = DaemonClient(d.control, timeout_ms=5000)
        engine = a.register(GEOMETRY).engine
        granted = _step(a, engine, reserve=2).granted
        slots = [s for s, _ in granted]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # a stops heartbeating: its lease runs out
            filler.heartbeat()
            if _gens(d.pool_path, did, slots) != [g - 1 for _, g in granted]:
                break
            time.sleep(0.05)
        # Skipped past the granted generation: a worker holding a spec never writes.
        assert _gens(d.pool_path, did, slots) == [g + 1 for _, g in granted]
        assert filler.probe(old[:2]) == [KeyStatus.HIT, KeyStatus.HIT]  # blocks kept
        filler.close()


def test_a_step_with_a_non_finite_stamp_is_refused_and_changes_nothing(tmp_path) -> None:
    with _full_pool(tmp_path) as (_d, c, engine, old):
        (slot, gen), = _step(c, engine, reserve=1).granted
        bad = c.call(p.Step(rid=c.rid(), engine=engine, epoch=0, stamp=float("inf"), claims=[
            p.StoreClaim(item=p.StoreItem(key=_keys("new", 1)[0], end_token=16), slot=slot,
                         gen=gen)]))
        assert isinstance(bad, p.Error) and bad.code == p.ErrorCode.BAD_REQUEST
        assert c.probe([old[0]]) == [KeyStatus.HIT]
