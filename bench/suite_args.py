"""The command line of the trace-replay suites run alone: ``python -m
kvoffload.bench.suites.{trace,below_memory,restart} [--full] [--trace F] [--trace-scale T]
[--window N] [--windows N] [--routing R]``, one parser for the three (``kvoffload bench``
passes ``--trace`` and ``--trace-scale`` to them through the runner's ``SUITE_OPTIONS``).

``--full`` is the full size (default: ``--quick`` sizes); the suite's JSON goes to stdout, its
phase lines to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any


def trace_suite_parser(suite: str, routings: Sequence[str], *, routing: str | None = None,
                       window: bool = True) -> argparse.ArgumentParser:
    """``routing`` None: ``--routing`` may repeat (default: every routing the suite runs),
    else one routing with that default. ``window``: the suite takes ``--window N`` (requests
    per window)."""
    ap = argparse.ArgumentParser(prog=f"python -m kvoffload.bench.suites.{suite}")
    ap.add_argument("--full", action="store_true", help="full sizes (default: --quick sizes)")
    ap.add_argument("--trace", metavar="FILE",
                    help="a Mooncake FAST'25 format trace; default: a generated one")
    ap.add_argument("--trace-scale", type=int, default=16, metavar="T",
                    help="tokens each 512-token hash id stands for (a multiple of 16)")
    if window:
        ap.add_argument("--window", type=int, metavar="N", help="requests per window")
    ap.add_argument("--windows", type=int, metavar="N", help="how many windows")
    if routing is None:
        ap.add_argument("--routing", action="append", choices=routings,
                        help="run only this routing (repeatable)")
    else:
        ap.add_argument("--routing", default=routing, choices=routings)
    return ap


def stderr_progress(message: str) -> None:
    print(f"  {message} ...", file=sys.stderr, flush=True)


def run_alone(run: Callable[..., dict[str, Any]], args: argparse.Namespace,
              **kwargs: Any) -> None:
    """``run(quick, trace=..., trace_scale=..., n_windows=..., [window=...,] **kwargs)`` with
    the parsed ``args``, its JSON on stdout."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if getattr(args, "window", None) is not None:
        kwargs["window"] = args.window
    print(json.dumps(run(not args.full, trace=args.trace, trace_scale=args.trace_scale,
                         n_windows=args.windows, progress=stderr_progress, **kwargs), indent=2))
