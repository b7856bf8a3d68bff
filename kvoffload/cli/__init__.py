"""The ``kvoffload`` command: one module per sub-command, each parsing and delegating.

``serve`` (the daemon), ``demo``, ``events tail``, ``stats``, ``keys``, and ``bench`` when the
bench package is installed. Nothing but argument parsing lives in this package.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvoffload import __version__
from kvoffload.cli import demo, events, keys, serve, stats


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvoffload", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvoffload {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (serve, demo, events, stats, keys):
        command.add_parser(sub)
    try:
        from kvoffload.cli import bench
    except ImportError:  # the bench package is optional in minimal installs
        pass
    else:
        bench.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
