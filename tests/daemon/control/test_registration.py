"""A real daemon process times every Register it answers, on its ``/metrics``
(``kvoffload_register_duration_seconds``): the one that sizes the pool, later ones, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvoffload.bench.suites.load import metric_sum, scrape_metrics
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.control import protocol as p

from tests.daemon.test_server import EXAMPLE
from tests.daemon_helpers import run_daemon

NAME = "kvoffload_register_duration_seconds"


def test_each_register_is_one_observation(tmp_path: Path) -> None:
    with run_daemon(tmp_path, pool_bytes=16 << 20) as d:
        before = scrape_metrics(d.http_url)
        assert metric_sum(before, f"{NAME}_count") == 0  # a daemon nobody registered with yet
        clients = [DaemonClient(d.control, timeout_ms=5000, name=f"engine {i}") for i in range(3)]
        try:
            clients[0].register(EXAMPLE)  # sizes the pool's slots, publishes the index
            clients[1].register(EXAMPLE)
            with pytest.raises(p.ProtocolError) as refused:  # answered too: with an error
                clients[2].register(EXAMPLE, rank=1)  # not in a tensor-parallel world of 1
            assert refused.value.code == p.ErrorCode.BAD_REQUEST
            after = scrape_metrics(d.http_url)
        finally:
            for c in clients:
                c.close()
    assert metric_sum(after, f"{NAME}_count") == 3
    assert metric_sum(after, f"{NAME}_bucket", le="+Inf") == 3
    assert metric_sum(after, f"{NAME}_sum") > 0
    assert metric_sum(after, "kvoffload_requests_total", op="register") == 3  # the same three
