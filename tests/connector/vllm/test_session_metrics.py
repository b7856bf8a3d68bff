"""Whether an engine is attached to the daemon, on vLLM's own ``/metrics`` path.

vLLM 0.33's real pieces drive it: the core ``Scheduler`` (``log_stats``) calls
``KVOffloadConnector.get_kv_connector_stats`` each step and puts the payload in its
``SchedulerStats``; the payload crosses vLLM's engine-core msgpack encoding, and vLLM's
``PrometheusStatLogger`` (the API server's) records it into the prometheus_client registry,
with the metrics ``KVOffloadSpec.build_metric_definitions`` declared. Values are read back from
that registry, as ``/metrics`` serves them.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_helpers import DaemonHandle, run_daemon
from tests.plugin_common import plugin_config
from tests.vllm_harness import vllm_import_error

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]

ROOT = Path(__file__).resolve().parents[3]
PROMPT = list(range(7, 37))  # 30 tokens: stores offered at its first step
ATTACHED = "vllm:kvoffload_daemon_attached"
COUNTERS = ("vllm:kvoffload_daemon_offline_total", "vllm:kvoffload_daemon_attach_failures_total",
            "vllm:kvoffload_daemon_attaches_total", "vllm:kvoffload_lookups_offline_total",
            "vllm:kvoffload_stores_skipped_offline_total")


class Frontend:
    """vLLM's API-server side of one engine: its stat logger over the global registry."""

    LABELS = {"model_name": "mini", "engine": "0"}

    def __init__(self, engine: Any) -> None:
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        engine.vllm_config.model_config.served_model_name = "mini"  # the bench's stub lacks it
        self.logger = PrometheusStatLogger(engine.vllm_config, [0])
        self.engine = engine

    def step(self) -> None:
        """One engine step; its stats go the way the engine core sends them."""
        from vllm.v1.engine import EngineCoreOutputs
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        self.engine.step()
        stats = self.engine.scheduler_stats
        assert stats is not None  # log_stats: every step reports
        wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))
        sent = MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats
        self.logger.record(scheduler_stats=sent, iteration_stats=None, engine_idx=0)

    def serve(self, req_id: str) -> None:
        self.engine.add(PROMPT, req_id, max_tokens=2)
        for _ in range(50):
            if not self.engine.busy():
                return
            self.step()
        raise AssertionError("the request did not finish")

    def value(self, name: str) -> float | None:
        from prometheus_client import REGISTRY

        return REGISTRY.get_sample_value(name, self.LABELS)


def engine(control: str, **extra: Any) -> Any:
    from tests.plugin_engine import MiniEngine

    return MiniEngine(plugin_config(control, kvoffload_copy_async=False, **extra),
                      connector="KVOffloadConnector", connector_module="kvoffload.connector.vllm",
                      log_stats=True)


@pytest.fixture
def no_daemon_yet() -> Iterator[DaemonHandle]:
    """A daemon's endpoint with nothing behind it until the test starts it."""
    workdir = Path(tempfile.mkdtemp(prefix="kvo-"))  # ipc paths stay short
    handle = DaemonHandle(workdir, (), 64 << 20, None, None)
    try:
        yield handle
    finally:
        handle.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


def test_an_engine_started_offline_says_so_then_attaches(no_daemon_yet: DaemonHandle) -> None:
    daemon = no_daemon_yet
    e = engine(daemon.control, kvoffload_timeout_ms=300, kvoffload_retry_ms=200)
    front = Frontend(e)
    manager = e.connector.scheduler.manager
    assert not manager.session.attached  # nothing answered at the endpoint
    front.serve("offline")
    assert front.value(ATTACHED) == 0
    assert (front.value("vllm:kvoffload_daemon_attach_failures_total") or 0) >= 1
    assert (front.value("vllm:kvoffload_daemon_offline_total") or 0) >= 1
    assert front.value("vllm:kvoffload_daemon_attaches_total") == 0
    assert front.value("vllm:kvoffload_lookups_offline_total") == 1  # the one request
    skipped = manager.counters["stores_skipped_offline"]
    assert skipped > 0 and front.value("vllm:kvoffload_stores_skipped_offline_total") == skipped
    # vLLM's own offloading metrics are still there, next to ours.
    assert front.value("vllm:kv_offload_lookup_sync_delay_seconds_count") == 1

    daemon.start()  # the engine re-attaches by itself, between steps
    deadline = time.monotonic() + 30
    while not manager.session.attached and time.monotonic() < deadline:
        front.step()
        time.sleep(0.01)
    assert manager.session.attached
    front.step()  # the step after the attach reports it
    assert front.value(ATTACHED) == 1
    assert front.value("vllm:kvoffload_daemon_attaches_total") == 1
    front.serve("attached")
    assert front.value("vllm:kvoffload_lookups_offline_total") == 1  # no lookup since
    e.shutdown()


def test_an_engine_attached_at_start_reports_it(tmp_path: Path) -> None:
    with run_daemon(tmp_path) as daemon:
        e = engine(daemon.control)
        front = Frontend(e)
        front.serve("first")
        assert front.value(ATTACHED) == 1
        # Every counter has its series from the first step on, at 0: rate() sees the first rise.
        assert {name: front.value(name) for name in COUNTERS} == {
            "vllm:kvoffload_daemon_offline_total": 0,
            "vllm:kvoffload_daemon_attach_failures_total": 0,
            "vllm:kvoffload_daemon_attaches_total": 1,
            "vllm:kvoffload_lookups_offline_total": 0,
            "vllm:kvoffload_stores_skipped_offline_total": 0}
        # What the alerts read is what vLLM records, with the labels they aggregate by.
        alerts = (ROOT / "dashboards/alerts.yaml").read_text()
        named = set(re.findall(r"vllm:kvoffload_[a-z0-9_]+", alerts))
        assert ATTACHED in named
        assert {name: front.value(name) is not None for name in named} == dict.fromkeys(
            named, True)
        e.shutdown()
