"""The ``Step`` handler (daemon/control/steps.py), through a daemon process: a READY block the
engine names in ``touches`` (vLLM offered it to store again: a request reused it) is most
recently used, so the pool's next eviction takes another block; and a Step changes only what
its own client holds (claims, commits, aborts, hand-backs of slots granted to another engine
or at another generation are refused), as ``CommitStore`` does; a key claimed twice keeps
its one slot (the second claim is ``exists``)."""

from __future__ import annotations

import hashlib

from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, KeyStatus, make_key
from kvoffload.daemon.control import protocol as p

from tests.daemon_helpers import run_daemon

GEOMETRY = Geometry(namespace="steps", groups=(
    GroupSpec(kind=GroupKind.FULL_ATTENTION, tokens_per_block=16, bytes_per_block=1024),),
    tokens_per_hash=16)
SLOTS = 16


def _keys(tag: str, n: int) -> list[bytes]:
    return [make_key(hashlib.sha256(f"{tag}{i}".encode()).digest(), 0) for i in range(n)]


def _store(c: DaemonClient, keys: list[bytes]) -> None:
    for key in keys:  # one at a time: each is the most recent when committed
        grant = c.prepare_store([p.StoreItem(key=key, end_token=16)])
        assert grant.outcomes == [p.StoreOutcome.GRANTED], grant
        c.commit_store([key])


def _survivors(touch: bool, tmp_path) -> list[bool]:
    with run_daemon(tmp_path, pool_bytes=SLOTS * 1024, slot_bytes=1024) as d:
        c = DaemonClient(d.control, timeout_ms=5000)
        engine = c.register(GEOMETRY).engine
        old = _keys("old", 4)
        _store(c, old)
        _store(c, _keys("mid", 8))
        if touch:  # the oldest two were reused by a request: the engine says so
            reply = c.call(p.Step(rid=c.rid(), engine=engine, epoch=0, touches=old[:2]))
            assert isinstance(reply, p.StepReply), reply
        _store(c, _keys("new", 8))  # more than the pool holds: the least recent go
        status = c.probe(old)
        c.close()
        return [s is KeyStatus.HIT for s in status]


def test_touched_blocks_outlive_untouched_older_ones(tmp_path) -> None:
    assert _survivors(False, tmp_path / "a") == [False] * 4  # LRU: the oldest go first
    kept = _survivors(True, tmp_path / "b")
    assert kept[:2] == [True, True] and kept[2:] == [False, False]


def test_a_touch_of_a_bad_key_refuses_the_step(tmp_path) -> None:
    with run_daemon(tmp_path, pool_bytes=SLOTS * 1024, slot_bytes=1024) as d:
        c = DaemonClient(d.control, timeout_ms=5000)
        engine = c.register(GEOMETRY).engine
        bad = c.call(p.Step(rid=c.rid(), engine=engine, epoch=0, touches=[b"x"]))
        assert isinstance(bad, p.Error) and bad.code == p.ErrorCode.BAD_REQUEST
        # An unknown (well-formed) key is no error: the block may have gone meanwhile.
        ok = c.call(p.Step(rid=c.rid(), engine=engine, epoch=0, touches=_keys("gone", 1)))
        assert isinstance(ok, p.StepReply)
        c.close()


def _reserve(c: DaemonClient, engine: int, n: int) -> list[tuple[int, int]]:
    """``n`` slots granted to ``engine`` (a Step's ``reserve``): (slot, generation) pairs."""
    reply = c.call(p.Step(rid=c.rid(), engine=engine, epoch=0, reserve=n))
    assert isinstance(reply, p.StepReply) and len(reply.granted) == n, reply
    return reply.granted


def _claim(c: DaemonClient, engine: int, key: bytes, slot: int, gen: int) -> p.StepReply:
    reply = c.call(p.Step(rid=c.rid(), engine=engine, epoch=0, claims=[
        p.StoreClaim(item=p.StoreItem(key=key, end_token=16), slot=slot, gen=gen)]))
    assert isinstance(reply, p.StepReply), reply
    return reply


def test_a_claim_of_a_slot_the_engine_was_not_granted_is_refused_and_changes_nothing(
        tmp_path) -> None:
    """Two writers in one slot start here: a claim must name a slot granted to this engine,
    at the generation it was granted at (a stale grant, a neighbour's slot: refused), and only
    the engine granted a slot may hand it back."""
    with run_daemon(tmp_path, pool_bytes=SLOTS * 1024, slot_bytes=1024) as d:
        a, b = (DaemonClient(d.control, timeout_ms=5000) for _ in range(2))
        ea, eb = a.register(GEOMETRY).engine, b.register(GEOMETRY).engine
        (slot, gen), (other, other_gen) = _reserve(a, ea, 2)
        ka, kb, kc = _keys("claim", 3)
        assert _claim(b, eb, kb, slot, gen).refused == [kb]  # a's slot, not b's
        assert _claim(a, ea, ka, slot, gen + 1).refused == [ka]  # not the granted generation
        assert a.probe([ka, kb]) == [KeyStatus.MISS] * 2  # neither claim took the slot
        # Nor can b hand a's slot back to the pool (it would go to a third writer).
        back = b.call(p.Step(rid=b.rid(), engine=eb, epoch=0,
                             unreserve=[p.SlotRef(key=b"", slot=slot, gen=gen)]))
        assert isinstance(back, p.StepReply), back
        # The slot is still a's, at its generation: its claim and commit go through.
        assert _claim(a, ea, ka, slot, gen).refused == []
        assert a.probe([ka]) == [KeyStatus.HIT_PENDING]
        # A commit must name the claimed slot at its generation too.
        done = a.call(p.Step(rid=a.rid(), engine=ea, epoch=0,
                             commits=[p.SlotRef(key=ka, slot=slot, gen=gen + 1)]))
        assert isinstance(done, p.StepReply) and done.refused == [ka], done
        assert a.probe([ka]) == [KeyStatus.HIT_PENDING]
        done = a.call(p.Step(rid=a.rid(), engine=ea, epoch=0,
                             commits=[p.SlotRef(key=ka, slot=slot, gen=gen)]))
        assert isinstance(done, p.StepReply) and done.refused == [], done
        assert a.probe([ka]) == [KeyStatus.HIT]
        assert _claim(b, eb, kc, other, other_gen).refused == [kc]  # a's other slot: still refused
        a.close()
        b.close()


def test_only_the_client_holding_a_store_closes_it(tmp_path) -> None:
    """A commit marks bytes loadable: another client's commit (or abort) of a store still
    being written would hand half-written bytes to readers, or its slot to a second writer.
    Both paths: the engines' ``Step`` and the plain ``CommitStore``."""
    with run_daemon(tmp_path, pool_bytes=SLOTS * 1024, slot_bytes=1024) as d:
        a, b = (DaemonClient(d.control, timeout_ms=5000) for _ in range(2))
        ea, eb = a.register(GEOMETRY).engine, b.register(GEOMETRY).engine
        (slot, gen), = _reserve(a, ea, 1)
        ka, kp = _keys("close", 2)
        assert _claim(a, ea, ka, slot, gen).refused == []  # a's store, in a's slot
        grant = a.prepare_store([p.StoreItem(key=kp, end_token=16)])  # a's, the plain way
        assert grant.outcomes == [p.StoreOutcome.GRANTED], grant
        ref = p.SlotRef(key=ka, slot=slot, gen=gen)
        for step in (p.Step(rid=b.rid(), engine=eb, epoch=0, commits=[ref]),
                     p.Step(rid=b.rid(), engine=eb, epoch=0, aborts=[ref])):
            other = b.call(step)
            assert isinstance(other, p.StepReply) and other.refused == [ka], other
        for ok in (True, False):
            assert b.commit_store([ka, kp], ok=ok) == 0
        assert a.probe([ka, kp]) == [KeyStatus.HIT_PENDING] * 2  # still a's, still PENDING
        done = a.call(p.Step(rid=a.rid(), engine=ea, epoch=0, commits=[ref]))
        assert isinstance(done, p.StepReply) and done.refused == [], done
        assert a.commit_store([kp]) == 1
        assert a.probe([ka, kp]) == [KeyStatus.HIT] * 2
        a.close()
        b.close()


def test_a_claim_of_a_key_stored_meanwhile_is_answered_exists_and_keeps_its_slot(
        tmp_path) -> None:
    """Two engines prefill the same prompt: the second claim of a key finds it stored (or
    being stored) and is answered ``exists``; the key keeps its one slot and the second
    engine keeps its slot for its next store (one key, one slot, ever)."""
    with run_daemon(tmp_path, pool_bytes=SLOTS * 1024, slot_bytes=1024) as d:
        a, b = (DaemonClient(d.control, timeout_ms=5000) for _ in range(2))
        ea, eb = a.register(GEOMETRY).engine, b.register(GEOMETRY).engine
        (sa, ga), = _reserve(a, ea, 1)
        (sb, gb), = _reserve(b, eb, 1)
        key, other = _keys("twice", 2)
        assert _claim(a, ea, key, sa, ga).refused == []
        answer = _claim(b, eb, key, sb, gb)  # while a's store is in flight
        assert answer.exists == [key] and answer.refused == [], answer
        ok = a.call(p.Step(rid=a.rid(), engine=ea, epoch=0,
                           commits=[p.SlotRef(key=key, slot=sa, gen=ga)]))
        assert isinstance(ok, p.StepReply) and ok.refused == [], ok
        answer = _claim(b, eb, key, sb, gb)  # once it is READY
        assert answer.exists == [key] and answer.refused == [], answer
        assert a.probe([key]) == [KeyStatus.HIT]
        assert a.pin_load([key]) == [sa]  # a's slot: the one a's bytes are in
        assert _claim(b, eb, other, sb, gb).refused == []  # b's slot is still b's to use
        a.close()
        b.close()
