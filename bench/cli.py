"""``kvoffload bench``: run benchmark suites, each against a baseline measured in the same run.

Every suite returns ``{"ratio": R, "target": T, "meets": bool, ...details}``; R is ours relative
to the baseline in the direction the target states. Results are printed, and written as JSON and
Markdown (with the command that produced them) under ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvoffload.bench.plots import write_plots

# suite name -> (module, function). Each function takes quick: bool and returns a dict.
SUITES: dict[str, tuple[str, str]] = {
    "events": ("kvoffload.bench.events", "run_events_bench"),
    "copy": ("kvoffload.bench.copy", "run_copy_bench"),
    "lookup": ("kvoffload.bench.lookup", "run_lookup_bench"),
    "memory": ("kvoffload.bench.memory", "run_memory_bench"),
    "load": ("kvoffload.bench.load", "run_load_bench"),
    "hybrid_chat": ("kvoffload.bench.hybrid_chat", "run_hybrid_chat_bench"),
    "engine_chat": ("kvoffload.bench.engine_chat", "run_engine_chat_bench"),
    "sharing": ("kvoffload.bench.sharing", "run_sharing_bench"),
}


def _progress(name: str, started: float) -> Callable[[str], None]:
    """Phase lines on stderr (stdout stays one JSON object under --json)."""

    def say(message: str) -> None:
        print(f"  [{name} {time.perf_counter() - started:6.1f}s] {message} ...", file=sys.stderr,
              flush=True)

    return say


def _call(fn: Callable[..., dict[str, Any]], quick: bool, say: Callable[[str], None]
          ) -> dict[str, Any]:
    # Suites that report phases take ``progress``; the others are called as before.
    if "progress" in inspect.signature(fn).parameters:
        return fn(quick, progress=say)
    return fn(quick)


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
    # vLLM logs to stdout at INFO; the baselines import it, and --json must stay parseable.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    results: dict[str, Any] = {}
    for name in names:
        fn = _suite(name)
        if fn is None:
            results[name] = {"ratio": None, "target": None, "meets": False,
                             "error": "suite not available in this build"}
            continue
        started = time.perf_counter()
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            results[name] = _call(fn, args.quick, _progress(name, started))
        except Exception as exc:  # a broken suite must not hide the others' numbers
            results[name] = {"ratio": None, "target": None, "meets": False, "error": repr(exc)}
        results[name]["seconds"] = round(time.perf_counter() - started, 2)
    command = "kvoffload " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if len(
        sys.argv) > 1 else "kvoffload bench"
    report = {"command": command, "suites": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    plots = write_plots(report, out)
    markdown = render_markdown(report) + "".join(f"\n![{p.stem}]({p.name})\n" for p in plots)
    (out / "bench.md").write_text(markdown)
    if args.json:
        print(json.dumps(report))
    else:
        print(markdown)
        if plots:
            print(f"plots: {', '.join(str(p) for p in plots)}")
    return 0


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"Command: `{report['command']}`", "", "| suite | ratio | target | meets |",
             "|---|---|---|---|"]
    notes = []
    for name, r in report["suites"].items():
        ratio = r.get("ratio")
        meets = r.get("meets")
        if r.get("not_run") or r.get("error"):
            meets = "not run" if ratio is None else meets
            notes.append(f"- {name}: {r.get('not_run') or r.get('error')}")
        lines.append(f"| {name} | {ratio if ratio is None else f'{ratio:.2f}'} | "
                     f"{r.get('target')} | {meets} |")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"
