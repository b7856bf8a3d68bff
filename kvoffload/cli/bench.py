"""``kvoffload bench``: parse, then run suites against same-run baselines (``kvoffload.bench.runner``)."""

from __future__ import annotations

import argparse

from kvoffload.bench.runner import SUITES, run_bench


def add_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks against same-run baselines")
    b.add_argument("--suite", action="append", choices=sorted(SUITES),
                   help="run only this suite (repeatable)")
    b.add_argument("--quick", action="store_true", help="small sizes (CI smoke runs)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--seeds", type=int, default=1, metavar="N",
                   help="run each seed-aware suite with seeds 0..N-1 and report the spread")
    b.add_argument("--verbose", action="store_true",
                   help="keep vLLM's and Mooncake's own logging on stderr")
    b.add_argument("--trace", metavar="FILE",
                   help="a Mooncake FAST'25 format trace (JSON lines: timestamp, input_length, "
                        "output_length, hash_ids) for the trace, restart and below_memory "
                        "suites; default: "
                        "a generated one")
    b.add_argument("--trace-scale", type=int, metavar="T",
                   help="tokens each 512-token hash id of the trace stands for (a multiple of "
                        "16; default 16)")
    b.add_argument("--out", default="bench-results", help="folder for JSON and Markdown results")
    b.set_defaults(handler=run_bench)
