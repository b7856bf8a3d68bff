"""Issue 26: quotas count per engine identity or per process, not per connection.

One process with two connections held 1024 of 1024 slots pending and every other engine got
``no_space``. Now the clients of one engine (``Register.instance``) share one quota, and so do
the anonymous clients of one process (its pid, which libzmq reads from the ipc socket's
SO_PEERCRED). Each holder below is a process of its own, so pids really differ.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvoffload.bench.suites.load import metric_sum, scrape_metrics
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, make_key
from kvoffload.daemon.control import protocol as p

from tests.daemon_helpers import DaemonHandle, run_daemon

GEOM = Geometry(namespace="groups", groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16, 1024),),
                tokens_per_hash=16)
SLOTS = 512  # 512 KiB pool of 1 KiB slots; the default share is half of it
SHARE = SLOTS // 2

# One holder process: connects N clients (with the given instances), each prepares `want`
# new keys and keeps them pending; prints the granted counts, holds until stdin closes,
# then says Bye.
HOLDER = """
import hashlib, json, sys
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, make_key
from kvoffload.daemon.control import protocol as p
control, tag, want, instances = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
geom = Geometry(namespace="groups", groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16, 1024),),
                tokens_per_hash=16)
granted = []
clients = []
for n, instance in enumerate(instances):
    c = DaemonClient(control, timeout_ms=20_000)
    c.register(geom, instance="" if instance == "-" else instance)
    keys = [make_key(hashlib.sha256(f"{tag}-{n}-{i}".encode()).digest(), 0) for i in range(want)]
    grant = c.prepare_store([p.StoreItem(key=k, end_token=16) for k in keys])
    granted.append(grant.outcomes.count(p.StoreOutcome.GRANTED))
    clients.append(c)
print(json.dumps(granted), flush=True)
sys.stdin.read()
for c in clients:
    c.close()  # Bye: what they hold is released at once
"""


class Holder:
    def __init__(self, d: DaemonHandle, tag: str, want: int, *instances: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, d.control, tag, str(want),
                                      *instances], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"holder {tag} failed"
        self.granted: list[int] = json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonHandle]:
    with run_daemon(tmp_path, pool_bytes=SLOTS << 10, slot_bytes=1024) as d:
        yield d


def _free_for(d: DaemonHandle, tag: str, n: int) -> list[p.StoreOutcome]:
    """What a client of this (third) process gets when it stores n new keys."""
    c = DaemonClient(d.control, timeout_ms=20_000)
    c.register(GEOM, instance=f"bystander-{tag}")
    keys = [make_key(hashlib.sha256(f"{tag}{i}".encode()).digest(), 0) for i in range(n)]
    outcomes = c.prepare_store([p.StoreItem(key=k, end_token=16) for k in keys]).outcomes
    c.close()
    return outcomes


def test_one_process_with_two_connections_gets_one_share(daemon: DaemonHandle) -> None:
    hog = Holder(daemon, "hog", SHARE, "-", "-")  # two anonymous connections, one process
    try:
        assert hog.granted == [SHARE, 0]  # the second connection shares the first's quota
        assert metric_sum(scrape_metrics(daemon.http_url), "kvoffload_refused_total",
                          reason="quota_pending") == SHARE
        # Every other engine still finds the rest of the pool (it got no_space before).
        assert _free_for(daemon, "other", SHARE) == [p.StoreOutcome.GRANTED] * SHARE
    finally:
        hog.close()


def test_one_engine_identity_shares_its_quota_across_processes(daemon: DaemonHandle) -> None:
    first = Holder(daemon, "a", SHARE, "engine-a")
    second = Holder(daemon, "b", SHARE, "engine-a")  # the same engine, another process
    try:
        assert first.granted == [SHARE] and second.granted == [0]
        assert _free_for(daemon, "c", SHARE) == [p.StoreOutcome.GRANTED] * SHARE
    finally:
        first.close()
        second.close()


def test_distinct_engines_of_one_process_each_get_a_share(daemon: DaemonHandle) -> None:
    """A process that runs several engines (the benchmarks do) names each: a share each."""
    both = Holder(daemon, "two", SHARE, "engine-x", "engine-y")
    try:
        assert both.granted == [SHARE, SHARE]
    finally:
        both.close()
    # Its clients are gone with it (Bye, or the socket's close): their quota is free again.
    assert _free_for(daemon, "after", SHARE) == [p.StoreOutcome.GRANTED] * SHARE
