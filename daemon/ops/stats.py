"""``kvoffload stats``: a summary of a running daemon, for humans or (``--json``) for scripts.

Two sources, usable together:

- ``--connect EP``: the control socket's ``Stats`` request (live pool and client counts, exact);
- ``--http URL``: the daemon's ``/metrics`` (counters since start: hit tokens, lookups by
  outcome, miss reasons, stores, evictions, errors).

The control socket knows nothing of counters and ``/metrics`` needs the HTTP port, so fields the
chosen sources cannot answer are ``null`` in ``--json`` and left out of the text summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Any

# A stats call holds a lease like any client; the shortest the daemon grants (100 ms) keeps
# the tool from showing up in other tools' client counts for long.
_STATS_LEASE_MS = 100

Samples = dict[str, list[tuple[dict[str, str], float]]]


# -- sources ------------------------------------------------------------------------------


def metrics_url(http: str) -> str:
    """``HOST:PORT``, ``http://HOST:PORT`` or a full ``.../metrics`` URL -> the metrics URL."""
    url = http if "://" in http else f"http://{http}"
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def scrape(http: str, timeout_s: float) -> Samples:
    """Every sample of the daemon's /metrics, by sample name (``_total`` etc. kept)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url(http), timeout=timeout_s) as resp:
        text = resp.read().decode()
    out: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name].append((dict(sample.labels), float(sample.value)))
    return out


def control_stats(endpoint: str, timeout_ms: int) -> dict[str, Any]:
    """The daemon's Stats reply plus the pool size from its Welcome."""
    from kvoffload.connector.client import DaemonClient

    client = DaemonClient(endpoint, timeout_ms=timeout_ms, name="kvoffload stats",
                          lease_ms=_STATS_LEASE_MS)
    try:
        welcome = client.connect()
        stats = dict(client.stats())
    finally:
        client.close()
    stats["pool_bytes"] = welcome.pool_bytes
    stats["pool_path"] = welcome.pool_path
    # The Stats request made this tool a client too: report the others.
    stats["clients"] = max(0, int(stats.get("clients", 0)) - 1)
    return stats


# -- summary ------------------------------------------------------------------------------


def _total(samples: Samples, name: str, **labels: str) -> float | None:
    rows = samples.get(name)
    if rows is None:
        return None
    return sum(v for lab, v in rows if all(lab.get(k) == want for k, want in labels.items()))


def _by(samples: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for lab, value in samples.get(name, []):
        out[lab.get(label, "")] += value
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def summarize(control: dict[str, Any] | None, samples: Samples | None) -> dict[str, Any]:
    """One flat object; control-socket values win over metrics (they are read live)."""
    m: Samples = samples or {}
    c = control or {}
    have_m = samples is not None

    def value(name: str, **labels: str) -> float | None:  # summed over matching samples
        return _total(m, name, **labels) if have_m else None

    slot_bytes: int | None = c.get("slot_bytes")
    ready: int | None = c.get("ready")
    pending: int | None = c.get("pending")
    used = None
    if ready is not None and pending is not None and slot_bytes is not None:
        used = (ready + pending) * slot_bytes  # what the daemon's used-bytes gauge counts
    requested = value("kvoffload_lookup_tokens_total", kind="requested")
    hit = value("kvoffload_lookup_tokens_total", kind="hit")
    chunk = value("kvoffload_lookup_tokens_total", kind="chunk_hit")
    tail = value("kvoffload_lookup_tokens_total", kind="tail_hit")
    out: dict[str, Any] = {
        "daemon_id": c.get("daemon_id"),
        "policy": c.get("policy"),
        "clients": c["clients"] if control else _int(value("kvoffload_clients_connected")),
        "namespaces": c["namespaces"] if control else _int(value("kvoffload_namespaces")),
        "blocks_resident": ready if control else _int(value("kvoffload_pool_slots",
                                                            state="ready")),
        "blocks_pending": pending if control else _int(value("kvoffload_pool_slots",
                                                             state="pending")),
        "pinned_slots": c["pinned"] if control else _int(value("kvoffload_pinned_slots")),
        "num_slots": c["num_slots"] if control else _int(value("kvoffload_pool_slots",
                                                               state="total")),
        "slot_bytes": slot_bytes,
        "bytes_used": used if control else _int(value("kvoffload_pool_bytes", state="used")),
        "bytes_total": c["pool_bytes"] if control else _int(value("kvoffload_pool_bytes",
                                                                  state="total")),
        "lookup_requests_total": _int(value("kvoffload_lookups_total")),
        "lookups_by_outcome": {k: int(v) for k, v in
                               _by(m, "kvoffload_lookups_total", "outcome").items()}
        if have_m else None,
        "requested_tokens_total": _int(requested),
        "hit_tokens_total": _int(hit),
        "chunk_hit_tokens_total": _int(chunk),
        "tail_hit_tokens_total": _int(tail),
        "hit_rate": _ratio(hit, requested),
        "chunk_hit_rate": _ratio(chunk, requested),
        "tail_hit_rate": _ratio(tail, requested),
        "miss_reasons": {k: int(v) for k, v in
                         _by(m, "kvoffload_lookup_misses_total", "reason").items()}
        if have_m else None,
        "stores_by_outcome": {k: int(v) for k, v in
                              _by(m, "kvoffload_stores_total", "outcome").items()}
        if have_m else None,
        "evictions_total": _int(value("kvoffload_evictions_total")),
        "leases_expired_total": _int(value("kvoffload_leases_expired_total")),
        "protocol_errors": {k: int(v) for k, v in
                            _by(m, "kvoffload_protocol_errors_total", "code").items()}
        if have_m else None,
    }
    used_b, total_b = out["bytes_used"], out["bytes_total"]
    out["pool_used_fraction"] = _ratio(used_b, total_b)
    return out


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{n} B"  # pragma: no cover - the loop always returns


def _n(x: int | None) -> str:
    """A count for humans: "?" when the chosen sources cannot say (never "None")."""
    return "?" if x is None else f"{x:,}"


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.1f} %"


def render(s: dict[str, Any], sources: list[str]) -> str:
    head = "kvoffload daemon" + (f" {s['daemon_id']}" if s["daemon_id"] else "")
    head += f" ({', '.join(sources)})" + (f", policy {s['policy']}" if s["policy"] else "")
    slot = f" of {_size(s['slot_bytes'])}" if s["slot_bytes"] is not None else ""
    lines = [
        head,
        f"  clients            {_n(s['clients'])}   namespaces {_n(s['namespaces'])}",
        f"  pool               {_size(s['bytes_used'])} of {_size(s['bytes_total'])} used "
        f"({_pct(s['pool_used_fraction'])})",
        f"  blocks             {_n(s['blocks_resident'])} resident, {_n(s['blocks_pending'])} "
        f"being stored, {_n(s['pinned_slots'])} pinned; {_n(s['num_slots'])} slots{slot}",
    ]
    if s["lookup_requests_total"] is None:
        lines.append("  (hit rates, misses and counters need --http HOST:PORT)")
        return "\n".join(lines)
    outcomes = ", ".join(f"{k} {v:,}" for k, v in s["lookups_by_outcome"].items())
    top = ", ".join(f"{k} {v:,}" for k, v in list(s["miss_reasons"].items())[:5])
    stores = ", ".join(f"{k} {v:,}" for k, v in s["stores_by_outcome"].items())
    errors = sum(s["protocol_errors"].values())
    lines += [
        f"  lookups            {s['lookup_requests_total']:,}"
        + (f" ({outcomes})" if outcomes else ""),
        f"  tokens             {s['requested_tokens_total'] or 0:,} requested, "
        f"{s['hit_tokens_total'] or 0:,} from cache ({_pct(s['hit_rate'])}: chunks "
        f"{_pct(s['chunk_hit_rate'])}, tails {_pct(s['tail_hit_rate'])})",
        f"  top miss reasons   {top or 'none'}",
        f"  stores             {stores or 'none'}",
        f"  evictions          {s['evictions_total'] or 0:,}   leases expired "
        f"{s['leases_expired_total'] or 0:,}   protocol errors {errors:,}",
    ]
    return "\n".join(lines)


def run_stats(args: argparse.Namespace) -> int:
    from kvoffload.daemon.config import Config

    endpoint = args.connect
    if endpoint is None and args.http is None:
        endpoint = Config().control  # the same default `kvoffload serve` binds
    control: dict[str, Any] | None = None
    samples: Samples | None = None
    sources: list[str] = []
    if endpoint is not None:
        from kvoffload.connector.client import DaemonUnavailable

        from kvoffload.hints import bad_endpoint, unavailable

        flag = "--connect" if args.connect is not None else "the default control endpoint"
        if why := bad_endpoint(flag, endpoint):
            print(f"kvoffload stats: {why}", file=sys.stderr)
            return 2
        try:
            control = control_stats(endpoint, args.timeout_ms)
        except DaemonUnavailable:
            print(f"kvoffload stats: {unavailable(flag, endpoint)}", file=sys.stderr)
            return 1
        except Exception as exc:  # refused or a bad reply: all end the same way
            why = str(exc) if endpoint in str(exc) else f"daemon at {endpoint}: {exc}"
            print(f"kvoffload stats: {why}", file=sys.stderr)
            return 1
        sources.append(endpoint)
    if args.http is not None:
        url = metrics_url(args.http)
        try:
            samples = scrape(args.http, args.timeout_ms / 1000)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            print(f"kvoffload stats: cannot read {url}: {exc}", file=sys.stderr)
            return 1
        sources.append(url)
    summary = summarize(control, samples)
    if args.json:
        print(json.dumps({"sources": sources, **summary}))
    else:
        print(render(summary, sources))
    return 0
