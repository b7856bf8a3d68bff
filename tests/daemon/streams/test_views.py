"""Per-engine views opened on Register: an engine that sends its data_parallel_rank gets a view.

The daemon runs as a process with ``--engine-views-auto``; engines register through our client
(and the plugin's IndexSession) with a DP rank; each view's stream is read back through vLLM's
replay protocol at the endpoints the daemon logs.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from kvoffload.connector.client import DaemonClient
from kvoffload.connector.session import IndexSession
from kvoffload.daemon.config import ConfigError, load_config
from kvoffload.daemon.control import protocol as p
from kvoffload.events.schema import decode_batch

from tests.daemon.streams.test_publish import replay_all
from tests.daemon_helpers import DaemonHandle, run_daemon
from tests.events.test_profiles import CHUNK, GEOM, fine_chain, store_items
from tests.events_helpers import block_events

AUTO = "events=tcp://127.0.0.1:0,replay=tcp://127.0.0.1:0"


def view_lines(d: DaemonHandle, rank: int, engine: str) -> list[str]:
    """Replay endpoints of (engine, rank)'s views, from the daemon's log lines."""
    return re.findall(rf"event view of DP rank {rank} \(engine '{engine}'\): events \S+ "
                      r"replay (\S+)", d.log())


def wait_log(d: DaemonHandle, rank: int, engine: str) -> str:
    # The line is logged before Register's reply is sent; the log file may lag a little.
    deadline = time.monotonic() + 10
    while not (eps := view_lines(d, rank, engine)):
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.02)
    return eps[0]


def register(c: DaemonClient, rank: int | None, instance: str = "e0") -> p._Msg:
    c.connect()
    reply = c.call(p.Register(rid=c.rid(), geometry=GEOM, data_parallel_rank=rank,
                              instance=instance))
    if isinstance(reply, p.Registered):
        c.registered = reply  # what DaemonClient.register keeps: later calls name the engine
    return reply


def store_all(c: DaemonClient) -> int:
    tokens = list(range(1000, 1000 + 2 * CHUNK + 8))
    items = store_items(tokens, fine_chain(tokens), 2 * CHUNK + 8)
    grant = c.prepare_store(items)
    assert all(o == p.StoreOutcome.GRANTED for o in grant.outcomes)
    assert c.commit_store([i.key for i in items]) == len(items)
    return len(items)


def events_of(replay: str, n: int) -> list[tuple[int | None, str | None]]:
    """(batch rank, medium) of every event, once the view holds `n` (publishing is async)."""
    deadline = time.monotonic() + 10
    while True:
        out = [(b.data_parallel_rank, e.medium) for pl in replay_all(replay)
               for b in [decode_batch(pl)] for e in block_events(b.events)]
        if len(out) >= n or time.monotonic() > deadline:
            return out
        time.sleep(0.02)


def test_register_with_a_rank_opens_that_engines_view(tmp_path: Path) -> None:
    with run_daemon(tmp_path, "--engine-views-auto", AUTO) as d:
        assert d.ready["engine_views"] == []  # nothing until an engine asks
        c = DaemonClient(d.control, timeout_ms=5000)
        try:
            assert isinstance(register(c, 3), p.Registered)
            replay3 = wait_log(d, 3, "e0")
            stored = store_all(c)
            # The same engine registering again (a reconnect) keeps its one view.
            c2 = DaemonClient(d.control, timeout_ms=5000)
            assert isinstance(register(c2, 3), p.Registered)
            # Another vLLM instance is another worker to a router, even at the same rank.
            assert isinstance(register(c2, 3, "e1"), p.Registered)
            c2.close()
            got3 = events_of(replay3, stored)
            other3 = events_of(wait_log(d, 3, "e1"), stored)
            # The plugin's session sends its rank; a late view first announces what is resident.
            session = IndexSession(d.control, GEOM, instance="e2", data_parallel_rank=5)
            assert session.start(10), d.log()
            got5 = events_of(wait_log(d, 5, "e2"), stored)
            session.client.close()
        finally:
            c.close()
        assert len(view_lines(d, 3, "e0")) == 1
        assert len(set(view_lines(d, 3, "e0") + view_lines(d, 3, "e1"))) == 2
        assert d.proc is not None and d.proc.poll() is None
    assert got3 == [(3, "CPU")] * stored
    assert other3 == [(3, "CPU")] * stored
    assert got5 == [(5, "CPU")] * stored


@pytest.mark.parametrize("rank", [-1, 1 << 16])
def test_a_rank_out_of_range_is_refused_and_opens_nothing(tmp_path: Path, rank: int) -> None:
    with run_daemon(tmp_path, "--engine-views-auto", AUTO) as d:
        c = DaemonClient(d.control, timeout_ms=5000)
        try:
            reply = register(c, rank)
            assert isinstance(reply, p.Error) and "data_parallel_rank" in reply.message
            assert isinstance(register(c, None), p.Registered)  # no rank: no view, no error
        finally:
            c.close()
        assert "event view of DP rank" not in d.log()


def test_without_the_setting_a_rank_opens_no_view(tmp_path: Path) -> None:
    with run_daemon(tmp_path) as d:
        c = DaemonClient(d.control, timeout_ms=5000)
        try:
            assert isinstance(register(c, 0), p.Registered)
        finally:
            c.close()
        assert "event view of DP rank" not in d.log()


@pytest.mark.parametrize("template", ["rank=1,events=tcp://127.0.0.1:0", "replay=tcp://x:1",
                                      "events=tcp://127.0.0.1:0,bogus=1"])
def test_a_bad_template_is_a_config_error(template: str) -> None:
    with pytest.raises(ConfigError, match="engine_views_auto"):
        load_config(flags={"engine_views_auto": template})


def _metric(d: DaemonHandle, name: str, label: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{d.http_url}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(name) and label in line)


def _held_port_pair() -> tuple[int, object, object]:
    """A base B with port B*10 held by a bound socket here and B*10+1 free: a template
    `tcp://127.0.0.1:{B}{index}` then fails its view 0 and can open view 1."""
    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    # {index} runs to 63: B*100+63 must stay a port, so B < 655 (ports B*10 are 2000-6540).
    for base in range(200, 655, 7):
        held = ctx.socket(zmq.PUB)
        try:
            held.bind(f"tcp://127.0.0.1:{base * 10}")
            probe = ctx.socket(zmq.PUB)
            probe.bind(f"tcp://127.0.0.1:{base * 10 + 1}")
            probe.close(linger=0)
            return base, held, ctx
        except zmq.ZMQError:
            held.close(linger=0)
    pytest.skip("no free pair of ports found")


def test_a_view_that_cannot_bind_never_fails_a_register(tmp_path: Path) -> None:
    """Its port held by another socket: the engine's Register still answers Registered (it
    was `internal` when pyzmq 27's ZMQError slipped past an OSError catch); the failure is
    logged and counted, and the next engine's view takes the next {index} and opens."""
    import json
    import urllib.request

    base, held, _ = _held_port_pair()
    template = f"events=tcp://127.0.0.1:{base}{{index}},replay=tcp://127.0.0.1:0"
    try:
        with run_daemon(tmp_path, "--engine-views-auto", template) as d:
            assert _metric(d, "kvoffload_engine_views_opened_total", 'outcome="failed"') == 0
            a = DaemonClient(d.control, timeout_ms=5000)
            b = DaemonClient(d.control, timeout_ms=5000)
            try:
                assert isinstance(a.register(GEOM, instance="a", data_parallel_rank=0),
                                  p.Registered)
                assert a.probe([]) == []  # the engine works without its view
                assert isinstance(b.register(GEOM, instance="b", data_parallel_rank=0),
                                  p.Registered)
            finally:
                a.close()
                b.close()
            wait_log(d, 0, "b")
            assert _metric(d, "kvoffload_engine_views_opened_total", 'outcome="failed"') == 1
            assert _metric(d, "kvoffload_engine_views_opened_total", 'outcome="ok"') == 1
            log = d.log()
            assert f"cannot open the event view of DP rank 0 (engine 'a', view 0: " \
                   f"events=tcp://127.0.0.1:{base}0" in log
            assert "the engine is registered without it" in log
            assert view_lines(d, 0, "b") and not view_lines(d, 0, "a")
            assert f"events tcp://127.0.0.1:{base}1 " in log  # view 1: past the failed port
            assert "internal error" not in log
            with urllib.request.urlopen(f"{d.http_url}/readyz", timeout=10) as resp:
                ready = json.loads(resp.read())
            assert [f["engine"] for f in ready["engine_view_failures"]] == ["a"]
            assert [v["engine"] for v in ready["engine_views"]] == ["b"]
    finally:
        held.close(linger=0)  # type: ignore[attr-defined]


@pytest.mark.parametrize("flag, endpoint", [
    ("events", "tcp://0.0.0.0:5600"), ("events_replay", "tcp://127.0.0.1:5600"),
    ("lookup_events", "tcp://*:5600"), ("control", "tcp://127.0.0.1:5600"),
    ("http", "0.0.0.0:5600")])
def test_a_template_that_reaches_the_daemons_own_ports_is_refused(flag: str,
                                                                  endpoint: str) -> None:
    template = "events=tcp://0.0.0.0:56{index}0,replay=tcp://0.0.0.0:56{index}1"
    with pytest.raises(ConfigError) as exc:
        load_config(env={}, flags={flag: endpoint, "engine_views_auto": template})
    text = str(exc.value)
    assert "\n" not in text and "engine_views_auto" in text
    assert f"--{flag.replace('_', '-')} {endpoint} holds" in text
    # Ports of their own (the doc's recipe) and port 0 (one picked per view) are fine.
    for ok in ("events=tcp://0.0.0.0:57{index}0,replay=tcp://0.0.0.0:57{index}1",
               "events=tcp://0.0.0.0:0,replay=tcp://0.0.0.0:0"):
        load_config(env={}, flags={flag: endpoint, "engine_views_auto": ok})


def test_a_template_past_the_last_port_is_refused() -> None:
    with pytest.raises(ConfigError, match="past port 65535"):
        load_config(env={}, flags={"engine_views_auto": "events=tcp://0.0.0.0:65{index}0"})


def test_a_refused_template_stops_serve_with_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kvoffload", "serve", "--control", f"ipc://{tmp_path}/c.sock",
         "--pool-path", f"/dev/shm/kvo-views-{tmp_path.name}", "--http", "127.0.0.1:0",
         "--events", "tcp://0.0.0.0:5600",
         "--engine-views-auto", "events=tcp://0.0.0.0:56{index}0"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--events tcp://0.0.0.0:5600" in lines[0], out.stderr
