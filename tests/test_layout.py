"""The source tree's shape: no import circle, modules of a readable size, names told apart.

The import graph is read from the files (``ast``), the way a reader or a tool follows imports:
every ``import`` that runs, at module level or inside a function, except under
``TYPE_CHECKING``. A package importing its own submodules (``__init__`` re-exports) is not a
circle; a submodule importing its package's ``__init__`` is not counted either.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOTS = {"kvoffload": "kvoffload", "kvoffload.daemon": "daemon", "kvoffload.events": "events",
         "kvoffload.connector": "connector", "kvoffload.bench": "bench"}
MAX_LINES = 420  # "about 400": a module past this is split by role


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for name, folder in ROOTS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([name, *parts])] = path
    return mods


def _imports(mod: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes: Sequence[ast.stmt | ast.ExceptHandler]) -> None:  # handlers hold bodies
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                child = getattr(node, field, None)
                if isinstance(child, list):
                    visit([c for c in child if isinstance(c, ast.stmt | ast.ExceptHandler)])
            if isinstance(node, ast.ExceptHandler):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return {n for n in found if n in known and n != mod and not mod.startswith(n + ".")}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def test_the_cycle_finder_finds_a_planted_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_circle_in_the_tree() -> None:
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert sum(len(v) for v in graph.values()) > 100  # the reader follows imports at all
    assert _cycles(graph) == []


def test_modules_stay_readable_in_size() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_two_modules_of_a_package_differ_by_a_letter_or_a_suffix() -> None:
    by_package: dict[Path, list[str]] = {}
    for path in _modules().values():
        if path.name != "__init__.py":
            by_package.setdefault(path.parent, []).append(path.stem)
    close = []
    for folder, names in by_package.items():
        for i, a in enumerate(sorted(names)):
            for b in sorted(names)[i + 1:]:
                one_letter = len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) == 1
                suffix = b.startswith(a + "_") or b.startswith(a) and len(b) - len(a) <= 2
                if one_letter or suffix or difflib.SequenceMatcher(None, a, b).ratio() > 0.9:
                    close.append(f"{folder.relative_to(ROOT)}: {a} / {b}")
    assert close == []
