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
    # The identity the vLLM plugin sends on Register (vLLM's engine_id and DP rank): with it a
    # daemon started with --engine-views-auto opens a per-engine event view for this engine.
    d.add_argument("--instance", default="", metavar="ID",
                   help="engine id sent on Register (as vLLM's engine_id; default none)")
    d.add_argument("--data-parallel-rank", type=int, default=None, metavar="N",
                   help="DP rank sent on Register (default none: no per-engine view)")
    d.add_argument("--daemon-wait", type=float, default=10.0, metavar="S",
                   help="how long to wait for a daemon that stopped answering (default 10 s)")
    d.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvoffload.bench.demo import main as demo_main

    return demo_main(args)
