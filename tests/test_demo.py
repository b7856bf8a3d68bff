"""`kvoffload demo`: an embedded or running daemon plus a simulated hybrid engine."""

from __future__ import annotations

import json
import subprocess
import sys

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
