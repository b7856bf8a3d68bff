"""``kvoffload stats``: parse, then summarize a running daemon (``kvoffload.daemon.ops.stats``)."""

from __future__ import annotations

import argparse

from kvoffload.daemon.ops.stats import run_stats


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("stats", help="summarize a running daemon (hit rates, pool, misses)")
    s.add_argument("--connect", metavar="EP",
                   help="control endpoint (default: ipc://<runtime dir>/control.sock when "
                        "--http is not given)")
    s.add_argument("--http", metavar="URL",
                   help="the daemon's HTTP address, HOST:PORT or http://HOST:PORT, for /metrics")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--timeout-ms", type=int, default=2000, help="per-request timeout (2000)")
    s.set_defaults(handler=run_stats)
