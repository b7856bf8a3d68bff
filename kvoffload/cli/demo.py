"""``kvoffload demo``: parse, then run the demo engine (``kvoffload.bench.demo``)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="a daemon plus a simulated hybrid-model engine")
    d.add_argument("--connect", help="use a running daemon's control endpoint")
    from kvoffload.bench.workload import PRESETS

    d.add_argument("--preset", default="qwen3.6-27b-tp1", metavar="NAME",
                   help=f"model geometry, one of: {', '.join(sorted(PRESETS))} "
                        "(default qwen3.6-27b-tp1)")
    d.add_argument("--scale", type=float, default=1 / 1024,
                   help="byte scale factor so the run fits this machine (default 1/1024)")
    d.add_argument("--requests", type=int, default=300, help="requests (turns) to simulate")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--pool-bytes", default="64MiB", help="pool size of the embedded daemon")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.add_argument("--daemon-wait", type=float, default=10.0, metavar="S",
                   help="how long to wait for a daemon that stopped answering (default 10 s)")
    d.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvoffload.bench.demo import main as demo_main

    return demo_main(args)
