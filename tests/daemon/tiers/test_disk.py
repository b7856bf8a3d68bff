"""The disk tier with real files and a real daemon: eviction to disk, promotion on lookup
(deferred, then a hit through the key's future), corruption, the size bound, restarts."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, KeyStatus, make_key
from kvoffload.daemon.control import protocol as p

from tests.daemon.test_server import EXAMPLE, H, query
from tests.daemon_helpers import run_daemon

SLOT = 512
POOL = 4 * SLOT  # four slots: two chunk pairs
A = [make_key(H[3], 0), make_key(H[3], 1)]  # the worked example's first chunk, both groups


def other_keys(tag: str, n: int) -> list[bytes]:
    return [make_key(hashlib.sha256(f"{tag}{i}".encode()).digest(), i % 2) for i in range(n)]


def content(key: bytes) -> bytes:
    return (hashlib.sha256(key).digest() * (SLOT // 32))[:SLOT]


def store(client: DaemonClient, pool: mmap.mmap, keys: list[bytes]) -> None:
    grant = client.prepare_store([p.StoreItem(key=k, end_token=16) for k in keys])
    assert all(o == p.StoreOutcome.GRANTED for o in grant.outcomes), grant
    for key, slot in zip(keys, grant.slots, strict=True):
        pool[slot * SLOT:(slot + 1) * SLOT] = content(key)
    assert client.commit_store(keys) == len(keys)


def metric(d, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"{d.http_url}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def files(disk: Path) -> list[Path]:
    return sorted(disk.rglob("*.kvb"))


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def open_pool(d) -> mmap.mmap:
    fd = os.open(d.pool_path, os.O_RDWR)
    try:
        return mmap.mmap(fd, POOL, mmap.MAP_SHARED)
    finally:
        os.close(fd)


@contextlib.contextmanager
def attach(d) -> Iterator[tuple[DaemonClient, mmap.mmap]]:
    """A client registered with the example geometry, and the daemon's pool mapped."""
    client = DaemonClient(d.control, timeout_ms=5000)
    client.register(EXAMPLE)
    pool = open_pool(d)
    try:
        yield client, pool
    finally:
        pool.close()
        client.close()


@pytest.fixture
def disk(tmp_path) -> Path:
    return tmp_path / "disk"


def start(tmp_path, disk: Path, disk_bytes: int = 1 << 20):
    return run_daemon(tmp_path, "--disk-dir", str(disk), "--disk-bytes", str(disk_bytes),
                      pool_bytes=POOL, slot_bytes=SLOT)


def evict_a(client: DaemonClient, pool: mmap.mmap, disk: Path) -> None:
    """Store A, then four other keys: A leaves the pool for the disk."""
    store(client, pool, A)
    store(client, pool, other_keys("fill", 4))
    wait_for(lambda: len(files(disk)) >= 2)


def test_evicted_block_is_promoted_and_loads_its_bytes(tmp_path, disk) -> None:
    with start(tmp_path, disk) as d, attach(d) as (client, pool):
        evict_a(client, pool, disk)
        # A block's file shows before its write is counted (the count follows the write).
        wait_for(lambda: metric(d, "kvoffload_tier_ops_total", op="write") == 2)
        # No wait: deferred (the promotion starts); with a wait: the future brings the hit.
        assert client.lookup([query()])[0].hit_tokens is None
        ans = client.lookup([query()], wait_ms=2000, pin=True)[0]
        assert ans.hit_tokens == 16 and ans.load_keys == A
        for key, slot in zip(ans.load_keys, ans.slots, strict=True):
            assert pool[slot * SLOT:(slot + 1) * SLOT] == content(key)
        client.complete_load(ans.load_keys)
        assert metric(d, "kvoffload_tier_promotions_total", outcome="ok") == 2
        assert metric(d, "kvoffload_tier_read_duration_seconds_count") >= 1
        # Promoting A evicted two other blocks: they went to disk too.
        wait_for(lambda: len(files(disk)) == 4)


def test_parked_lookup_wakes_on_promotion(tmp_path, disk) -> None:
    with start(tmp_path, disk) as d, attach(d) as (client, pool):
        evict_a(client, pool, disk)
        # First ask parks; a hit before a 60 s deadline can only come from the commit waking
        # it (past the deadline a still-pending key is answered as a miss).
        ans = client.lookup([query()], wait_ms=60_000, timeout_ms=90_000)[0]
        assert ans.hit_tokens == 16 and ans.miss_reason is None


def test_corrupt_file_is_a_counted_miss(tmp_path, disk) -> None:
    with start(tmp_path, disk) as d, attach(d) as (client, pool):
        evict_a(client, pool, disk)
        # Until its write completes, a block is read back from memory, not from its file.
        wait_for(lambda: metric(d, "kvoffload_tier_bytes", state="writing") == 0)
        for f in files(disk):  # flip the last data byte of every block
            raw = bytearray(f.read_bytes())
            raw[-1] ^= 0xFF
            f.write_bytes(bytes(raw))
        ans = client.lookup([query()], wait_ms=2000)[0]
        assert ans.hit_tokens == 0
        # The answer comes on the first failure; the other promotion may still be reading.
        wait_for(lambda: metric(d, "kvoffload_tier_corrupt_total") == 2)
        assert metric(d, "kvoffload_tier_promotions_total", outcome="failed") == 2
        names = {f"{hashlib.blake2b(k, digest_size=16).hexdigest()}.kvb" for k in A}
        wait_for(lambda: not names & {f.name for f in files(disk)})  # dropped
        assert client.probe(A) == [KeyStatus.MISS, KeyStatus.MISS]
        # A truncated file is caught as well.
        store(client, pool, A)
        store(client, pool, other_keys("again", 4))
        wait_for(lambda: names <= {f.name for f in files(disk)})
        wait_for(lambda: metric(d, "kvoffload_tier_bytes", state="writing") == 0)
        for f in files(disk):
            if f.name in names:
                f.write_bytes(f.read_bytes()[:100])
        assert client.lookup([query()], wait_ms=2000)[0].hit_tokens == 0
        wait_for(lambda: metric(d, "kvoffload_tier_corrupt_total") >= 3)


def _file_of(disk: Path, key: bytes) -> Path:
    name = f"{hashlib.blake2b(key, digest_size=16).hexdigest()}.kvb"
    found = [f for f in files(disk) if f.name == name]
    assert len(found) == 1, found  # one namespace's so far
    return found[0]


def test_a_file_in_another_keys_place_is_a_counted_miss(tmp_path, disk) -> None:
    """A whole, well-formed block file under another key's name (copied there, restored from a
    backup, a collision of the file name) names its own key inside: never loaded as that one."""
    with start(tmp_path, disk) as d, attach(d) as (client, pool):
        evict_a(client, pool, disk)
        wait_for(lambda: metric(d, "kvoffload_tier_bytes", state="writing") == 0)
        first, second = _file_of(disk, A[0]), _file_of(disk, A[1])
        second.write_bytes(first.read_bytes())  # A[1]'s name, A[0]'s block
        assert client.lookup([query()], wait_ms=2000)[0].hit_tokens == 0
        wait_for(lambda: metric(d, "kvoffload_tier_corrupt_total") >= 1)
        assert client.probe([A[1]]) == [KeyStatus.MISS]


def test_another_namespaces_file_is_a_counted_miss(tmp_path, disk) -> None:
    """The same key in another namespace (another model: the same tokens, other bytes) has a
    file of the same name in that namespace's folder; moved into ours, it is not ours."""
    other = Geometry(namespace="another model", groups=EXAMPLE.groups,
                     tokens_per_hash=EXAMPLE.tokens_per_hash)
    with start(tmp_path, disk) as d, attach(d) as (client, pool):
        theirs = DaemonClient(d.control, timeout_ms=5000)
        theirs.register(other)
        evict_a(theirs, pool, disk)  # A in their namespace, then on disk
        wait_for(lambda: metric(d, "kvoffload_tier_bytes", state="writing") == 0)
        their_file = _file_of(disk, A[1])
        evict_a(client, pool, disk)  # A in ours, on disk too, in our namespace's folder
        wait_for(lambda: metric(d, "kvoffload_tier_bytes", state="writing") == 0)
        ours = [f for f in files(disk) if f.name == their_file.name and f != their_file]
        assert len(ours) == 1 and ours[0].parent.parent != their_file.parent.parent
        ours[0].write_bytes(their_file.read_bytes())
        assert client.lookup([query()], wait_ms=2000)[0].hit_tokens == 0
        wait_for(lambda: metric(d, "kvoffload_tier_corrupt_total") >= 1)
        theirs.close()


def test_disk_size_bound(tmp_path, disk) -> None:
    limit = 5 * 620  # about five block files
    with start(tmp_path, disk, disk_bytes=limit) as d, attach(d) as (client, pool):
        for i in range(6):
            store(client, pool, other_keys(f"bound{i}-", 4))
        wait_for(lambda: metric(d, "kvoffload_tier_ops_total", op="eviction") > 0)
        time.sleep(0.2)  # let queued unlinks land
        assert sum(f.stat().st_size for f in files(disk)) <= limit
        assert metric(d, "kvoffload_tier_bytes", state="used") <= limit
        assert metric(d, "kvoffload_tier_bytes", state="total") == limit


def test_blocks_on_disk_survive_a_restart(tmp_path, disk) -> None:
    with start(tmp_path, disk) as d:
        with attach(d) as (client, pool):
            evict_a(client, pool, disk)
        assert d.stop() == 0
        d.start()
        assert metric(d, "kvoffload_tier_blocks") == 2
        with attach(d) as (client, pool):
            ans = client.lookup([query()], wait_ms=2000, pin=True)[0]
            assert ans.hit_tokens == 16
            for key, slot in zip(ans.load_keys, ans.slots, strict=True):
                assert pool[slot * SLOT:(slot + 1) * SLOT] == content(key)


def test_disk_blocks_are_published_as_storage(tmp_path, disk) -> None:
    from kvoffload.events.schema import BlockRemoved, BlockStored, decode_batch

    from tests.daemon.streams.test_publish import replay_all
    from tests.events_helpers import block_events

    with run_daemon(tmp_path, "--disk-dir", str(disk), "--disk-bytes", str(4 * 780),
                    "--events", "tcp://127.0.0.1:*", "--events-replay", "tcp://127.0.0.1:*",
                    "--event-hashes", "bytes", pool_bytes=POOL, slot_bytes=SLOT) as d, \
            attach(d) as (client, pool):
        for tag in ("x", "y", "z"):
            keys = other_keys(tag, 4)
            grant = client.prepare_store([p.StoreItem(key=k, end_token=16,
                                                      token_ids=list(range(16)))
                                          for k in keys])
            for key, slot in zip(keys, grant.slots, strict=True):
                pool[slot * SLOT:(slot + 1) * SLOT] = content(key)
            client.commit_store(keys)
        wait_for(lambda: metric(d, "kvoffload_tier_ops_total", op="write") == 8)
        y = other_keys("y", 4)  # the newest four blocks on disk
        assert client.probe(y[2:]) == [KeyStatus.HIT_PENDING] * 2  # promotion from disk
        wait_for(lambda: metric(d, "kvoffload_tier_promotions_total", outcome="ok") == 2)
        events = block_events(ev for payload in replay_all(d.ready["events_replay"])
                              for ev in decode_batch(payload).events)
        on_disk: set[tuple] = set()
        removed = 0
        for ev in events:
            if ev.medium != "STORAGE":
                continue
            ident = (tuple(ev.block_hashes), ev.group_idx)
            if isinstance(ev, BlockStored):
                assert len(ev.token_ids) == 16 and ev.locality == "LOCAL"
                on_disk.add(ident)
            elif isinstance(ev, BlockRemoved):
                assert ident in on_disk, "a STORAGE removal must match a STORAGE store"
                on_disk.remove(ident)
                removed += 1
        assert removed > 0 and len(on_disk) <= 4  # the bound: four blocks fit
        cpu = [ev.block_hashes[0] for ev in events
               if isinstance(ev, BlockStored) and ev.medium == "CPU"]
        assert cpu.count(y[2][:-4]) == 2 and cpu.count(y[3][:-4]) == 2  # stored, promoted


def test_only_tails_worth_reading_back_go_to_disk(tmp_path, disk: Path) -> None:
    """With the engine's time model, a tail that pays from the pool but not from a slow disk
    is dropped at eviction; complete chunks always go to disk."""
    with run_daemon(tmp_path, "--disk-dir", str(disk), "--disk-bytes", str(1 << 20),
                    "--disk-read-bytes-per-s", "1000", pool_bytes=POOL, slot_bytes=SLOT) as d:
        # 12 tail tokens at 1,000 tokens/s (12 ms) vs 256 extra bytes: 0.26 ms from the pool
        # (1 MB/s), 256 ms from this disk (1 kB/s).
        c = DaemonClient(d.control, timeout_ms=5000, time_model=(1000.0, 1e6))
        c.register(EXAMPLE)
        pool = open_pool(d)
        tail = make_key(H[6], 0)
        grant = c.prepare_store([p.StoreItem(key=tail, end_token=28, tail=True),
                                 p.StoreItem(key=A[0], end_token=16)])
        assert grant.outcomes == [p.StoreOutcome.GRANTED] * 2  # the tail pays from the pool
        for key, slot in zip([tail, A[0]], grant.slots, strict=True):
            pool[slot * SLOT:(slot + 1) * SLOT] = content(key)
        c.commit_store([tail, A[0]])
        store(c, pool, other_keys("fill", 4))  # evicts both
        wait_for(lambda: metric(d, "kvoffload_tier_ops_total", op="write") >= 1)
        assert metric(d, "kvoffload_tier_ops_total", op="write_not_worth") == 1
        assert c.probe([tail]) == [KeyStatus.MISS]  # not in the pool, not on disk
        assert c.probe([A[0]]) != [KeyStatus.MISS]  # the chunk went to disk
        pool.close()
        c.close()
