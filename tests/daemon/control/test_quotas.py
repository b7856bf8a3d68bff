"""Issue 16 item 3: per-client quotas, the namespace-reset consent rule, identities per peer.

Real daemon processes and clients; every refusal is typed and counted in
``kvoffload_refused_total{reason}``, and a refused store is never reported stored.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from kvoffload.bench.suites.load import metric_sum, scrape_metrics
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, KeyStatus, make_key
from kvoffload.daemon.control import protocol as p

from tests.daemon_helpers import DaemonHandle, run_daemon  # noqa: E402

GEOM = Geometry(namespace="quota", groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16, 1024),),
                tokens_per_hash=16)
TOKEN = "operator-secret-0123456789"


def keys(tag: str, n: int) -> list[bytes]:
    return [make_key(hashlib.sha256(f"{tag}{i}".encode()).digest(), 0) for i in range(n)]


def refused(d: DaemonHandle, reason: str) -> float:
    return metric_sum(scrape_metrics(d.http_url), "kvoffload_refused_total", reason=reason)


def client(d: DaemonHandle, control: str | None = None, instance: str = "") -> DaemonClient:
    """``instance``: the engine it registers as (quotas are per engine, else per process)."""
    c = DaemonClient(control or d.control, timeout_ms=5000)
    c.register(GEOM, instance=instance)
    return c


def store(c: DaemonClient, ks: list[bytes]) -> list[p.StoreOutcome]:
    grant = c.prepare_store([p.StoreItem(key=k, end_token=16) for k in ks])
    done = [k for k, o in zip(ks, grant.outcomes, strict=True) if o == p.StoreOutcome.GRANTED]
    if done:
        assert c.commit_store(done) == len(done)
    return grant.outcomes


def engine(c: DaemonClient) -> int:
    """The engine id a registered client's requests carry."""
    assert c.registered is not None
    return c.registered.engine


def reset(c: DaemonClient, credential: str = "") -> p._Msg:
    return c.call(p.Reset(rid=c.rid(), engine=engine(c), scope="namespace",
                          credential=credential))


# -- reset consent --------------------------------------------------------------------------


def test_namespace_reset_needs_sole_client_or_operator_credential(tmp_path: Path) -> None:
    token = tmp_path / "operator.token"
    token.write_text(TOKEN + "\n")
    os.chmod(token, 0o600)
    with run_daemon(tmp_path, slot_bytes=1024,
                    env={"KVOFFLOAD_OPERATOR_TOKEN_FILE": str(token)}) as d:
        a, b = client(d), client(d)
        ks = keys("consent", 4)
        assert store(b, ks) == [p.StoreOutcome.GRANTED] * 4
        denied = reset(a)
        assert isinstance(denied, p.Error) and denied.code == p.ErrorCode.FORBIDDEN, denied
        wrong = reset(a, credential="not-the-operator-secret")
        assert isinstance(wrong, p.Error) and wrong.code == p.ErrorCode.FORBIDDEN, wrong
        assert refused(d, "reset_forbidden") == 2
        assert a.probe(ks) == [KeyStatus.HIT] * 4  # a refused reset changed nothing
        # An anonymous client's "own" is every anonymous client's blocks: the same rule.
        anon = a.call(p.Reset(rid=a.rid(), engine=engine(a), scope="own"))
        assert isinstance(anon, p.Error) and anon.code == p.ErrorCode.FORBIDDEN, anon
        # An engine instance's own blocks: always allowed, and only those go.
        c = DaemonClient(d.control, timeout_ms=5000)
        reg = c.call(p.Register(rid=c.rid(), geometry=GEOM, instance="engine-c"))
        assert isinstance(reg, p.Registered)
        mine = keys("mine", 2)
        grant = c.call(p.PrepareStore(rid=c.rid(), engine=reg.engine,
                                      items=[p.StoreItem(key=k, end_token=16) for k in mine]))
        assert isinstance(grant, p.StoreGrant)
        c.call(p.CommitStore(rid=c.rid(), engine=reg.engine, keys=mine))
        own = c.call(p.Reset(rid=c.rid(), engine=reg.engine, scope="own"))
        assert isinstance(own, p.Ack) and own.count == 2, own
        assert a.probe(mine) == [KeyStatus.MISS] * 2 and a.probe(ks) == [KeyStatus.HIT] * 4
        assert isinstance(c.call(p.Bye(rid=c.rid())), p.Ack)  # gone: not a registrant now
        c.close()
        ok = reset(a, credential=TOKEN)  # the operator may drop it while b is registered
        assert isinstance(ok, p.Ack) and ok.count == 4, ok
        assert b.probe(ks) == [KeyStatus.MISS] * 4
        assert store(b, ks) == [p.StoreOutcome.GRANTED] * 4
        b.close()  # b said Bye: a is the namespace's only client now
        deadline = time.monotonic() + 5
        while True:
            sole = reset(a)
            if isinstance(sole, p.Ack) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert isinstance(sole, p.Ack) and sole.count == 4, sole
        a.close()


def test_operator_only_rule_and_a_world_readable_token_is_refused_at_start(
        tmp_path: Path) -> None:
    token = tmp_path / "operator.token"
    token.write_text(TOKEN)
    os.chmod(token, 0o644)
    with pytest.raises(RuntimeError, match="operator_token_file"), run_daemon(
            tmp_path, env={"KVOFFLOAD_OPERATOR_TOKEN_FILE": str(token)}):
        pass
    with run_daemon(tmp_path, slot_bytes=1024,
                    env={"KVOFFLOAD_RESET_NAMESPACE": "operator"}) as d:
        a = client(d)
        store(a, keys("op", 2))
        alone = reset(a)  # even the sole client needs the credential under "operator"
        assert isinstance(alone, p.Error) and alone.code == p.ErrorCode.FORBIDDEN
        assert a.probe(keys("op", 2)) == [KeyStatus.HIT] * 2
        a.close()


# -- quotas -----------------------------------------------------------------------------------


def test_one_client_cannot_hold_more_than_its_share_of_the_pool(tmp_path: Path) -> None:
    # 512 slots, a quarter each: 128 slots held at once (pending, pins, reservation).
    with run_daemon(tmp_path, pool_bytes=512 << 10, slot_bytes=1024,
                    env={"KVOFFLOAD_CLIENT_POOL_SHARE_PCT": "25"}) as d:
        a, b = client(d, instance="hog"), client(d, instance="fair")
        ks = keys("hog", 132)
        grant = a.prepare_store([p.StoreItem(key=k, end_token=16) for k in ks])
        assert grant.outcomes == [p.StoreOutcome.GRANTED] * 128 + [p.StoreOutcome.QUOTA] * 4
        assert grant.slots[128:] == [-1] * 4
        assert refused(d, "quota_pending") == 4
        assert a.probe(ks[128:]) == [KeyStatus.MISS] * 4  # refused: not pending, not stored
        # b is not starved by a's pending stores.
        assert store(b, keys("fair", 128)) == [p.StoreOutcome.GRANTED] * 128
        assert a.commit_store(ks[:128]) == 128
        # Pins count against the same share: 128 pinned, the rest refused (-1) and counted.
        assert store(a, ks[128:]) == [p.StoreOutcome.GRANTED] * 4
        slots = a.pin_load(ks)
        assert all(s >= 0 for s in slots[:128]) and slots[128:] == [-1] * 4
        assert refused(d, "quota_pins") == 4
        assert a.complete_load(ks[:128]) == 128
        assert all(s >= 0 for s in a.pin_load(ks[128:]))  # released pins free the share
        a.close()
        b.close()


def test_pin_and_pending_caps_apply_to_lookups_and_steps(tmp_path: Path) -> None:
    with run_daemon(tmp_path, pool_bytes=64 << 10, slot_bytes=1024,
                    env={"KVOFFLOAD_CLIENT_MAX_PINS": "2", "KVOFFLOAD_CLIENT_MAX_PENDING": "3"}
                    ) as d:
        a = client(d)
        ks = keys("cap", 3)
        assert store(a, ks) == [p.StoreOutcome.GRANTED] * 3
        # A pinning lookup whose hit needs 3 pins: a counted "quota" miss, no pins taken.
        hashes = [k[:-4] for k in ks]
        reply = a.call(p.Lookup(rid=a.rid(), engine=engine(a), pin=True, queries=[
            p.LookupQuery(req_id="r", block_hashes=hashes, num_tokens=48,
                          num_prompt_tokens=48)]))
        assert isinstance(reply, p.LookupReply), reply
        ans = reply.answers[0]
        assert ans.hit_tokens == 0 and ans.miss_reason == "quota" and not ans.slots
        assert a.stats()["pinned"] == 0
        assert refused(d, "quota_pins") == 3
        # A Step asking for 10 reserved slots: the reservation cap (an eighth of 64 slots)
        # makes it 8, the pending cap grants 3, the other 5 are counted as refused.
        step = a.call(p.Step(rid=a.rid(), engine=engine(a), epoch=0, reserve=10))
        assert isinstance(step, p.StepReply) and len(step.granted) == 3, step
        assert refused(d, "quota_pending") == 5
        a.close()


# -- identities per peer ---------------------------------------------------------------------


def test_identities_per_peer_are_capped_on_tcp(tmp_path: Path) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="kvo-"))
    d = DaemonHandle(workdir, (), 64 << 20, 1024, {"KVOFFLOAD_MAX_CLIENTS_PER_PEER": "2"})
    d.control = "tcp://127.0.0.1:0"  # tcp: every client of this test is one peer, 127.0.0.1
    d.start()
    try:
        control = d.ready["control"]
        first, second = client(d, control), client(d, control)
        third = DaemonClient(control, timeout_ms=5000)
        with pytest.raises(p.ProtocolError) as err:
            third.register(GEOM)
        assert err.value.code == p.ErrorCode.TOO_LARGE and "per_peer" in str(err.value)
        assert refused(d, "peer_identities") >= 1
        first.close()  # Bye frees its identity at once
        deadline = time.monotonic() + 5
        while True:
            try:
                third.register(GEOM)
                break
            except p.ProtocolError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        assert third.probe(keys("peer", 1)) == [KeyStatus.MISS]
        second.close()
        third.close()
    finally:
        d.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


# -- the vLLM plugin under a quota -----------------------------------------------------------


def test_plugin_stores_what_its_quota_allows_and_counts_the_rest(tmp_path: Path) -> None:
    """A short reservation is a counted short store in the plugin: the keys it could not
    store stay misses for everyone, the ones it stored load as hits."""
    from tests.plugin_common import connect, end_step, keys_at, plugin_config
    from tests.vllm_harness import (
        build_scheduler_connector,
        daemon_manager,
        make_request,
        vllm_import_error,
    )

    if vllm_import_error() is not None:
        pytest.skip(str(vllm_import_error()))
    from vllm.v1.kv_offload.base import ReqContext

    with run_daemon(tmp_path, env={"KVOFFLOAD_CLIENT_MAX_PENDING": "3"}) as d:
        conn = build_scheduler_connector(plugin_config(d.control))
        manager = daemon_manager(conn)
        assert len(manager._reserved) == 3  # asked for its floor, granted its cap
        assert refused(d, "quota_pending") == manager.reservation.floor - 3
        req = make_request(list(range(900, 930)), "quota")
        conn.on_new_request(req)
        ctx = ReqContext(req_id="quota")
        ks = keys_at(req.block_hashes, 0) + keys_at(req.block_hashes, 1)
        for k in ks:
            ctx.set_offload_key_position(k, 16)
        out = manager.prepare_store(ks, ctx)
        assert out is not None and out.keys_to_store == ks[:3]  # the prefix that fits; the 4th is not offered
        assert manager.counters["stores_short_reservation"] == 1
        other = connect(d.control, manager.geometry)
        end_step(conn)
        manager.complete_store(ks[:3], ctx)
        deadline = time.monotonic() + 30
        while other.probe(ks) != [KeyStatus.HIT] * 3 + [KeyStatus.MISS]:
            assert time.monotonic() < deadline, other.probe(ks)
            end_step(conn)  # the commits ride the next step's message
            time.sleep(0.01)
        end_step(conn)
        manager.shutdown()
        other.close()
