"""Names the docs show exist in the code: every `kvoffload_*` key or metric, every
`kvoffload <command>` and every `--flag` given to one, in README.md, BENCHMARKS.md, docs/*.md and
deploy/**/*.md (and the flags in README's table of `kvoffload serve` flags).

A key is known when the source has it as a string (a plugin key the plugin reads, a metric it
registers; Prometheus' `_total`, `_bucket`, `_sum`, `_count` forms included); commands and flags
are looked up in the real argument parser (`kvoffload.cli.build_parser`), sub-commands too.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvoffload.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md"),
               *(ROOT / "deploy").rglob("*.md")])
SOURCE = [p for folder in ("daemon", "connector", "events", "bench", "kvoffload")
          for p in (ROOT / folder).rglob("*.py")]
FENCE_RE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1", re.S | re.M)
INLINE_RE = re.compile(r"`([^`\n]+)`")
SUFFIXES = ("_bucket", "_sum", "_count", "_created", "_info")  # Prometheus' series names
# Shown on purpose as what not to write (docs/vllm.md's typo example).
MISTAKES = {"kvoffload_timout_ms"}
# `kvoffload daemon` is the process, not a command (diagrams, error messages).
NOT_COMMANDS = {"daemon"}


def _code(doc: Path) -> list[str]:
    """The doc's code: each fenced block (continuation lines joined) and each inline span."""
    text = doc.read_text()
    blocks = [m.group(2).replace("\\\n", " ") for m in FENCE_RE.finditer(text)]
    return blocks + INLINE_RE.findall(FENCE_RE.sub("", text))


def _retired() -> frozenset[str]:
    """Plugin keys no longer read (the plugin names them to warn, so they are in the source)."""
    from kvoffload.connector.vllm import settings

    return frozenset(getattr(settings, "RETIRED_KEYS", ()))


def _known_names() -> tuple[set[str], tuple[str, ...]]:
    """Every "kvoffload_..." string in the source but the retired keys, and the prefixes of
    f-string names."""
    names: set[str] = set()
    prefixes: set[str] = set()
    for path in SOURCE:
        text = path.read_text()
        # Our metrics on vLLM's /metrics carry vLLM's prefix (connector/vllm/session_metrics.py).
        names.update(re.findall(r"[\"'](?:vllm:)?(kvoffload_[a-z0-9_]+)[\"']", text))
        prefixes.update(re.findall(r"f[\"'](kvoffload_[a-z0-9_]*_)\{", text))
    return names - _retired(), tuple(sorted(prefixes))


def _doc_keys() -> list[tuple[str, str, str]]:
    """(name, doc, its paragraph) of each `kvoffload_*` name, once per doc."""
    found: dict[tuple[str, str], str] = {}
    for doc in DOCS:
        for para in re.split(r"\n\s*\n", doc.read_text()):
            # Whole names only: a prefix written as such ("kvoffload_tier_*") is not one.
            for name in re.findall(r"(?<![\w./-])kvoffload_[a-z0-9_]*[a-z0-9](?![\w*{-])", para):
                if name not in MISTAKES:
                    found.setdefault((name, str(doc.relative_to(ROOT))), para)
    return sorted((name, doc, para) for (name, doc), para in found.items())


KEYS = _doc_keys()
RETIRED_WORDS = ("older", "no longer", "retired")


def _is_known(name: str, names: set[str], prefixes: tuple[str, ...]) -> bool:
    base = next((name[:-len(s)] for s in SUFFIXES if name.endswith(s)), name)
    candidates = {name, base, base.removesuffix("_total")}
    return any(c in names or f"{c}_total" in names or c.startswith(prefixes)
               for c in candidates)


def test_the_docs_name_keys_and_metrics() -> None:
    names = {k for k, _, _ in KEYS}
    assert {"kvoffload_control", "kvoffload_timeout_ms", "kvoffload_lookups_total"} <= names


@pytest.mark.parametrize(("name", "doc", "para"), KEYS, ids=[f"{d}:{k}" for k, d, _ in KEYS])
def test_every_kvoffload_key_a_doc_shows_is_in_the_code(name: str, doc: str, para: str) -> None:
    if name in _retired():  # only where the doc says it is not read any more
        assert any(w in para for w in RETIRED_WORDS), (
            f"{doc} shows {name}, a key the plugin no longer reads, as if it still were")
        return
    names, prefixes = _known_names()
    assert _is_known(name, names, prefixes), (
        f"{doc} shows {name}, which no source file names (a key the plugin no longer reads, "
        "a metric it no longer registers?)")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


COMMAND_RE = re.compile(r"(?<![\w./-])kvoffload[ \t]+([a-z][\w-]*)([^\n]*)")


def _invocations() -> list[tuple[str, str, str]]:
    """(doc, command words, the rest of the line) of every `kvoffload CMD ...` in docs' code."""
    out: list[tuple[str, str, str]] = []
    for doc in DOCS:
        for code in _code(doc):
            for m in COMMAND_RE.finditer(code):
                if m.group(1) in NOT_COMMANDS:
                    continue
                rest = re.split(r"&&|\|\||(?<!\[)\|(?![^\[]*\])|;|\s#", m.group(2))[0]
                out.append((str(doc.relative_to(ROOT)), m.group(1), rest))
    return out


INVOCATIONS = _invocations()


def test_the_docs_show_commands() -> None:
    assert {cmd for _, cmd, _ in INVOCATIONS} >= {"serve", "demo", "events", "bench", "stats",
                                                   "keys"}


@pytest.mark.parametrize(("doc", "command", "rest"), INVOCATIONS,
                         ids=[f"{d}:{c}{r[:40]}" for d, c, r in INVOCATIONS])
def test_every_kvoffload_command_and_flag_a_doc_shows_exists(doc: str, command: str,
                                                             rest: str) -> None:
    commands = _subparsers(build_parser())
    assert command in commands, f"{doc}: `kvoffload {command}` is not a command " \
        f"(commands: {', '.join(sorted(commands))})"
    parser = commands[command]
    words = rest.split()
    subs = _subparsers(parser)
    if subs and words and words[0] in subs:  # `kvoffload events tail ...`
        parser = subs[words[0]]
    elif subs and words and not words[0].startswith("-"):
        raise AssertionError(f"{doc}: `kvoffload {command} {words[0]}`: no such sub-command")
    options = set(parser._option_string_actions)
    for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest):
        assert flag in options, (f"{doc}: `kvoffload {command}` has no {flag} "
                                 f"(it has: {', '.join(sorted(options))})")


def _readme_serve_table_flags() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Running the daemon"):]
    section = section[:section.index("\n## ", 1)]
    flags: list[str] = []
    for row in re.findall(r"^\| `--.*$", section, re.M):
        first = re.split(r"(?<!\\)\|", row)[1]  # "\|" inside a cell is a literal bar
        flags += re.findall(r"`(--[a-z][a-z0-9-]*)", first)
    return flags


def test_readme_s_serve_flags_are_serve_s() -> None:
    flags = _readme_serve_table_flags()
    assert len(flags) >= 20
    options = set(_subparsers(build_parser())["serve"]._option_string_actions)
    assert sorted(set(flags) - options) == []


INSTALL_FILES = [*DOCS, *(ROOT / "deploy").rglob("*.yaml"), *(ROOT / "scripts").glob("*.sh")]


def test_no_doc_installs_kvoffload_from_a_package_index() -> None:
    """No index has kvoffload: the docs and manifests say how to install the wheel built from
    the repository (or the checkout) instead."""
    bad = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in INSTALL_FILES
           for m in re.finditer(r"pip install (?:-U )?kvoffload(?![-\w.*/])[^\n]*", p.read_text())]
    assert bad == []


def test_readme_s_start_refusals_say_what_they_say(tmp_path: Path) -> None:
    """README: a second daemon on a control endpoint or pool path in use is refused naming the
    pid that holds it; on an HTTP port in use, naming the port and the flag. One line each."""
    import subprocess
    import sys

    from tests.daemon_helpers import run_daemon

    with run_daemon(tmp_path, pool_bytes=16 << 20) as d:
        assert d.proc is not None
        port = d.http_url.rsplit(":", 1)[1]
        base = [sys.executable, "-m", "kvoffload", "serve", "--pool-bytes", "16MiB"]
        cases = [
            (["--control", d.control, "--pool-path", f"{d.pool_path}-b", "--http",
              "127.0.0.1:0"], f"pid {d.proc.pid}"),
            (["--control", f"ipc://{d.workdir}/c.sock", "--pool-path", d.pool_path, "--http",
              "127.0.0.1:0"], f"pid {d.proc.pid}"),
            (["--control", f"ipc://{d.workdir}/e.sock", "--pool-path", f"{d.pool_path}-e",
              "--http", f"127.0.0.1:{port}"], f"127.0.0.1:{port}"),
        ]
        try:
            for args, named in cases:
                out = subprocess.run(base + args, capture_output=True, text=True, timeout=60)
                lines = out.stderr.strip().splitlines()
                assert out.returncode == 1 and len(lines) == 1 and named in lines[0], out.stderr
        finally:  # whatever a refused start left (a lock file) goes with the test
            for left in Path(d.pool_path).parent.glob(f"{Path(d.pool_path).name}-[be]*"):
                left.unlink(missing_ok=True)
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert ("same control endpoint or pool path refuses to start with one line naming the pid"
            in readme)
    assert "an HTTP or event port already in use, with one line naming the port" in readme
