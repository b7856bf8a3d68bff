"""The daemon as a real process over real sockets: lookups, futures, pins, leases, eviction."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
from kvoffload.connector.client import AsyncDaemonClient, DaemonClient
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, KeyStatus, make_key
from kvoffload.daemon.control import protocol as p

from tests.daemon_helpers import run_daemon

# The upstream worked example: block 16, 4 tokens per hash, attention + Mamba (align).
EXAMPLE = Geometry(
    namespace="example",
    groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, tokens_per_block=16, bytes_per_block=256),
            GroupSpec(kind=GroupKind.MAMBA, tokens_per_block=16, bytes_per_block=256)),
    tokens_per_hash=4,
)
H = [hashlib.sha256(f"h{i}".encode()).digest() for i in range(7)]  # h0..h6: 28 tokens


def query(req_id: str = "r", local: int = 0) -> p.LookupQuery:
    return p.LookupQuery(req_id=req_id, block_hashes=H, num_tokens=30, num_prompt_tokens=30,
                         local_tokens=local)


def store(client: DaemonClient, keys: list[bytes]) -> list[int]:
    grant = client.prepare_store([p.StoreItem(key=k, end_token=16) for k in keys])
    assert all(o == p.StoreOutcome.GRANTED for o in grant.outcomes), grant
    assert client.commit_store(keys) == len(keys)
    return grant.slots


@pytest.fixture
def daemon(tmp_path):
    with run_daemon(tmp_path, "--lease-ms", "400") as d:
        yield d


@pytest.fixture
def client(daemon):
    c = DaemonClient(daemon.control, timeout_ms=5000)
    c.register(EXAMPLE)
    yield c
    c.close()


def test_worked_example_tail_then_chunk_only(client: DaemonClient) -> None:
    assert client.lookup([query()])[0].hit_tokens == 0
    store(client, [make_key(H[3], 0), make_key(H[3], 1), make_key(H[6], 0)])
    ans = client.lookup([query()])[0]
    assert (ans.hit_tokens, ans.chunk_tokens, ans.tail_boundary) == (16, 16, None)
    store(client, [make_key(H[6], 1)])
    ans = client.lookup([query()])[0]
    assert (ans.hit_tokens, ans.chunk_tokens, ans.tail_boundary) == (28, 16, 28)
    assert ans.load_keys == [make_key(H[3], 0), make_key(H[6], 0), make_key(H[6], 1)]
    # Many requests in one message: each gets its own answer.
    answers = client.lookup([query("a"), query("b", local=16)])
    assert [a.hit_tokens for a in answers] == [28, 12]


def test_probe_and_pending_status(client: DaemonClient) -> None:
    key = make_key(H[0], 0)
    assert client.probe([key]) == [KeyStatus.MISS]
    grant = client.prepare_store([p.StoreItem(key=key, end_token=4)])
    assert grant.outcomes == [p.StoreOutcome.GRANTED]
    assert client.probe([key]) == [KeyStatus.HIT_PENDING]
    again = client.prepare_store([p.StoreItem(key=key, end_token=4)])
    assert again.outcomes == [p.StoreOutcome.EXISTS]
    client.commit_store([key])
    assert client.probe([key]) == [KeyStatus.HIT]


async def _wait_case(daemon, commit_ok: bool | None) -> p.LookupAnswer:
    writer = DaemonClient(daemon.control, timeout_ms=5000, lease_ms=4000)
    writer.register(EXAMPLE)
    keys = [make_key(H[3], 0), make_key(H[3], 1)]
    writer.prepare_store([p.StoreItem(key=k, end_token=16) for k in keys])
    reader = AsyncDaemonClient(daemon.control)
    await reader.connect()
    await reader.register(EXAMPLE)
    assert reader.engine is not None
    wait = asyncio.ensure_future(reader.expect(
        p.Lookup(rid=reader.rid(), engine=reader.engine, queries=[query()], wait_ms=1500),
        p.LookupReply))
    await asyncio.sleep(0.2)
    assert not wait.done()  # parked on the pending keys' futures
    if commit_ok is not None:
        writer.commit_store(keys, ok=commit_ok)
    reply = await asyncio.wait_for(wait, 5)
    await reader.close()
    writer.close()
    return reply.answers[0]


async def test_lookup_future_resolves_on_commit(daemon) -> None:
    ans = await _wait_case(daemon, True)
    assert ans.hit_tokens == 16


async def test_lookup_future_resolves_on_abort(daemon) -> None:
    ans = await _wait_case(daemon, False)
    assert ans.hit_tokens == 0 and ans.miss_reason == "not_stored"


async def test_lookup_future_deadline(daemon) -> None:
    ans = await _wait_case(daemon, None)
    assert ans.hit_tokens == 0 and ans.miss_reason == "pending"


def test_pins_block_eviction_and_dead_client_pins_expire(tmp_path) -> None:
    # 4 slots of 512 bytes: room for exactly two chunk pairs.
    with run_daemon(tmp_path, "--lease-ms", "300", pool_bytes=2048, slot_bytes=512) as d:
        holder = DaemonClient(d.control, timeout_ms=5000, lease_ms=300)
        holder.register(EXAMPLE)
        store(holder, [make_key(H[3], 0), make_key(H[3], 1)])
        ans = holder.lookup([query()], pin=True)[0]
        assert ans.hit_tokens == 16 and len(ans.slots) == 2
        other = DaemonClient(d.control, timeout_ms=5000, lease_ms=5000)
        other.register(EXAMPLE)
        # Fill the other two slots, then ask for two more: the pinned pair must survive.
        store(other, [make_key(H[0], 0), make_key(H[0], 1)])
        grant = other.prepare_store([p.StoreItem(key=make_key(H[1], g), end_token=8)
                                     for g in (0, 1)])
        assert grant.outcomes == [p.StoreOutcome.GRANTED] * 2
        assert set(grant.evicted) == {make_key(H[0], 0), make_key(H[0], 1)}
        other.commit_store([make_key(H[1], 0), make_key(H[1], 1)])
        refused = other.prepare_store([p.StoreItem(key=make_key(H[2], 0), end_token=12)])
        assert refused.outcomes == [p.StoreOutcome.GRANTED]  # evicts H1@0, not the pinned H3
        assert other.probe([make_key(H[3], 0), make_key(H[3], 1)]) == [KeyStatus.HIT] * 2
        other.commit_store([make_key(H[2], 0)])
        # The holder dies (no goodbye) without completing its load: after its lease its pins go.
        holder._reset_socket()
        deadline = time.monotonic() + 10
        while other.stats()["pinned"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert other.stats()["pinned"] == 0
        # Now the formerly pinned pair can be evicted to make room.
        grant = other.prepare_store([p.StoreItem(key=make_key(H[4], g), end_token=20)
                                     for g in (0, 1)])
        assert grant.outcomes == [p.StoreOutcome.GRANTED] * 2
        assert make_key(H[3], 0) in grant.evicted or make_key(H[3], 1) in grant.evicted
        other.close()


def test_no_space_when_everything_is_pending(tmp_path) -> None:
    with run_daemon(tmp_path, pool_bytes=1024, slot_bytes=512) as d:
        c = DaemonClient(d.control, timeout_ms=5000)
        c.register(EXAMPLE)
        grant = c.prepare_store([p.StoreItem(key=make_key(H[i], 0), end_token=4 * (i + 1))
                                 for i in range(3)])
        assert grant.outcomes == [p.StoreOutcome.GRANTED, p.StoreOutcome.GRANTED,
                                  p.StoreOutcome.NO_SPACE]
        assert grant.slots[2] == -1
        c.close()


async def test_concurrent_clients_store_and_find_each_others_blocks(daemon) -> None:
    clients = [AsyncDaemonClient(daemon.control) for _ in range(8)]

    async def work(i: int, c: AsyncDaemonClient) -> int:
        await c.connect()
        await c.register(EXAMPLE)
        assert c.engine is not None
        hashes = [hashlib.sha256(f"c{i}-{j}".encode()).digest() for j in range(4)]
        keys = [make_key(hashes[3], g) for g in (0, 1)]
        await c.expect(p.PrepareStore(rid=c.rid(), engine=c.engine, items=[
            p.StoreItem(key=k, end_token=16) for k in keys]), p.StoreGrant)
        await c.expect(p.CommitStore(rid=c.rid(), engine=c.engine, keys=keys), p.Ack)
        q = p.LookupQuery(req_id=str(i), block_hashes=hashes, num_tokens=17,
                          num_prompt_tokens=17)
        reply = await c.expect(p.Lookup(rid=c.rid(), engine=c.engine, queries=[q]),
                               p.LookupReply)
        return reply.answers[0].hit_tokens or 0

    hits = await asyncio.gather(*(work(i, c) for i, c in enumerate(clients)))
    assert hits == [16] * 8
    for c in clients:
        await c.close()


def test_dead_writer_pending_store_is_released_after_lease(tmp_path) -> None:
    with run_daemon(tmp_path, "--lease-ms", "300", "--policy", "arc", pool_bytes=1024,
                    slot_bytes=512) as d:
        writer = DaemonClient(d.control, timeout_ms=5000, lease_ms=300)
        writer.register(EXAMPLE)
        grant = writer.prepare_store([p.StoreItem(key=make_key(H[i], 0), end_token=4)
                                      for i in range(2)])
        assert grant.outcomes == [p.StoreOutcome.GRANTED] * 2
        writer._reset_socket()  # dies mid-store (no goodbye): never commits
        other = DaemonClient(d.control, timeout_ms=5000, lease_ms=5000)
        other.register(EXAMPLE)
        assert other.probe([make_key(H[0], 0)]) == [KeyStatus.HIT_PENDING]
        deadline = time.monotonic() + 10
        while other.stats()["pending"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert other.probe([make_key(H[0], 0), make_key(H[1], 0)]) == [KeyStatus.MISS] * 2
        # Fenced first: the dead writer's workers may still be writing those slots, so they
        # come back only a lease later (issue 16: no reuse while an old grant can write).
        first = other.prepare_store([p.StoreItem(key=make_key(H[5], 0), end_token=24)])
        assert first.outcomes == [p.StoreOutcome.NO_SPACE]
        deadline = time.monotonic() + 10
        while other.stats()["free_slots"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        # Both slots are free again: pool usage is back where it was.
        again = other.prepare_store([p.StoreItem(key=make_key(H[5], g), end_token=24)
                                     for g in (0, 1)])
        assert again.outcomes == [p.StoreOutcome.GRANTED] * 2 and again.evicted == []
        assert other.stats()["policy"] == "arc"
        other.close()


def test_goodbye_releases_pins_and_pending_at_once(tmp_path) -> None:
    with run_daemon(tmp_path, "--lease-ms", "60000") as d:
        c = DaemonClient(d.control, timeout_ms=5000)
        c.register(EXAMPLE)
        store(c, [make_key(H[3], 0), make_key(H[3], 1)])
        assert c.lookup([query()], pin=True)[0].slots
        c.prepare_store([p.StoreItem(key=make_key(H[0], 0), end_token=4)])
        other = DaemonClient(d.control, timeout_ms=5000)
        other.register(EXAMPLE)
        assert other.stats()["pinned"] == 2 and other.stats()["pending"] == 1
        c.close()  # sends Bye: no waiting for a 60 s lease
        deadline = time.monotonic() + 5
        while other.stats()["pinned"] and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = other.stats()
        assert (stats["pinned"], stats["pending"], stats["clients"]) == (0, 0, 1)
        assert stats["lookups_total"] == 1 and stats["hit_tokens_total"] == 16
        other.close()


def test_packed_hashes_answer_like_a_list(client: DaemonClient) -> None:
    from kvoffload.daemon.base import PackedHashes

    store(client, [make_key(H[3], 0), make_key(H[3], 1), make_key(H[6], 0), make_key(H[6], 1)])
    packed = PackedHashes.pack(H)
    q = p.LookupQuery(req_id="packed", hash_blob=packed.blob, hash_bytes=packed.width,
                      num_tokens=30, num_prompt_tokens=30)
    as_list, as_blob = client.lookup([query(), q])
    assert (as_blob.hit_tokens, as_blob.load_keys) == (as_list.hit_tokens, as_list.load_keys)
    assert as_blob.hit_tokens == 28
    bad = p.LookupQuery(req_id="bad", hash_blob=packed.blob[:-1], hash_bytes=32,
                        num_tokens=30, num_prompt_tokens=30)
    with pytest.raises(p.ProtocolError) as exc:
        client.lookup([bad])
    assert exc.value.code == p.ErrorCode.BAD_REQUEST


def test_cost_aware_tails_neither_loaded_nor_stored_when_they_cannot_pay(daemon) -> None:
    writer = DaemonClient(daemon.control, timeout_ms=5000)
    writer.register(EXAMPLE)
    store(writer, [make_key(H[3], 0), make_key(H[3], 1), make_key(H[6], 0), make_key(H[6], 1)])
    assert writer.lookup([query()])[0].hit_tokens == 28  # no time model: the tail loads
    # Recomputing is nearly free and copies crawl: no tail can repay its bytes.
    cheap = DaemonClient(daemon.control, timeout_ms=5000, time_model=(1e12, 1.0))
    cheap.register(EXAMPLE)
    ans = cheap.lookup([query()])[0]
    assert (ans.hit_tokens, ans.tail_boundary) == (16, None)
    assert ans.load_keys == [make_key(H[3], 0), make_key(H[3], 1)]
    assert not {make_key(H[6], 0), make_key(H[6], 1)} & set(ans.hit_keys)
    assert ans.miss_reason == "tail_below_threshold"
    grant = cheap.prepare_store([p.StoreItem(key=make_key(H[5], 0), end_token=24, tail=True),
                                 p.StoreItem(key=make_key(H[2], 0), end_token=12, tail=True)])
    assert grant.outcomes == [p.StoreOutcome.NOT_WORTH] * 2 and grant.slots == [-1, -1]
    # An engine whose prefill is slow and copies fast: tails pay again.
    slow = DaemonClient(daemon.control, timeout_ms=5000, time_model=(1.0, 1e12))
    slow.register(EXAMPLE)
    assert slow.lookup([query()])[0].hit_tokens == 28
    for c in (writer, cheap, slow):
        c.close()


def test_a_step_with_a_bad_key_is_refused_whole(tmp_path) -> None:
    """A Step naming a malformed key gets a typed error and changes nothing (no reservation,
    no claim), and a reserving Step of the same client still works afterwards."""
    with run_daemon(tmp_path, pool_bytes=1 << 20, slot_bytes=1024) as d:
        c = DaemonClient(d.control, timeout_ms=5000)
        engine = c.register(EXAMPLE).engine
        free = c.stats()["free_slots"]
        bad = c.call(p.Step(rid=c.rid(), engine=engine, epoch=0, reserve=4, finds=[b"x"],
                            claims=[p.StoreClaim(item=p.StoreItem(key=b"\x01", end_token=4),
                                                 slot=0, gen=1)]))
        assert isinstance(bad, p.Error) and bad.code == p.ErrorCode.BAD_REQUEST
        assert c.stats()["free_slots"] == free
        ok = c.call(p.Step(rid=c.rid(), engine=engine, epoch=0, reserve=4))
        assert isinstance(ok, p.StepReply) and len(ok.granted) == 4
        assert c.stats()["free_slots"] == free - 4
        c.close()
