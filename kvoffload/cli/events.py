"""``kvoffload events tail``: parse, then print a stream (``kvoffload.events.tail``)."""

from __future__ import annotations

import argparse
from typing import Any

from kvoffload.events.tail import run_tail


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `events` (with its `tail` subcommand) on the main CLI's subparsers."""
    events = subparsers.add_parser("events", help="KV-event stream tools")
    commands = events.add_subparsers(dest="events_command", metavar="COMMAND", required=True)
    p = commands.add_parser("tail", help="print a KV-event stream, one line per event")
    p.add_argument("--endpoint", required=True, help="PUB endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--replay", default=None, help="replay (ROUTER) endpoint, e.g. ...:5558")
    p.add_argument(
        "--from-seq",
        type=int,
        default=None,
        help="start at this seq (fetched by replay when --replay is given)",
    )
    p.add_argument("--topic", default="", help="topic prefix to subscribe to (default all)")
    p.add_argument("--json", action="store_true", help="one JSON object per event per line")
    p.add_argument("--lookup", action="store_true",
                   help="a lookup-event stream (default: recognised per batch)")
    p.add_argument("--count", type=int, default=None, help="exit 0 after N events")
    p.set_defaults(handler=run_tail)
    return events


def main(argv: list[str] | None = None) -> int:
    """``python -m kvoffload.cli.events``: accepts ``events tail ...`` or just the tail options."""
    import sys

    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] != ["events"]:
        args_in = ["events", "tail", *args_in]
    parser = argparse.ArgumentParser(prog="kvoffload")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(args_in)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
