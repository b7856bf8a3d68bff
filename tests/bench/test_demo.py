"""`kvoffload demo`: an embedded or running daemon plus a simulated hybrid engine."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

from tests.daemon_helpers import run_daemon


def demo(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvoffload", "demo", "--json", *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr + out.stdout
    return json.loads(out.stdout.strip().splitlines()[-1])


def check(s: dict) -> None:
    assert s["verify_failures"] == 0 and s["errors"] == 0
    assert s["tail_hit_tokens"] > 0 and s["chunk_hit_tokens"] > 0
    assert s["hit_tokens"] == s["chunk_hit_tokens"] + s["tail_hit_tokens"]
    assert s["recomputed_tokens"] == s["prompt_tokens"] - s["hit_tokens"]
    assert s["bytes_loaded"] > 0 and s["bytes_stored"] > 0
    assert s["simulated_ttft_ms_mean"] < s["simulated_ttft_ms_no_offload_mean"]


def test_demo_embedded_daemon_with_eviction() -> None:
    s = demo("--requests", "150", "--pool-bytes", "16MiB")
    check(s)
    assert s["requests"] == 150 and s["evicted_keys"] > 0


def test_demo_against_running_daemon(tmp_path) -> None:
    with run_daemon(tmp_path, pool_bytes=64 << 20) as d:
        s = demo("--connect", d.control, "--requests", "60", "--preset", "qwen3-next-80b-tp4")
        check(s)
        assert s["round_trips_per_request"] <= 5


def test_demo_asks_deferred_lookups_again_and_shows_disk_hits(tmp_path) -> None:
    """Against a daemon whose small pool spills to a disk tier, answers deferred while a block
    is promoted are asked again on a later step and served, instead of counted as misses."""
    disk = tmp_path / "disk"
    disk.mkdir()
    with run_daemon(tmp_path, "--disk-dir", str(disk), "--disk-bytes", str(1 << 30),
                    pool_bytes=16 << 20) as d:
        s = demo("--connect", d.control, "--requests", "150")
        check(s)
        assert s["deferred_steps"] > 0 and s["gave_up"] == 0
        with urllib.request.urlopen(f"{d.http_url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        ok = [line for line in text.splitlines()
              if line.startswith("kvoffload_tier_promotions_total") and 'outcome="ok"' in line]
        assert ok and float(ok[0].rsplit(" ", 1)[1]) > 0, ok  # blocks came back from disk


def test_demo_summary_explains_itself() -> None:
    out = subprocess.run([sys.executable, "-m", "kvoffload", "demo", "--requests", "20"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "started its own daemon in this process" in text
    assert "/dev/shm/kvoffload-demo-" in text and "stopped and removed at the end" in text
    assert "bytes x 1/1024: each KV block has 1/1024 of its real size" in text
    assert "daemon requests per turn" in text
    assert "whose bytes differ from what was stored" in text


def test_demo_preset_help_lists_the_choices() -> None:
    from kvoffload.bench.workload import PRESETS

    out = subprocess.run([sys.executable, "-m", "kvoffload", "demo", "--help"],
                         capture_output=True, text=True, timeout=60)
    flat = " ".join(out.stdout.split())
    assert all(name in flat for name in PRESETS), flat


def test_demo_ends_with_one_line_when_the_daemon_dies(tmp_path) -> None:
    with run_daemon(tmp_path, pool_bytes=64 << 20) as d:
        proc = subprocess.Popen([sys.executable, "-m", "kvoffload", "demo", "--connect",
                                 d.control, "--requests", "1000000"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # Kill it once the demo is under way (its lookups show in the daemon's metrics).
            for _ in range(600):
                with urllib.request.urlopen(f"{d.http_url}/metrics", timeout=10) as resp:
                    if any(line.startswith("kvoffload_lookups_total") and
                           not line.endswith(" 0.0") for line in resp.read().decode()
                           .splitlines()):
                        break
                time.sleep(0.05)
            d.kill()
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "the daemon stopped answering after" in lines[0], err
    assert "of 1000000 requests" in lines[0] and out == ""


def test_second_daemon_on_one_mooncake_master_serves_more() -> None:
    """Two daemons on one real mooncake_master, the same seeded demo: B gets A's blocks from
    the store (the demo asks deferred answers again), so B serves more than A."""
    import pytest
    from kvoffload.bench.mooncake_run import mooncake_unavailable

    if (why := mooncake_unavailable()) is not None:
        pytest.skip(why)
    from kvoffload.bench.mooncake_demo import run_demo_shared

    r = run_demo_shared(requests=60, seed=3)
    assert r["a"]["verify_failures"] == r["b"]["verify_failures"] == 0
    assert r["a"]["errors"] == r["b"]["errors"] == 0
    assert r["b_promotions_ok"] > 0 and r["b"]["deferred_steps"] > 0
    assert r["b"]["hit_tokens"] > r["a"]["hit_tokens"] and r["meets"]


def test_a_turn_cut_off_by_a_lost_daemon_is_not_counted_twice(tmp_path) -> None:
    """The demo asks a turn again after an outage: the cut-off attempt must be taken back, or
    its prompt and hit tokens would count twice. Wrong bytes already seen stay counted."""
    import asyncio

    from kvoffload.bench.demo import SimEngine
    from kvoffload.bench.workload import PRESETS, chat_turns
    from kvoffload.connector.client import AsyncDaemonClient, DaemonUnavailable

    async def scenario(control: str) -> None:
        client = AsyncDaemonClient(control, name="demo test")
        engine = SimEngine(client, PRESETS["qwen3.6-27b-tp1"].geometry(1 / 1024), 1 / 1024)
        try:
            await engine.start()
            turns = list(chat_turns(8, 0))
            for turn in turns[:4]:
                await engine.run_turn_once(turn)
            done = (engine.summary.requests, engine.summary.prompt_tokens,
                    engine.summary.hit_tokens, engine.summary.bytes_loaded)
            assert done[0] == 4 and done[1] > 0

            async def store_lost(*_: object) -> None:  # the daemon vanishes mid-turn
                engine.summary.verify_failures += 1
                raise DaemonUnavailable("gone")

            engine._store = store_lost  # type: ignore[method-assign, assignment]  # a stand-in
            try:
                await engine.run_turn_once(turns[4])
            except DaemonUnavailable:
                pass
            else:
                raise AssertionError("the injected outage did not surface")
            after = (engine.summary.requests, engine.summary.prompt_tokens,
                     engine.summary.hit_tokens, engine.summary.bytes_loaded)
            assert after == done
            assert engine.summary.verify_failures == 1
            assert len(engine._ttft) == 4
        finally:
            engine.close()
            await client.close()

    with run_daemon(tmp_path, pool_bytes=64 << 20) as d:
        asyncio.run(scenario(d.control))


def _metric(url: str, name: str, label: str = "") -> float:
    """The sum of one metric's samples (those whose labels contain ``label``)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(name) and label in line and not line.startswith("#"))


def test_demo_survives_kill_and_restart_of_the_daemon(tmp_path) -> None:
    """`kvoffload demo --connect` while its daemon is kill -9'd and started again on the same
    endpoint, pool path and --state-dir: the demo's client registers again by itself and the
    run completes, every request served, 0 errors and 0 wrong bytes; the restarted daemon
    serves hits from the blocks it recovered."""
    state = tmp_path / "state"
    requests = 400
    with run_daemon(tmp_path, "--state-dir", str(state), pool_bytes=64 << 20) as d:
        proc = subprocess.Popen([sys.executable, "-m", "kvoffload", "demo", "--json",
                                 "--connect", d.control, "--requests", str(requests)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            for _ in range(600):  # kill once the demo is under way
                if _metric(d.http_url, "kvoffload_lookups_total") > 0:
                    break
                time.sleep(0.05)
            d.restart()  # SIGKILL, then the same command line
            out, err = proc.communicate(timeout=300)
            after_restart = _metric(d.http_url, "kvoffload_lookup_tokens_total", "kind=\"hit\"")
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err + out
    s = json.loads(out.strip().splitlines()[-1])
    assert s["errors"] == 0 and s["verify_failures"] == 0, s
    assert s["requests"] == requests and not s["daemon_lost"], s
    assert s["daemon_restarts"] == 1, s  # the kill landed mid-run and was found
    assert after_restart > 0  # the restarted daemon served hits (recovered and new blocks)
    assert "not_registered" not in out + err


def test_async_client_registers_again_after_a_restart(tmp_path) -> None:
    """The asyncio client alone: a daemon kill -9'd and restarted (same endpoint, no state
    dir) no longer knows its engine; the next call registers again, once for all the calls
    in flight, with the same identity, and is answered."""
    import asyncio

    from kvoffload.bench.workload import PRESETS
    from kvoffload.connector.client import AsyncDaemonClient, DaemonUnavailable
    from kvoffload.daemon.control import protocol as p

    geometry = PRESETS["qwen3.6-27b-tp1"].geometry(1 / 1024)

    async def probe_all(client: AsyncDaemonClient, n: int) -> list[p.ProbeReply]:
        return await asyncio.gather(*(client.call_engine(
            lambda e: p.Probe(rid=client.rid(), engine=e, keys=[]), p.ProbeReply)
            for _ in range(n)))

    async def scenario(d) -> None:
        client = AsyncDaemonClient(d.control, timeout_ms=2000, name="restart test")
        try:
            await client.connect()
            first = await client.register(geometry, instance="engine-a", data_parallel_rank=3)
            await probe_all(client, 1)
            await asyncio.to_thread(d.restart)
            for _ in range(100):  # the DEALER reconnects to the new daemon by itself
                try:
                    await probe_all(client, 8)
                    break
                except DaemonUnavailable:
                    await asyncio.sleep(0.05)
            assert client.registrations == 2  # one re-register for eight calls in flight
            assert client.registered is not None
            assert client.registered.daemon_id != first.daemon_id
            assert client._register_args is not None
            assert client._register_args[2:] == ("engine-a", 3)
        finally:
            await client.close()

    with run_daemon(tmp_path, pool_bytes=64 << 20) as d:
        asyncio.run(scenario(d))


def test_demo_names_its_engine_and_dp_rank(tmp_path) -> None:
    """`--instance` and `--data-parallel-rank` are sent on Register as the plugin sends them:
    a daemon with --engine-views-auto opens that engine's view."""
    auto = "events=tcp://127.0.0.1:0,replay=tcp://127.0.0.1:0"
    with run_daemon(tmp_path, "--engine-views-auto", auto, pool_bytes=64 << 20) as d:
        s = demo("--connect", d.control, "--requests", "5", "--instance", "demo-7",
                 "--data-parallel-rank", "2")
        assert s["errors"] == 0
        for _ in range(200):  # the log file may lag the reply a little
            if "event view of DP rank 2 (engine 'demo-7')" in d.log():
                break
            time.sleep(0.02)
        assert "event view of DP rank 2 (engine 'demo-7')" in d.log(), d.log()[-2000:]
