"""Every Prometheus metric the daemon exports, defined once, here.

Each daemon owns a registry (so several can live in one process, as in the demo and tests);
``/metrics`` serves exactly that registry. Label sets are bounded: outcomes, reasons and kinds
come from fixed enums, never from client-supplied strings.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from kvoffload import __version__

_LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
                    2.5e-2, 0.1, 0.5, 1.0)
# Event-loop lag: how late a timer fires. 10 ms is the stall bar, 100 ms the /healthz bar.
_LAG_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5,
                10.0)
# A Register: ~0.1 ms once the pool is sized; the first one sizes the slots and publishes the
# shared index (a table the size of the pool), so the range runs to the engine's 30 s bound
# (connector/session.py REGISTER_MS).
_REGISTER_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                     30.0)
# Why the transport refused a request before any handler saw it (server.py, http.py).
REFUSAL_REASONS = ("frame_too_large", "nesting", "parked_lookups", "query_hashes",
                   "http_connections", "http_timeout", "http_bad_request")


class DaemonMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.build_info = Info("kvoffload_build", "Build information.", registry=r)
        self.build_info.info({"version": __version__})
        self.requests = Counter("kvoffload_requests_total", "Control requests by operation.",
                                ["op"], registry=r)
        self.protocol_errors = Counter("kvoffload_protocol_errors_total",
                                       "Requests answered with a typed error, by code.",
                                       ["code"], registry=r)
        self.lookups = Counter("kvoffload_lookups_total",
                               "Request lookups by outcome (chunk, tail, miss, deferred).",
                               ["outcome"], registry=r)
        self.lookup_misses = Counter("kvoffload_lookup_misses_total",
                                     "Lookups that found nothing, by reason.", ["reason"],
                                     registry=r)
        self.lookup_tokens = Counter("kvoffload_lookup_tokens_total",
                                     "Prompt tokens looked up, by kind (requested, hit, "
                                     "chunk_hit, tail_hit).", ["kind"], registry=r)
        self.lookup_seconds = Histogram("kvoffload_lookup_duration_seconds",
                                        "Daemon-side time of one batched lookup message.",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.register_seconds = Histogram("kvoffload_register_duration_seconds",
                                          "Daemon-side time to answer one Register (refusals "
                                          "included).", buckets=_REGISTER_BUCKETS, registry=r)
        self.futures_waiting = Gauge("kvoffload_futures_waiting",
                                     "Lookups parked on a pending key's future.", registry=r)
        self.stores = Counter("kvoffload_stores_total",
                              "Store keys by outcome (granted, exists, no_space, too_big, "
                              "committed, aborted, expired).", ["outcome"], registry=r)
        self.stored_bytes = Counter("kvoffload_stored_bytes_total",
                                    "Bytes of committed stores (all ranks).", registry=r)
        self.loads = Counter("kvoffload_loads_total",
                             "Keys pinned for loading, by outcome (pinned, missing, completed).",
                             ["outcome"], registry=r)
        self.loaded_bytes = Counter("kvoffload_loaded_bytes_total",
                                    "Bytes of keys pinned for loading (all ranks).", registry=r)
        self.evictions = Counter("kvoffload_evictions_total", "Blocks evicted, by policy and "
                                 "reason.", ["policy", "reason"], registry=r)
        self.pool_bytes = Gauge("kvoffload_pool_bytes", "Pool bytes by state (total, used, "
                                "free, pending).", ["state"], registry=r)
        self.pool_slots = Gauge("kvoffload_pool_slots", "Pool slots by state.", ["state"],
                                registry=r)
        self.pinned_slots = Gauge("kvoffload_pinned_slots", "Slots pinned for loading.",
                                  registry=r)
        self.blocks = Gauge("kvoffload_blocks", "Ready blocks by group kind and tier.",
                            ["kind", "tier"], registry=r)
        self.clients = Gauge("kvoffload_clients_connected", "Clients holding a lease.",
                             registry=r)
        self.leases_expired = Counter("kvoffload_leases_expired_total",
                                      "Client leases that expired; their pins and pending "
                                      "stores were released.", registry=r)
        self.pins_released = Counter("kvoffload_expired_pins_total",
                                     "Pins released because their client's lease expired.",
                                     registry=r)
        self.engines = Gauge("kvoffload_namespaces", "Registered engine namespaces.",
                             registry=r)
        self.tails_declined = Counter("kvoffload_tails_declined_total",
                                      "Partial tails that could not repay their load under the "
                                      "engine's time model, by decision (load, store).",
                                      ["decision"], registry=r)
        # Tiers below the pool (daemon/tiers): label `tier` is a fixed name ("disk").
        self.tier_bytes = Gauge("kvoffload_tier_bytes",
                                "Tier bytes by state (used, total; writing: not yet on disk).",
                                ["tier", "state"], registry=r)
        self.tier_blocks = Gauge("kvoffload_tier_blocks", "Blocks held by a tier.", ["tier"],
                                 registry=r)
        self.tier_ops = Counter("kvoffload_tier_ops_total", "Tier operations (write, write_not_worth, "
                                "write_skipped, write_error, read, read_memory, read_error, "
                                "eviction).", ["tier", "op"], registry=r)
        self.tier_corrupt = Counter("kvoffload_tier_corrupt_total", "Tier blocks that failed "
                                    "a length or checksum check, dropped.", ["tier"], registry=r)
        self.tier_promotions = Counter("kvoffload_tier_promotions_total", "Promotions into "
                                       "the pool (started, ok, failed, no_room).",
                                       ["tier", "outcome"], registry=r)
        self.tier_read_seconds = Histogram("kvoffload_tier_read_duration_seconds",
                                           "Time to read one block from a tier.", ["tier"],
                                           buckets=_LATENCY_BUCKETS, registry=r)
        self.tier_promote_seconds = Histogram("kvoffload_tier_promote_duration_seconds",
                                              "From a probe's miss to the promoted block's "
                                              "commit.", ["tier"], buckets=_LATENCY_BUCKETS,
                                              registry=r)
        self.tier_degraded = Gauge("kvoffload_tier_degraded", "1 while a tier fails its I/O "
                                   "and is skipped by lookups.", ["tier"], registry=r)
        # The loop's health (daemon/ops/loop_health.py) and what the transport refused.
        self.loop_lag = Histogram("kvoffload_event_loop_lag_seconds",
                                  "How late a periodic timer on the daemon's event loop fired "
                                  "(a stalled loop delays every client and /healthz).",
                                  buckets=_LAG_BUCKETS, registry=r)
        self.loop_lag_max = Gauge("kvoffload_event_loop_lag_max_seconds",
                                  "Largest event-loop lag seen since start.", registry=r)
        self.refused = Counter("kvoffload_refused_total",
                               "Requests or connections refused by a transport limit, by "
                               "reason.", ["reason"], registry=r)
        self.http_connections = Gauge("kvoffload_http_connections",
                                      "Open HTTP connections.", registry=r)
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)
        # Start every bounded label at 0 so rate() sees the first increment.
        for decision in ("load", "store"):
            self.tails_declined.labels(decision)
        for outcome in ("chunk", "tail", "miss", "deferred"):
            self.lookups.labels(outcome)
        for reason in ("not_stored", "evicted", "group_missing", "pending", "too_short",
                       "client_gone"):
            self.lookup_misses.labels(reason)
        for kind in ("requested", "hit", "chunk_hit", "tail_hit"):
            self.lookup_tokens.labels(kind)
        for outcome in ("granted", "exists", "no_space", "too_big", "not_worth", "committed",
                        "aborted", "expired"):
            self.stores.labels(outcome)
        for outcome in ("pinned", "missing", "completed"):
            self.loads.labels(outcome)
        for code in ("malformed", "unsupported_version", "not_registered", "geometry_mismatch",
                     "bad_request", "too_large", "shutting_down", "internal"):
            self.protocol_errors.labels(code)
