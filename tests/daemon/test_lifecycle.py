"""Start, readiness, metrics, graceful shutdown and refusing a second daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import make_key
from kvoffload.daemon.control import protocol as p

from tests.daemon.test_server import EXAMPLE, H, query, store
from tests.daemon_helpers import run_daemon


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_http_endpoints_and_metrics(tmp_path) -> None:
    with run_daemon(tmp_path) as d:
        assert get(d.http_url + "/healthz")[0] == 200
        status, body = get(d.http_url + "/readyz")
        assert status == 200 and json.loads(body)["ready"] is True
        c = DaemonClient(d.control, timeout_ms=5000)
        c.register(EXAMPLE)
        store(c, [make_key(H[3], 0), make_key(H[3], 1)])
        c.lookup([query()])
        c.call(p.Probe(rid=99, engine=42, keys=[]))
        _, metrics = get(d.http_url + "/metrics")
        assert 'kvoffload_lookups_total{outcome="chunk"} 1.0' in metrics
        assert 'kvoffload_lookup_tokens_total{kind="hit"} 16.0' in metrics
        assert 'kvoffload_stores_total{outcome="committed"} 2.0' in metrics
        assert 'kvoffload_protocol_errors_total{code="not_registered"} 1.0' in metrics
        assert "kvoffload_build_info" in metrics
        c.close()


def test_sigterm_exits_zero_and_frees_the_pool(tmp_path) -> None:
    with run_daemon(tmp_path) as d:
        c = DaemonClient(d.control, timeout_ms=5000)
        c.register(EXAMPLE)
        assert os.path.exists(d.pool_path)
        assert d.stop() == 0
        assert not os.path.exists(d.pool_path)
        assert "stopped" in d.log()
        c.close()


def test_second_daemon_on_same_endpoint_or_pool_fails_clearly(tmp_path) -> None:
    with run_daemon(tmp_path) as d:
        cmd = d.command()
        same_control = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert same_control.returncode == 1
        assert f"is in use by pid {d.proc.pid}" in same_control.stderr  # type: ignore[union-attr]
        other_control = [a if a != d.control else f"ipc://{d.workdir}/other.sock" for a in cmd]
        same_pool = subprocess.run(other_control, capture_output=True, text=True, timeout=60)
        assert same_pool.returncode == 1
        assert f"pool_path {d.pool_path} is locked by pid" in same_pool.stderr
        # The first daemon is untouched.
        c = DaemonClient(d.control, timeout_ms=5000)
        c.register(EXAMPLE)
        assert c.lookup([query()])[0].hit_tokens == 0
        c.close()


def test_bad_config_names_the_key(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvoffload", "serve", "--pool-bytes", "lots"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "pool_bytes" in out.stderr and "lots" in out.stderr
