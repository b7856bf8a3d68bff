"""Whether this engine is attached to the daemon, as vLLM's own connector metrics.

An engine that cannot reach the daemon serves on without offload (lookups miss, stores are
skipped), so nothing fails that an operator would see; these metrics are how it shows. They
travel the way vLLM 0.33 carries the offloading connector's scheduler-side numbers:

* the names are declared by ``KVOffloadSpec.build_metric_definitions`` (vLLM's spec hook): the
  API server's ``OffloadPromMetrics`` (built by ``OffloadingConnector.build_prom_metrics``)
  registers them next to vLLM's own ``vllm:kv_offload_*`` metrics, labelled ``model_name`` and
  ``engine``;
* each scheduler step, vLLM's ``Scheduler.update_from_output`` calls the connector's
  ``get_kv_connector_stats`` in the engine-core process; ``KVOffloadConnector`` adds what
  ``SessionMetrics.collect`` reads from the manager to the stock payload
  (``OffloadingConnectorStats``), which ``make_stats`` puts in ``SchedulerStats`` and the
  engine core sends to the API server, whose ``PrometheusStatLogger`` observes it.

The session's and manager's numbers are running totals; vLLM's payload carries increments
(summed into Prometheus counters), so only what grew since the last step is sent, after a first
payload that starts every series (at 0 where nothing happened: ``rate()`` then sees the first
rise). The gauge is sent when it changes (and at the first step): the payload stays empty, and
vLLM's periodic "KV Transfer metrics" log line silent, while nothing happens. vLLM steps only
a busy engine: an idle engine's state shows with its next request.

The ``vllm:`` prefix is what every metric on vLLM's ``/metrics`` carries (its own offloading
specs' and tiers' metrics too), and it matters: vLLM's ``PrometheusStatLogger`` unregisters
every ``vllm:`` collector before registering its own, so a second stat logger in one process
(a second ``AsyncLLM``: tests, notebooks) starts afresh; another prefix would stay registered
and the second registration fail as a duplicate. ``kvoffload_`` after it tells ours from
vLLM's ``vllm:kv_offload_*``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

ATTACHED = "vllm:kvoffload_daemon_attached"
OFFLINE = "vllm:kvoffload_daemon_offline"  # prometheus_client exposes counters as *_total
ATTACH_FAILURES = "vllm:kvoffload_daemon_attach_failures"
ATTACHES = "vllm:kvoffload_daemon_attaches"
LOOKUPS_OFFLINE = "vllm:kvoffload_lookups_offline"
STORES_SKIPPED_OFFLINE = "vllm:kvoffload_stores_skipped_offline"

# metric -> (where the running total lives: "session" or "manager" counters, its key)
_TOTALS = {
    OFFLINE: ("session", "offline_events"),
    ATTACH_FAILURES: ("session", "attach_failures"),
    ATTACHES: ("session", "attaches"),
    STORES_SKIPPED_OFFLINE: ("manager", "stores_skipped_offline"),
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """What ``KVOffloadSpec.build_metric_definitions`` declares (docs/vllm.md, Metrics)."""
    return {
        ATTACHED: OffloadingGaugeMetadata(documentation=(
            "1 while this engine's scheduler is attached to the kvoffload daemon, 0 while it "
            "is offline (lookups miss, stores are skipped); updated at the engine's steps.")),
        OFFLINE: OffloadingCounterMetadata(documentation=(
            "Times this engine went offline from the kvoffload daemon: an attach that failed, "
            "or a daemon found gone, frozen, restarted or refusing the engine's messages.")),
        ATTACH_FAILURES: OffloadingCounterMetadata(documentation=(
            "Attaches to the kvoffload daemon that failed (no daemon answered, or it refused "
            "the registration); each also counts as going offline.")),
        ATTACHES: OffloadingCounterMetadata(documentation=(
            "Attaches to the kvoffload daemon that succeeded: the first, then one per "
            "re-attach after going offline.")),
        LOOKUPS_OFFLINE: OffloadingCounterMetadata(documentation=(
            "Request lookups vLLM made while the engine was offline from the kvoffload "
            "daemon (answered as misses: the prompt is computed).")),
        STORES_SKIPPED_OFFLINE: OffloadingCounterMetadata(documentation=(
            "Blocks vLLM offered to store while the engine was offline from the kvoffload "
            "daemon (not stored).")),
    }


class SessionMetrics:
    """One engine's attach state and offline totals, turned into vLLM stats payloads."""

    def __init__(self) -> None:
        self.lookups_offline = 0  # counted by KVOffloadConnector around vLLM's lookup
        self._sent: dict[str, int] = {}  # metric -> the running total sent so far
        self._attached: bool | None = None  # the gauge as last sent (None: never)

    def collect(self, manager: Any) -> OffloadingConnectorStats | None:
        """What changed since the last call, as a payload for ``get_kv_connector_stats``;
        None when nothing did. ``manager``: our ``DaemonOffloadingManager``."""
        attached = bool(manager.session.attached)
        sources = {"session": manager.session.counters, "manager": manager.counters}
        totals = {name: int(sources[where].get(key, 0))
                  for name, (where, key) in _TOTALS.items()}
        totals[LOOKUPS_OFFLINE] = self.lookups_offline
        if attached == self._attached and totals == self._sent:
            return None  # the usual step: nothing changed, no payload built (vLLM asks each step)
        stats = OffloadingConnectorStats()
        if attached != self._attached:
            stats.set_gauge(ATTACHED, int(attached))
            self._attached = attached
        for name, total in totals.items():
            sent = self._sent.get(name)
            if sent is None or total > sent:  # the first payload starts every series, at 0 too
                stats.increase_counter(name, total - (sent or 0))
            self._sent[name] = total  # a total that started over counts on from there
        return None if stats.is_empty() else stats
