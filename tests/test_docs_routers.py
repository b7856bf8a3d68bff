"""docs/routers.md's Dynamo recipes, run as written: the `kvoffload serve` command lines are
read from the doc (not copied here), started as the daemon, and engines register against them.

The recipes bind fixed ports on 0.0.0.0 (5600-5621, 5700-5711), as the doc shows; the test
adds only what a test daemon needs (its own control socket, pool file, HTTP port).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.control import protocol as p
from kvoffload.events.profiles import parse_view_spec

from tests.daemon_helpers import DaemonHandle, run_daemon
from tests.events.test_profiles import GEOM

ROOT = Path(__file__).resolve().parent
DOC = ROOT.parent / "docs" / "routers.md"


def dynamo_section() -> str:
    text = DOC.read_text()
    start = text.index("## NVIDIA Dynamo")
    return text[start:text.index("\n## ", start + 1)]


def serve_commands() -> list[list[str]]:
    """Every `kvoffload serve ...` of the Dynamo section's sh blocks, as argv after `serve`."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", dynamo_section(), re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            if line.startswith("kvoffload serve "):  # not the curl lines' open JSON quotes
                out.append(shlex.split(line)[2:])
    return out


def recipe(flag: str) -> list[str]:
    found = [argv for argv in serve_commands() if flag in argv]
    assert len(found) == 1, serve_commands()
    return found[0]


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def view_endpoints(d: DaemonHandle, engine: str, timeout: float = 10.0) -> tuple[str, str]:
    """(events, replay) of the view the daemon logged for `engine` (logged before Register
    answers; the log file may lag a little)."""
    pattern = rf"event view of DP rank 0 \(engine '{engine}'\): events (\S+) replay (\S+)"
    deadline = time.monotonic() + timeout
    while not (m := re.search(pattern, d.log())):
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.02)
    return m.group(1), m.group(2)


def test_the_doc_shows_a_static_and_an_auto_views_recipe() -> None:
    static, auto = recipe("--engine-view"), recipe("--engine-views-auto")
    assert flag_values(static, "--events-profile") == flag_values(auto, "--events-profile") \
        == ["dynamo"]
    assert len(flag_values(static, "--engine-view")) == 2


def test_the_static_views_recipe_binds_the_ports_it_shows(tmp_path: Path) -> None:
    argv = recipe("--engine-view")
    with run_daemon(tmp_path, *argv) as d:
        shown = [parse_view_spec(s) for s in flag_values(argv, "--engine-view")]
        bound = d.ready["engine_views"]
        assert [(v["rank"], v["events"], v["replay"]) for v in bound] == \
            [(s.rank, s.endpoint, s.replay) for s in shown]
        assert d.ready["events"] == flag_values(argv, "--events")[0]
        assert d.ready["events_replay"] == flag_values(argv, "--events-replay")[0]
        c = DaemonClient(d.control, timeout_ms=5000)
        try:
            assert isinstance(c.register(GEOM, instance="engine-0", data_parallel_rank=0),
                              p.Registered)
        finally:
            c.close()


def test_the_auto_views_recipe_gives_each_engine_its_view(tmp_path: Path) -> None:
    """The recipe as written: both engines register (none answered `internal`, as when the
    template's first view took the main stream's 5600), each gets a view on the ports the doc
    names (5700/5701, then 5710/5711), and nothing failed to open."""
    argv = recipe("--engine-views-auto")
    with run_daemon(tmp_path, *argv) as d:
        clients = [DaemonClient(d.control, timeout_ms=5000) for _ in range(2)]
        try:
            for i, c in enumerate(clients):
                assert isinstance(c.register(GEOM, instance=f"engine-{i}",
                                             data_parallel_rank=0), p.Registered)
            views = [view_endpoints(d, f"engine-{i}") for i in range(2)]
        finally:
            for c in clients:
                c.close()
        log = d.log()
    assert views == [("tcp://0.0.0.0:5700", "tcp://0.0.0.0:5701"),
                     ("tcp://0.0.0.0:5710", "tcp://0.0.0.0:5711")]
    assert "cannot open the event view" not in log and "internal error" not in log


def _demo(control: str, preset: str, requests: int, instance: str, seed: int) -> None:
    done = subprocess.run([sys.executable, "-m", "kvoffload", "demo", "--connect", control,
                           "--preset", preset, "--requests", str(requests), "--json",
                           "--seed", str(seed), "--instance", instance,
                           "--data-parallel-rank", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    s = json.loads(done.stdout.strip().splitlines()[-1])
    assert s["errors"] == 0 and s["verify_failures"] == 0, s


def test_dynamo_credits_both_engines_through_the_auto_views_recipe(tmp_path: Path) -> None:
    """The auto-views recipe with Dynamo 1.6.1's own indexer: two demo engines (each naming
    itself with --instance and --data-parallel-rank, as the plugin does) open their views;
    one Dynamo worker per view, at the engine block size; Dynamo's index then holds every
    chunk of the daemon's stream under both workers at DP rank 0, and nothing else."""
    from kvoffload.bench.workload import PRESETS

    from tests.dynamo_helpers import DynamoIndexer, dynamo_python, replay_state

    py, why = dynamo_python()
    if py is None:
        pytest.skip(f"Dynamo's indexer is not available: {why}")
    preset = "llama-8b-attention-only"
    block = PRESETS[preset].block_tokens
    argv = recipe("--engine-views-auto")
    indexer = DynamoIndexer(py, tmp_path)
    try:
        with run_daemon(tmp_path, *argv) as d:
            _demo(d.control, preset, 20, "engine-0", 0)
            _demo(d.control, preset, 20, "engine-1", 1)
            views = [view_endpoints(d, f"engine-{i}") for i in range(2)]
            for worker, (events, replay) in enumerate(views, 1):
                local = events.replace("0.0.0.0", "127.0.0.1")
                indexer.register(worker, local, block, dp_rank=0,
                                 replay=replay.replace("0.0.0.0", "127.0.0.1"))
            # Dynamo replays from seq 0 once a live batch shows the gap: a little more traffic.
            _demo(d.control, preset, 3, "engine-0", 2)
            main_replay = flag_values(argv, "--events-replay")[0].replace("0.0.0.0",
                                                                          "127.0.0.1")
            deadline = time.monotonic() + 60
            while True:
                held = replay_state(main_replay)[0]
                want: set[Any] = {(w, 0, tier, h) for w in (1, 2) for tier, h in held}
                got = indexer.blocks()
                if got == want or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    finally:
        indexer.close()
    assert held and got == want, (f"missing {len(want - got)}, extra {len(got - want)}:\n"
                                  + indexer.log()[-2000:])
