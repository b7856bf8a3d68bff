"""The shared tier with a real ``mooncake_master`` (built-in HTTP metadata server) and two real
daemons with separate pools: a block stored through one is found, promoted and loaded through
the other, bytes checked; a dead master degrades the tier and lookups still answer."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.tiers.base import BlockMeta
from kvoffload.daemon.tiers.disk.files import encode_meta
from kvoffload.daemon.tiers.mooncake.values import decode_into, encode_value, load_store_class

from tests.daemon.test_server import EXAMPLE, query
from tests.daemon.tiers.test_disk import (
    POOL,
    SLOT,
    A,
    content,
    metric,
    open_pool,
    other_keys,
    store,
)
from tests.daemon_helpers import run_daemon

try:
    load_store_class()
    _SKIP = ""
except (ImportError, OSError) as exc:  # the wheel, or libibverbs1 / librdmacm1 / libnuma1
    _SKIP = f"mooncake store client cannot load: {exc}"
MASTER = Path(sys.executable).parent / "mooncake_master"
if not _SKIP and not MASTER.exists():
    _SKIP = f"{MASTER} not found (pip install mooncake-transfer-engine-non-cuda)"
needs_mooncake = pytest.mark.skipif(bool(_SKIP), reason=_SKIP)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


class Master:
    def __init__(self, tmp: Path) -> None:
        self.rpc, self.http = free_port(), free_port()
        self.log = tmp / "master.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [str(MASTER), f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http}", f"--metrics_port={free_port()}"],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT)

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                socket.create_connection(("127.0.0.1", self.rpc), 0.2).close()
                socket.create_connection(("127.0.0.1", self.http), 0.2).close()
                return True
            except OSError:
                return False
        wait_for(up)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def args(self, *extra: str) -> tuple[str, ...]:
        return ("--mooncake-master", f"127.0.0.1:{self.rpc}",
                "--mooncake-metadata", f"http://127.0.0.1:{self.http}/metadata",
                "--mooncake-local-hostname", "127.0.0.1",
                "--mooncake-segment-bytes", "16MiB", "--mooncake-buffer-bytes", "16MiB", *extra)


@pytest.fixture
def master(tmp_path) -> Iterator[Master]:
    m = Master(tmp_path)
    m.start()
    try:
        yield m
    finally:
        m.kill()


def ready(d) -> dict:
    try:
        body = urllib.request.urlopen(f"{d.http_url}/readyz", timeout=5).read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
    return json.loads(body)


def connected(d) -> None:
    wait_for(lambda: ready(d)["checks"].get("mooncake") == "ok", 20)


def unknown_query() -> p.LookupQuery:
    hashes = [hashlib.sha256(f"none{i}".encode()).digest() for i in range(7)]
    return p.LookupQuery(req_id="u", block_hashes=hashes, num_tokens=30, num_prompt_tokens=30)


def test_value_format_round_trip_and_checks() -> None:
    data = bytes(range(256)) * 2
    value = encode_value(data, encode_meta(BlockMeta(16, True)))
    buf = bytearray(SLOT)
    meta = decode_into(value, memoryview(buf))
    assert meta is not None and (meta.end_token, meta.tail) == (16, True) and buf == data
    rotten = bytearray(value)
    rotten[-1] ^= 1
    assert decode_into(bytes(rotten), memoryview(buf)) is None
    assert decode_into(value[:-3], memoryview(buf)) is None
    assert decode_into(value, memoryview(bytearray(SLOT - 1))) is None  # larger than a slot


@needs_mooncake
@pytest.mark.parametrize("put", ["commit", "evict"])
def test_block_stored_on_one_node_loads_on_another(tmp_path, master, put) -> None:
    with run_daemon(tmp_path, *master.args("--mooncake-put", put), pool_bytes=POOL,
                    slot_bytes=SLOT) as a, \
            run_daemon(tmp_path, *master.args(), pool_bytes=POOL, slot_bytes=SLOT) as b:
        connected(a)
        connected(b)
        ca, cb = DaemonClient(a.control, timeout_ms=5000), DaemonClient(b.control, timeout_ms=5000)
        ca.register(EXAMPLE)
        cb.register(EXAMPLE)
        pa, pb = open_pool(a), open_pool(b)
        store(ca, pa, A)
        if put == "evict":  # only evicted blocks go: push A out of a's four-slot pool
            assert metric(a, "kvoffload_tier_ops_total", op="write") == 0
            store(ca, pa, other_keys("fill", 4))
        wait_for(lambda: metric(a, "kvoffload_tier_ops_total", tier="mooncake", op="write") >= 2)
        # b never saw A: its first lookup parks on the store check, then on the promotion.
        # A hit before the 60 s deadline can only come from the futures waking it.
        ans = cb.lookup([query()], wait_ms=60_000, pin=True, timeout_ms=90_000)[0]
        assert ans.hit_tokens == 16 and ans.load_keys == A
        for key, slot in zip(ans.load_keys, ans.slots, strict=True):
            assert pb[slot * SLOT:(slot + 1) * SLOT] == content(key)
        cb.complete_load(ans.load_keys)
        assert metric(b, "kvoffload_tier_promotions_total", tier="mooncake", outcome="ok") == 2
        assert metric(b, "kvoffload_tier_ops_total", op="exist_hit") == 2
        # Keys nobody stored: one check, then a MISS (cached) with no promotion.
        assert cb.lookup([unknown_query()], wait_ms=2000)[0].hit_tokens == 0
        # The fetched blocks are not pushed back, whatever the mode.
        assert metric(b, "kvoffload_tier_ops_total", op="write") == 0
        for pool, c in ((pa, ca), (pb, cb)):
            pool.close()
            c.close()


@needs_mooncake
def test_dead_master_degrades_the_tier_and_lookups_still_answer(tmp_path, master) -> None:
    with run_daemon(tmp_path, *master.args(), pool_bytes=POOL, slot_bytes=SLOT) as d:
        connected(d)
        assert metric(d, "kvoffload_tier_degraded", tier="mooncake") == 0
        client = DaemonClient(d.control, timeout_ms=5000)
        client.register(EXAMPLE)
        master.kill()
        wait_for(lambda: metric(d, "kvoffload_tier_degraded", tier="mooncake") == 1, 20)
        r = ready(d)
        assert r["ready"] and r["checks"]["mooncake"].startswith("degraded")
        # Skipped at once: a lookup parked on the dead store would outlast the client's 5 s
        # timeout (wait_ms 60 s) and raise DaemonUnavailable.
        ans = client.lookup([query()], wait_ms=60_000, timeout_ms=5000)[0]
        assert ans.hit_tokens == 0 and ans.miss_reason != "pending"
        pool = open_pool(d)
        store(client, pool, A)  # the pool serves on; the push is dropped and counted
        assert client.lookup([query()])[0].hit_tokens == 16
        assert metric(d, "kvoffload_tier_ops_total", tier="mooncake", op="write_skipped") == 2
        assert urllib.request.urlopen(f"{d.http_url}/healthz", timeout=5).status == 200
        pool.close()
        client.close()
        # The client's C++ teardown (~20 s against a dead master) is skipped: a stop that
        # ran it would outlast this bound.
        assert d.stop(timeout=10) == 0


@needs_mooncake
def test_daemon_starts_without_a_master(tmp_path) -> None:
    m = Master(tmp_path)  # ports reserved, nothing listening
    with run_daemon(tmp_path, *m.args(), pool_bytes=POOL, slot_bytes=SLOT) as d:
        assert ready(d)["checks"]["mooncake"].startswith("degraded")
        client = DaemonClient(d.control, timeout_ms=5000)
        client.register(EXAMPLE)
        assert client.lookup([query()], wait_ms=1000)[0].hit_tokens == 0
        client.close()
        m.start()  # the master comes up later: the tier connects by itself
        try:
            connected(d)
        finally:
            m.kill()


@needs_mooncake
def test_blocks_stored_before_the_tier_connects_are_queued_then_pushed(tmp_path) -> None:
    m = Master(tmp_path)  # ports reserved, nothing listening yet
    with run_daemon(tmp_path, *m.args(), pool_bytes=POOL, slot_bytes=SLOT) as a:
        client = DaemonClient(a.control, timeout_ms=5000)
        client.register(EXAMPLE)
        pool = open_pool(a)
        store(client, pool, A)  # before any master exists: queued, not dropped
        assert metric(a, "kvoffload_tier_ops_total", tier="mooncake", op="write_queued") == 2
        assert metric(a, "kvoffload_tier_ops_total", tier="mooncake", op="write_skipped") == 0
        assert "2 blocks queued" in ready(a)["checks"]["mooncake"]
        m.start()
        try:
            connected(a)
            wait_for(lambda: metric(a, "kvoffload_tier_ops_total", tier="mooncake",
                                    op="write") == 2, 20)
            # They are really in the store: another node that never saw them loads them.
            with run_daemon(tmp_path, *m.args(), pool_bytes=POOL, slot_bytes=SLOT) as b:
                connected(b)
                cb = DaemonClient(b.control, timeout_ms=5000)
                cb.register(EXAMPLE)
                ans = cb.lookup([query()], wait_ms=60_000, pin=True, timeout_ms=90_000)[0]
                assert ans.hit_tokens == 16 and ans.load_keys == A
                pb = open_pool(b)
                for key, slot in zip(ans.load_keys, ans.slots, strict=True):
                    assert pb[slot * SLOT:(slot + 1) * SLOT] == content(key)
                pb.close()
                cb.close()
        finally:
            m.kill()
        pool.close()
        client.close()


def test_mooncake_master_binary_is_where_setup_puts_it() -> None:
    if _SKIP:
        pytest.skip(_SKIP)
    assert shutil.which(str(MASTER))


@needs_mooncake
def test_fetched_blocks_are_announced_as_remote(tmp_path, master) -> None:
    from kvoffload.events.schema import BlockStored, decode_batch

    from tests.daemon.streams.test_publish import replay_all

    events = ("--events", "tcp://127.0.0.1:*", "--events-replay", "tcp://127.0.0.1:*",
              "--event-hashes", "bytes")
    with run_daemon(tmp_path, *master.args(*events), pool_bytes=POOL, slot_bytes=SLOT) as a, \
            run_daemon(tmp_path, *master.args(*events), pool_bytes=POOL, slot_bytes=SLOT) as b:
        connected(a)
        connected(b)
        ca, cb = DaemonClient(a.control, timeout_ms=5000), DaemonClient(b.control, timeout_ms=5000)
        ca.register(EXAMPLE)
        cb.register(EXAMPLE)
        pa = open_pool(a)
        grant = ca.prepare_store([p.StoreItem(key=k, end_token=16, token_ids=list(range(16)))
                                  for k in A])
        for key, slot in zip(A, grant.slots, strict=True):
            pa[slot * SLOT:(slot + 1) * SLOT] = content(key)
        ca.commit_store(A)
        wait_for(lambda: metric(a, "kvoffload_tier_ops_total", tier="mooncake", op="write") >= 2)
        assert cb.lookup([query()], wait_ms=5000)[0].hit_tokens == 16
        got = [ev for payload in replay_all(b.ready["events_replay"])
               for ev in decode_batch(payload).events if isinstance(ev, BlockStored)]
        groups = [ev.group_idx for ev in got]
        assert None not in groups and sorted(g for g in groups if g is not None) == [0, 1]
        for ev in got:
            assert (ev.medium, ev.locality) == ("CPU", "REMOTE")
            assert ev.token_ids == list(range(16)) and ev.block_hashes == [A[0][:-4]]
        pa.close()
        ca.close()
        cb.close()


@needs_mooncake
def test_rotten_object_in_the_store_is_a_counted_miss(tmp_path, master) -> None:
    from kvoffload.daemon.store.index import Namespace
    from kvoffload.daemon.tiers.disk.tier import namespace_hash
    from kvoffload.daemon.tiers.mooncake.tier import MooncakeTier

    other = load_store_class()()  # another node, writing garbage under A's store keys
    assert other.setup("127.0.0.1", f"http://127.0.0.1:{master.http}/metadata", 16 << 20,
                       16 << 20, "tcp", "", f"127.0.0.1:{master.rpc}") == 0
    try:
        nsh = namespace_hash(Namespace(0, EXAMPLE, {}))
        names = [MooncakeTier.store_key((nsh, k)) for k in A]
        assert other.put_batch(names, [b"not a block" * 10] * 2) == 0
        with run_daemon(tmp_path, *master.args(), pool_bytes=POOL, slot_bytes=SLOT) as d:
            connected(d)
            client = DaemonClient(d.control, timeout_ms=5000)
            client.register(EXAMPLE)
            assert client.lookup([query()], wait_ms=3000)[0].hit_tokens == 0
            wait_for(lambda: metric(d, "kvoffload_tier_corrupt_total", tier="mooncake") == 2)
            assert metric(d, "kvoffload_tier_promotions_total", outcome="failed") == 2
            client.close()
    finally:
        other.close()
