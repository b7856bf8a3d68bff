"""Two parts of ``DaemonEvents`` kept apart for size: per-engine views and lookup events.

Per-engine views (``--engine-view``, or ``add_engine_view`` called when an engine registers)
are publishers of the router stream whose batches carry one engine's ``data_parallel_rank``;
a view with ``engine=I`` also carries that engine's own GPU stream (``--engine-events`` #I),
so a router that indexes per worker (Dynamo) gets one complete stream per engine. Lookup
events are our versioned schema on their own endpoint (docs/events.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.store.index import Namespace
from kvoffload.events.hub import StoredRecord
from kvoffload.events.lookup_publisher import LookupEventPublisher
from kvoffload.events.profiles import (
    ViewSpec,
    auto_view_spec,
    format_topic,
    make_profile,
    parse_view_spec,
)
from kvoffload.events.publisher import EventPublisher
from kvoffload.events.schema import LookupEvent

__all__ = ["MAX_AUTO_VIEWS", "EngineView", "EngineViews", "LookupEvents", "event_options"]

log = logging.getLogger("kvoffload.daemon")

# Views opened for ranks engines announce: each binds sockets, so a client cannot make the
# daemon open more than this many (tries that failed count too: each one bound something).
MAX_AUTO_VIEWS = 64
# Failed view openings kept for /readyz (the newest; the counter has them all).
MAX_FAILURES_SHOWN = 16


@dataclasses.dataclass(slots=True)
class EngineView:
    """One per-engine publisher: our events stamped with `spec.rank` (+ an engine's GPU)."""

    spec: ViewSpec
    pub: EventPublisher
    engine: str | None = None  # the Register instance a view opened on Register serves


def event_options(config: Any) -> dict[str, Any]:
    """DaemonEvents keyword arguments from the daemon's Config (one place for server.py)."""
    profile = make_profile(config.events_profile, tails=config.events_tails,
                           ownership=config.events_ownership or None,
                           topic=config.events_topic)
    topic = format_topic(profile.topic, node=config.events_node, model=config.events_model)
    return {"profile": profile, "topic": topic, "batch_events": config.events_batch_events,
            "buffer_events": config.events_buffer_events,
            "buffer_bytes": config.events_buffer_bytes,
            "engine_views": list(config.engine_views),
            "auto_views": getattr(config, "engine_views_auto", "")}


class EngineViews:
    """Mixin of DaemonEvents: the per-engine view publishers."""

    views: list[EngineView]
    registry: Any  # DaemonEvents': where the view counter goes
    _pub_options: dict[str, Any]
    _resident: dict[int, StoredRecord]
    _auto_views = ""
    _auto_opened = 0  # views tried from the template: {index} of the next one
    _view_opens: Any = None  # kvoffload_engine_views_opened_total, with a template only
    _view_failures: list[dict[str, Any]]

    @property
    def auto_views(self) -> str:
        """engine_views_auto: the template of views opened on Register ("": none)."""
        return self._auto_views

    @auto_views.setter
    def auto_views(self, template: str) -> None:
        # Set once, by DaemonEvents.__init__: the counter is made here so that with a
        # template its series exist at 0 from the start (an alert on failures needs them).
        self._auto_views = template
        self._view_failures = []
        if template and self._view_opens is None:
            from prometheus_client import Counter

            self._view_opens = Counter(
                "kvoffload_engine_views_opened_total",
                "Per-engine event views opened on Register (--engine-views-auto), by outcome "
                "(ok, failed: the view could not bind; the engine is registered without it).",
                ["outcome"], registry=self.registry)
            for outcome in ("ok", "failed"):
                self._view_opens.labels(outcome)

    def view_status(self) -> dict[str, Any]:
        """For /readyz: every open view's endpoints, and the newest views that could not
        open (with why). A failed view is a detail, never a failed check: the daemon
        serves every engine without it."""
        views = [{"rank": v.spec.rank, "engine": v.engine, "events": v.pub.bound_endpoint,
                  "replay": v.pub.bound_replay_endpoint} for v in self.views]
        return {"engine_views": views, "engine_view_failures": list(self._view_failures)}

    # -- per-engine views ---------------------------------------------------------------

    _started = False

    def _open_view(self, spec: ViewSpec) -> EngineView:
        options = {**self._pub_options, "topic": spec.topic or self._pub_options["topic"]}
        pub = EventPublisher(spec.endpoint, spec.replay, data_parallel_rank=spec.rank,
                             stream=f"view-{spec.rank}", **options)
        view = EngineView(spec, pub)
        self.views.append(view)
        return view

    async def add_engine_view(self, spec: ViewSpec | str) -> EngineView:
        """Open one more per-engine view now (the hook for Register); returns it bound.

        The new view first announces every resident block of its namespace (records are
        kept once a view exists; blocks stored before that, without a hub or disk tier,
        are announced only when stored again), then carries the live events.
        """
        view = self._open_view(parse_view_spec(spec) if isinstance(spec, str) else spec)
        if self._started:
            await view.pub.start()
        if view.spec.namespace is None:  # records do not say their namespace
            for rec in list(self._resident.values()):
                view.pub.publish(rec.to_event())
        return view

    def engine_registered(self, data_parallel_rank: int | None,
                          instance: str = "") -> EngineView | None:
        """Register's hook: open the `auto_views` view of (instance, DP rank) unless open.

        Returns the view (new or existing), None when there is none to give (no template,
        no rank, or MAX_AUTO_VIEWS reached). Separate engines on a node are separate
        workers to a router even at the same DP rank (each vLLM instance has rank 0), so
        views are per vLLM engine_id and rank; a re-register of the same engine keeps its
        view, which stays open while the daemon runs. Never raises: a view that cannot
        bind is logged, counted and shown in /readyz (``view_status``), and the next view
        takes the next {index}: a port that failed once is not tried again by every engine."""
        if not self.auto_views or data_parallel_rank is None:
            return None
        for view in self.views:
            if view.engine == instance and view.spec.rank == data_parallel_rank:
                return view
        if self._auto_opened >= MAX_AUTO_VIEWS:
            return None
        index = self._auto_opened
        self._auto_opened += 1
        try:
            spec = auto_view_spec(self.auto_views, data_parallel_rank, index)
            view = self._open_view(spec)
        except Exception as exc:  # noqa: BLE001 - a view must never fail a Register
            # zmq.ZMQError (address in use, bad address) is not an OSError in pyzmq 27.
            self._view_failed(data_parallel_rank, instance, index, exc)
            return None
        view.engine = instance
        self._view_opens.labels("ok").inc()
        if self._started:
            view.pub.start_soon()
        for rec in list(self._resident.values()):
            view.pub.publish(rec.to_event())
        log.info("event view of DP rank %d (engine %r): events %s replay %s",
                 data_parallel_rank, instance, view.pub.bound_endpoint,
                 view.pub.bound_replay_endpoint)
        return view

    def _view_failed(self, rank: int, instance: str, index: int, exc: Exception) -> None:
        where = self.auto_views.replace("{rank}", str(rank)).replace("{index}", str(index))
        log.error("cannot open the event view of DP rank %d (engine %r, view %d: %s): %s; "
                  "the engine is registered without it", rank, instance, index, where, exc)
        self._view_opens.labels("failed").inc()
        self._view_failures.append({"rank": rank, "engine": instance, "index": index,
                                    "spec": where, "error": str(exc)})
        del self._view_failures[:-MAX_FAILURES_SHOWN]

    async def remove_engine_view(self, view: EngineView) -> None:
        """Close a view (its engine left); routers see its stream end."""
        if view in self.views:
            self.views.remove(view)
            await view.pub.aclose(flush=True)


class LookupEvents:
    """Mixin of DaemonEvents: one LookupEvent per answered lookup."""

    lookups: LookupEventPublisher | None

    def lookup(self, ns: Namespace, q: p.LookupQuery, a: p.LookupAnswer,
               seconds: float | None = None) -> None:
        if self.lookups is None:
            return
        hit = a.hit_tokens or 0
        if a.hit_tokens is None:
            outcome = "deferred"
        elif hit == 0:
            outcome = "miss"
        else:
            best = (q.num_prompt_tokens - 1) // ns.geometry.tokens_per_hash * \
                ns.geometry.tokens_per_hash
            outcome = "hit" if q.local_tokens + hit >= best else "partial"
        chunk = min(a.chunk_tokens, hit)
        self.lookups.publish(LookupEvent(
            request_id=q.req_id, namespace=ns.geometry.namespace,
            prompt_tokens=q.num_prompt_tokens, local_tokens=q.local_tokens, hit_tokens=hit,
            chunk_hit_tokens=chunk, tail_hit_tokens=hit - chunk, tail_boundary=a.tail_boundary,
            outcome=outcome,  # type: ignore[arg-type]
            miss_reason=a.miss_reason if outcome != "hit" else None,
            latency_us=None if seconds is None else int(seconds * 1e6),
            group_outcomes=self._group_outcomes(ns.geometry, a)))

    @staticmethod
    def _group_outcomes(geometry: Any, a: p.LookupAnswer) -> list[str]:
        out = ["miss"] * len(geometry.groups)
        for keys, outcome in ((a.hit_keys, "hit"), (a.pending_keys, "pending")):
            for key in keys:
                with contextlib.suppress(ValueError):  # a group id this engine lacks
                    out[geometry.group_pos(key)] = outcome
        return out
