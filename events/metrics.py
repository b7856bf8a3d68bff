"""Prometheus metrics of the KV-event wire layer, defined once per registry.

Every publisher and subscriber asks `event_metrics(registry)` for the shared set; a second call
with the same registry returns the same objects, so several publishers (or tests that build
many) never hit prometheus_client's duplicate-registration error. Tests pass their own
`CollectorRegistry` to read values in isolation; production uses the global `REGISTRY`.
Label `stream` names the publisher/subscriber (e.g. "kv", "lookup", "engine-0").
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter

__all__ = ["EventMetrics", "event_metrics"]


@dataclass(frozen=True, slots=True)
class EventMetrics:
    published_batches: Counter
    published_events: Counter
    dropped_batches: Counter  # labels: stream, reason (queue_full, closed, encode_error, ...)
    replay_requests: Counter
    replayed_batches: Counter
    received_batches: Counter  # labels: stream, source (live, replay)
    gaps: Counter  # seq jumps seen on the live stream
    missed_batches: Counter  # batches a gap lost for good (replay could not supply them)
    resets: Counter  # publisher restarts (seq regressions)
    malformed: Counter  # labels: stream, kind (frames, seq, payload, replay)


_lock = threading.Lock()
_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, EventMetrics] = (
    weakref.WeakKeyDictionary()
)


def _build(registry: CollectorRegistry) -> EventMetrics:
    def counter(name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, ("stream", *labels), registry=registry)

    return EventMetrics(
        published_batches=counter(
            "kvoffload_events_published_batches", "Event batches sent on the PUB socket."
        ),
        published_events=counter(
            "kvoffload_events_published_events", "Events (inside batches) sent on PUB."
        ),
        dropped_batches=counter(
            "kvoffload_events_dropped_batches",
            "Event batches the publisher dropped instead of blocking its producer.",
            "reason",
        ),
        replay_requests=counter(
            "kvoffload_events_replay_requests", "Replay requests served by the publisher."
        ),
        replayed_batches=counter(
            "kvoffload_events_replayed_batches", "Buffered batches re-sent to replay clients."
        ),
        received_batches=counter(
            "kvoffload_events_subscriber_received_batches",
            "Batches a subscriber handed to its consumer.",
            "source",
        ),
        gaps=counter(
            "kvoffload_events_subscriber_gaps",
            "Sequence jumps a subscriber saw on the live stream.",
        ),
        missed_batches=counter(
            "kvoffload_events_subscriber_missed_batches",
            "Batches lost for good: neither live nor replay delivered them.",
        ),
        resets=counter(
            "kvoffload_events_subscriber_resets",
            "Publisher restarts a subscriber saw (sequence regressions).",
        ),
        malformed=counter(
            "kvoffload_events_subscriber_malformed",
            "Malformed messages a subscriber skipped, by kind.",
            "kind",
        ),
    )


def event_metrics(registry: CollectorRegistry | None = None) -> EventMetrics:
    """The event metrics registered in `registry` (default: the global REGISTRY)."""
    reg = REGISTRY if registry is None else registry
    with _lock:
        metrics = _by_registry.get(reg)
        if metrics is None:
            metrics = _build(reg)
            _by_registry[reg] = metrics
        return metrics
