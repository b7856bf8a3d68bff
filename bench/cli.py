"""``kvoffload bench``: run benchmark suites, each against a baseline measured in the same run.

Every suite returns ``{"ratio": R, "target": T, "meets": bool, ...details}``; R is ours relative
to the baseline in the direction the target states. Results are printed, and written as JSON and
Markdown (with the command that produced them) under ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# suite name -> (module, function). Each function takes quick: bool and returns a dict.
SUITES: dict[str, tuple[str, str]] = {
    "events": ("kvoffload.bench.events", "run_events_bench"),
    "copy": ("kvoffload.bench.copy", "run_copy_bench"),
    "lookup": ("kvoffload.bench.lookup", "run_lookup_bench"),
    "memory": ("kvoffload.bench.memory", "run_memory_bench"),
}


def _suite(name: str) -> Callable[[bool], dict[str, Any]] | None:
    module, func = SUITES[name]
    try:
        return getattr(importlib.import_module(module), func)  # type: ignore[no-any-return]
    except (ImportError, AttributeError):
        return None


def add_bench_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    b = sub.add_parser("bench", help="benchmarks against same-run baselines")
    b.add_argument("--suite", action="append", choices=sorted(SUITES),
                   help="run only this suite (repeatable)")
    b.add_argument("--quick", action="store_true", help="small sizes (CI smoke runs)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--out", default="bench-results", help="folder for JSON and Markdown results")
    b.set_defaults(handler=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    names = args.suite or sorted(SUITES)
    results: dict[str, Any] = {}
    for name in names:
        fn = _suite(name)
        if fn is None:
            results[name] = {"ratio": None, "target": None, "meets": False,
                             "error": "suite not available in this build"}
            continue
        started = time.perf_counter()
        if not args.json:
            print(f"running {name} ...", file=sys.stderr)
        try:
            results[name] = fn(args.quick)
        except Exception as exc:  # a broken suite must not hide the others' numbers
            results[name] = {"ratio": None, "target": None, "meets": False, "error": repr(exc)}
        results[name]["seconds"] = round(time.perf_counter() - started, 2)
    command = "kvoffload " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(
        sys.argv) > 1 else "kvoffload bench"
    report = {"command": command, "suites": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    (out / "bench.md").write_text(render_markdown(report))
    if args.json:
        print(json.dumps(report))
    else:
        print(render_markdown(report))
    return 0


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"Command: `{report['command']}`", "", "| suite | ratio | target | meets |",
             "|---|---|---|---|"]
    for name, r in report["suites"].items():
        ratio = r.get("ratio")
        lines.append(f"| {name} | {ratio if ratio is None else f'{ratio:.2f}'} | "
                     f"{r.get('target')} | {r.get('meets')} |")
    return "\n".join(lines) + "\n"
