"""The recently-evicted key set behind the ``evicted`` miss reason: exact, bounded, fixed memory.

It used to be an OrderedDict that grew to 65,536 keys (~10 MB, and the evicted keys kept
alive) on every daemon, event endpoint or not; a long trace showed it as RSS growth."""

from __future__ import annotations

import hashlib
import random
import tracemalloc
from collections import Counter, deque

from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, make_key
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.streams import publish
from kvoffload.daemon.streams.publish import RecentKeys

from tests.daemon_helpers import run_daemon


def test_recent_keys_are_exactly_the_last_capacity_added() -> None:
    """Against a reference (a deque and counts), with repeated keys and many wrap-arounds:
    a key is in the set iff one of its adds is among the last ``capacity``."""
    rng = random.Random(7)
    cap = 37
    recent = RecentKeys(cap)
    ring: deque[bytes] = deque()
    counts: Counter[bytes] = Counter()
    pool = [rng.randbytes(36) for _ in range(120)]
    for step in range(6000):
        key = rng.choice(pool)
        recent.add(key)
        ring.append(key)
        counts[key] += 1
        if len(ring) > cap:
            counts[ring.popleft()] -= 1
        assert recent.count == min(step + 1, cap)
        if step % 5 == 0:
            assert [k in recent for k in pool] == [counts[k] > 0 for k in pool], step


def test_recent_keys_memory_is_fixed_at_construction() -> None:
    """Ten times the capacity of distinct keys allocate nothing after construction, and the
    set neither holds the keys nor grows its arrays."""
    keys = [hashlib.sha256(str(i).encode()).digest() + b"\0\0\0\1" for i in range(20_000)]
    tracemalloc.start()
    try:
        recent = RecentKeys(2_000)
        built = tracemalloc.take_snapshot()
        sizes = (len(recent._table), len(recent._ring))
        for k in keys:
            recent.add(k)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    # Only what publish.py allocated: other threads of the test process (a previous test's
    # event loop, ZMQ's) allocate meanwhile too, and tracemalloc counts every thread.
    only = [tracemalloc.Filter(True, publish.__file__)]
    grown = sum(d.size_diff for d in after.filter_traces(only).compare_to(
        built.filter_traces(only), "filename"))
    assert grown < 1024  # no per-key allocation (an OrderedDict: ~150 B per key)
    assert (len(recent._table), len(recent._ring)) == sizes == (4096, 2_000)
    assert recent.count == 2_000
    assert keys[-1] in recent and keys[-2_000] in recent and keys[-2_001] not in recent


GEOMETRY = Geometry(namespace="recent-evictions", groups=(
    GroupSpec(kind=GroupKind.FULL_ATTENTION, tokens_per_block=16, bytes_per_block=256),),
    tokens_per_hash=16)


def test_evicted_miss_reason_without_any_event_endpoint(tmp_path) -> None:
    """No --events: a lookup of an evicted block still says ``evicted`` (counted in /metrics
    and ``kvoffload stats``), one never stored ``not_stored``."""
    hashes = [hashlib.sha256(f"b{i}".encode()).digest() for i in range(64)]
    with run_daemon(tmp_path, pool_bytes=16 * 256, slot_bytes=256) as d:
        client = DaemonClient(d.control, timeout_ms=5000)
        try:
            client.register(GEOMETRY)
            for h in hashes[:48]:  # three times the pool: the first ones are evicted
                key = make_key(h, 0)
                grant = client.prepare_store([p.StoreItem(key=key, end_token=16)])
                assert grant.outcomes == [p.StoreOutcome.GRANTED], grant
                assert client.commit_store([key]) == 1

            def miss(h: bytes) -> str | None:
                ans = client.lookup([p.LookupQuery(req_id="r", block_hashes=[h], num_tokens=17,
                                                   num_prompt_tokens=17, local_tokens=0)])[0]
                assert ans.hit_tokens == 0
                return ans.miss_reason

            assert miss(hashes[0]) == "evicted"
            assert miss(hashes[60]) == "not_stored"
        finally:
            client.close()
