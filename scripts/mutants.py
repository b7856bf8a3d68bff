"""Every guard that keeps bytes correct, removed one at a time: the suite must fail each time.

A guard no test fails without is not a guard. Each mutant (``mutant_list.py``) removes one
mechanism (a literal edit of one file, which must match exactly once) in a scratch copy of the
checkout and runs the tests that cover it there; a mutant whose tests still pass *survived*, and this script
exits 1. The copy is imported in place of the checkout through ``mutants/sitecustomize.py``
(child processes too: the daemon, TP ranks). Run by CI after the suite:
``bash scripts/mutants.sh`` (``-k NAME`` runs the mutants whose name contains NAME).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mutant_list import MUTANTS, Mutant  # scripts/ is sys.path[0]: run as a script

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _scratch() -> Path:
    dest = Path(tempfile.mkdtemp(prefix="kvoffload-mutant-"))
    ignore = shutil.ignore_patterns(".git", ".venv", ".venv-*", "__pycache__", "*.egg-info",
                                    ".mypy_cache", ".ruff_cache", ".pytest_cache", "build")
    shutil.copytree(ROOT, dest / "tree", ignore=ignore, symlinks=True)
    return dest / "tree"


def run(mutant: Mutant, tree: Path, python: str) -> tuple[bool, float, str]:
    """(survived, seconds, last lines of output) of one mutant."""
    originals: dict[Path, str] = {}
    for path, old, new in mutant.edits():
        target = tree / path
        text = originals.setdefault(target, target.read_text()) if target not in originals \
            else target.read_text()
        if text.count(old) != 1:
            for t, o in originals.items():
                t.write_text(o)
            raise SystemExit(f"mutant {mutant.name!r}: its text occurs {text.count(old)} times"
                             f" in {path} (must be once): update scripts/mutants.py")
        target.write_text(text.replace(old, new))
    env = {**os.environ, "KVOFFLOAD_MUTANT_ROOT": str(tree),
           "PYTHONPATH": os.pathsep.join([str(tree / "scripts" / "mutants"),
                                          os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "KVOFFLOAD_STRESS_S": os.environ.get("KVOFFLOAD_STRESS_S", "3")}
    start = time.monotonic()
    try:
        proc = subprocess.run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               *mutant.tests], cwd=tree, env=env, capture_output=True,
                              text=True, timeout=600)
        out, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired:
        out, code = "timed out", 1  # a hang is a failure of the suite: the mutant is caught
    finally:
        for target, text in originals.items():
            target.write_text(text)
    tail = "\n".join(out.strip().splitlines()[-3:])
    # Exit 1: tests failed (caught). 0: they passed (survived). Anything else (collection
    # errors, no tests) proves nothing.
    if code not in (0, 1):
        raise SystemExit(f"mutant {mutant.name!r}: pytest exited {code}:\n{out[-2000:]}")
    return code == 0, time.monotonic() - start, tail


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only mutants whose name contains this")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if m.tests and args.k in m.name]
    if not chosen:  # a mistyped -k would otherwise read as "0 survived", a pass
        print(f"no mutant's name contains {args.k!r} (scripts/mutant_list.py)", file=sys.stderr)
        return 2
    tree = _scratch()
    survived = []
    try:
        for m in chosen:
            alive, seconds, tail = run(m, tree, args.python)
            print(f"{'SURVIVED' if alive else 'caught  '} {seconds:5.1f}s  {m.name}", flush=True)
            if alive:
                survived.append(m.name)
                print("    " + tail.replace("\n", "\n    "))
    finally:
        shutil.rmtree(tree.parent, ignore_errors=True)
    print(f"{len(chosen) - len(survived)} caught, {len(survived)} survived")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
