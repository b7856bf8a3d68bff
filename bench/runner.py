"""``kvoffload bench``: run benchmark suites, each against a baseline measured in the same run.

Every suite returns ``{"ratio": R, "target": T, "meets": bool, ...details}``; R is ours relative
to the baseline in the direction the target states. A suite that misses says why in ``reason``
(which sub-target, by how much); where a suite gives none the CLI writes one from ratio vs
target. ``--seeds N`` runs each suite that takes ``seed`` N times and reports the spread.
Results are printed, and written as JSON and Markdown (with the command) under ``--out``.
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
from kvoffload.bench.quiet import quiet_libraries
from kvoffload.bench.seeds import aggregate_seeds, fill_reason
from kvoffload.bench.vllm_baseline import mark_not_run

# suite name -> (module, function). Each function takes quick: bool and returns a dict.
SUITES: dict[str, tuple[str, str]] = {
    "events": ("kvoffload.bench.suites.events", "run_events_bench"),
    "copy": ("kvoffload.bench.suites.copy", "run_copy_bench"),
    "lookup": ("kvoffload.bench.suites.lookup", "run_lookup_bench"),
    "memory": ("kvoffload.bench.suites.memory", "run_memory_bench"),
    "load": ("kvoffload.bench.suites.load", "run_load_bench"),
    "hybrid_chat": ("kvoffload.bench.suites.hybrid_chat", "run_hybrid_chat_bench"),
    "engine_chat": ("kvoffload.bench.suites.engine_chat", "run_engine_chat_bench"),
    "sharing": ("kvoffload.bench.suites.sharing", "run_sharing_bench"),
    "trace": ("kvoffload.bench.suites.trace", "run_trace_bench"),
    "restart": ("kvoffload.bench.suites.restart", "run_restart_bench"),
    "below_memory": ("kvoffload.bench.suites.below_memory", "run_below_memory"),
}
# Options some suites take (``kvoffload bench --trace FILE --trace-scale T``: trace, restart,
# below_memory), passed on to a suite whose function has a parameter of that name, when given.
SUITE_OPTIONS = ("trace", "trace_scale")
# Suites measured against vLLM's own code that still run without it (ours alone): their
# missing ratio is "not run: vLLM baseline not run: why", not a miss with "no ratio measured".
VLLM_BASELINE = {"events"}

class Progress:
    """A tqdm bar over every suite run on a TTY, phase lines on stderr otherwise (stdout stays
    one JSON object under --json)."""

    def __init__(self, total: int, tty: bool | None = None, stream: Any = None) -> None:
        stream = stream or sys.stderr
        self.tty = stream.isatty() if tty is None else tty
        self.bar: Any = None
        if self.tty:
            from tqdm import tqdm

            try:  # a terminal reporting 0 columns (some ptys) would get an empty bar
                sized = os.get_terminal_size(stream.fileno()).columns > 0
            except (OSError, ValueError, AttributeError):
                sized = False
            self.bar = tqdm(total=total, file=stream, unit="run", dynamic_ncols=sized,
                            ncols=None if sized else 100, nrows=None if sized else 40,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}]{postfix}")

    def suite(self, name: str) -> Callable[[str], None]:
        started = time.perf_counter()
        if self.bar is not None:
            self.bar.set_description(name, refresh=False)
            self.bar.set_postfix_str("starting")  # not the last suite's phase
        else:
            print(f"running {name} ...", file=sys.stderr, flush=True)

        def say(message: str) -> None:
            if self.bar is not None:
                self.bar.set_postfix_str(message[:60])
            else:
                print(f"  [{name} {time.perf_counter() - started:6.1f}s] {message} ...",
                      file=sys.stderr, flush=True)

        return say

    def done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _call(fn: Callable[..., dict[str, Any]], quick: bool, say: Callable[[str], None],
          seed: int | None = None, options: dict[str, Any] | None = None) -> dict[str, Any]:
    # Suites that report phases take ``progress``, seed-aware ones ``seed``; the others are
    # called as before.
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {k: v for k, v in (options or {}).items()
                              if k in params and v is not None}
    if "progress" in params:
        kwargs["progress"] = say
    if seed is not None and "seed" in params:
        kwargs["seed"] = seed
    return fn(quick, **kwargs)


def takes_seed(fn: Callable[..., Any]) -> bool:
    return "seed" in inspect.signature(fn).parameters


def _suite(name: str) -> Callable[[bool], dict[str, Any]] | None:
    module, func = SUITES[name]
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError):
        return None


def run_suite(name: str, fn: Callable[..., dict[str, Any]], quick: bool, seeds: int,
              progress: Progress, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """One suite, once or once per seed; never raises (a broken suite must not hide the
    others' numbers)."""
    started = time.perf_counter()
    runs: list[tuple[int, dict[str, Any]]] = []
    for seed in range(seeds) if takes_seed(fn) else [None]:
        say = progress.suite(name if seed is None or seeds == 1 else f"{name} seed {seed}")
        try:
            result = _call(fn, quick, say, seed, options)
        except Exception as exc:
            result = {"ratio": None, "target": None, "meets": False, "error": repr(exc)}
        progress.done()
        runs.append((0 if seed is None else seed, result))
    result = runs[0][1] if len(runs) == 1 else aggregate_seeds(runs)
    result = fill_reason(name, baseline_not_run(name, result))
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


def baseline_not_run(name: str, result: dict[str, Any]) -> dict[str, Any]:
    """``result`` marked not run (with why) when it has no ratio because its baseline could
    not run: vLLM missing for a ``VLLM_BASELINE`` suite, or a suite's own ``baseline`` saying
    "unavailable: ...". What the suite did measure stays in the result."""
    if result.get("ratio") is not None or result.get("not_run") or result.get("error"):
        return result
    if name in VLLM_BASELINE and mark_not_run(result):
        return result
    baseline = result.get("baseline")
    if isinstance(baseline, str) and baseline.startswith("unavailable"):
        result["reason"] = result["not_run"] = f"baseline not run: {baseline}"
    return result


def run_bench(args: argparse.Namespace) -> int:
    if args.seeds < 1:
        print(f"kvoffload bench: --seeds {args.seeds}: must be at least 1", file=sys.stderr)
        return 2
    with quiet_libraries(args.verbose):
        return _run_bench(args)


def _run_bench(args: argparse.Namespace) -> int:
    names = args.suite or sorted(SUITES)
    fns = {name: _suite(name) for name in names}
    total = sum(args.seeds if fn is not None and takes_seed(fn) else 1 for fn in fns.values())
    progress = Progress(total)
    options = {k: getattr(args, k, None) for k in SUITE_OPTIONS}
    results: dict[str, Any] = {}
    try:
        for name in names:
            fn = fns[name]
            if fn is None:
                results[name] = fill_reason(name, {
                    "ratio": None, "target": None, "meets": False,
                    "error": "suite not available in this build"})
                progress.done()
                continue
            results[name] = run_suite(name, fn, args.quick, args.seeds, progress, options)
    finally:
        progress.close()
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


def _num(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, int | float) else str(v)


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"Command: `{report['command']}`", "",
             "| suite | ratio | seeds (min / median / max) | target | meets | reason |",
             "|---|---|---|---|---|---|"]
    notes = []
    for name, r in report["suites"].items():
        ratio = r.get("ratio")
        meets = r.get("meets")
        if r.get("not_run") or r.get("error"):
            meets = "not run" if ratio is None else meets
            notes.append(f"- {name}: {r.get('not_run') or r.get('error')}")
        s = r.get("seeds")
        spread = (f"{_num(s['min'])} / {_num(s['median'])} / {_num(s['max'])} (n={s['n']})"
                  if isinstance(s, dict) and s.get("min") is not None else "")
        reason = "" if meets is True else str(r.get("reason", "")).replace("|", "/")
        lines.append(f"| {name} | {_num(ratio) if ratio is not None else None} | {spread} | "
                     f"{r.get('target')} | {meets} | {reason} |")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def suite_main(run: Callable[..., dict[str, Any]]) -> None:
    """``python -m kvoffload.bench.suites.<name> [--full] [--seed N]``: one suite, full size
    with ``--full``, its JSON on stdout and its phases on stderr."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    kwargs: dict[str, Any] = {"quick": "--full" not in sys.argv,
                              "progress": lambda m: print(f"  {m} ...", file=sys.stderr)}
    if "--seed" in sys.argv:
        kwargs["seed"] = int(sys.argv[sys.argv.index("--seed") + 1])
    print(json.dumps(run(**kwargs), indent=2))
