"""`kvoffload stats` against a real daemon after a demo run: numbers match what the demo did."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.ops.stats import metrics_url

from kvoffload.cli.stats import add_parser as add_stats_parser
from tests.daemon_helpers import DaemonHandle, run_daemon

POOL_BYTES = 8 << 20  # small enough that 40 demo turns evict


def stats(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the stats subcommand in-process through its own parser; (rc, stdout, stderr)."""
    parser = argparse.ArgumentParser(prog="kvoffload")
    add_stats_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["stats", *argv])
    rc = args.handler(args)
    out, err = capsys.readouterr()
    return rc, out, err


DemoRun = tuple[DaemonHandle, dict[str, Any]]


@pytest.fixture(scope="module")
def daemon_after_demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoRun]:
    with run_daemon(tmp_path_factory.mktemp("stats"), pool_bytes=POOL_BYTES) as d:
        out = subprocess.run([sys.executable, "-m", "kvoffload", "demo", "--connect", d.control,
                              "--requests", "40", "--json"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr + out.stdout
        yield d, json.loads(out.stdout.strip().splitlines()[-1])


def test_json_from_both_sources_matches_the_demo(capsys, daemon_after_demo) -> None:
    d, demo = daemon_after_demo
    holder = DaemonClient(d.control, timeout_ms=5000, name="a client that stays")
    holder.connect()
    try:
        rc, out, _ = stats(capsys, "--connect", d.control, "--http", d.http_url, "--json")
    finally:
        holder.close()
    assert rc == 0
    s = json.loads(out)
    for key in ("blocks_resident", "bytes_used", "bytes_total", "clients", "hit_tokens_total",
                "lookup_requests_total"):
        assert s[key] is not None, key
    assert s["sources"] == [d.control, metrics_url(d.http_url)]
    assert s["lookup_requests_total"] == demo["requests"] == 40
    assert s["requested_tokens_total"] == demo["prompt_tokens"]
    assert s["hit_tokens_total"] == demo["hit_tokens"] > 0
    assert s["chunk_hit_tokens_total"] == demo["chunk_hit_tokens"]
    assert s["tail_hit_tokens_total"] == demo["tail_hit_tokens"]
    assert s["hit_rate"] == pytest.approx(demo["hit_tokens"] / demo["prompt_tokens"])
    assert s["stores_by_outcome"]["committed"] == demo["keys_stored"]
    assert s["evictions_total"] == demo["evicted_keys"] > 0
    assert sum(s["lookups_by_outcome"].values()) == 40
    assert sum(s["miss_reasons"].values()) == s["lookups_by_outcome"].get("miss", 0)
    assert s["bytes_total"] == POOL_BYTES
    # The pool is full after evicting: nearly every slot holds a resident block.
    assert 0 < s["bytes_used"] <= s["bytes_total"]
    assert s["blocks_resident"] * s["slot_bytes"] == s["bytes_used"]
    assert s["blocks_resident"] <= s["num_slots"] == POOL_BYTES // s["slot_bytes"]
    assert s["clients"] >= 1  # the holder; the stats tool does not count itself
    assert s["policy"] == "lru" and s["daemon_id"]


def test_http_only_agrees_with_the_control_socket(capsys, daemon_after_demo) -> None:
    d, _ = daemon_after_demo
    rc, out, _ = stats(capsys, "--connect", d.control, "--json")
    assert rc == 0
    live = json.loads(out)
    assert live["hit_tokens_total"] is None  # counters live only in /metrics
    rc, out, _ = stats(capsys, "--http", d.http_url.removeprefix("http://"), "--json")
    assert rc == 0
    scraped = json.loads(out)
    for key in ("blocks_resident", "blocks_pending", "bytes_used", "bytes_total", "num_slots",
                "pinned_slots", "namespaces"):
        assert scraped[key] == live[key], key
    assert scraped["lookup_requests_total"] == 40


def test_text_summary(capsys, daemon_after_demo) -> None:
    d, demo = daemon_after_demo
    rc, out, _ = stats(capsys, "--connect", d.control, "--http", d.http_url)
    assert rc == 0
    pct = 100 * demo["hit_tokens"] / demo["prompt_tokens"]
    assert f"{demo['hit_tokens']:,} from cache ({pct:.1f} %" in out
    assert "top miss reasons" in out and "policy lru" in out
    rc, out, _ = stats(capsys, "--connect", d.control)
    assert rc == 0 and "need --http" in out


def test_unreachable_daemon_fails_with_a_message(capsys, tmp_path: Path) -> None:
    rc, out, err = stats(capsys, "--connect", f"ipc://{tmp_path}/none.sock", "--timeout-ms",
                         "200")
    assert rc == 1 and out == "" and "none.sock" in err
    rc, out, err = stats(capsys, "--http", "127.0.0.1:1", "--timeout-ms", "2000")
    assert rc == 1 and out == "" and "127.0.0.1:1/metrics" in err


def test_kvoffload_stats_command(daemon_after_demo) -> None:
    """The `kvoffload stats` entry point (needs add_stats_parser wired into kvoffload/cli/__init__.py)."""
    d, demo = daemon_after_demo
    out = subprocess.run([sys.executable, "-m", "kvoffload", "stats", "--http", d.http_url,
                          "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["hit_tokens_total"] == demo["hit_tokens"]


def test_text_summary_never_prints_none_for_what_the_sources_lack() -> None:
    from kvoffload.daemon.ops.stats import render, summarize

    # A /metrics page without any kvoffload series (a daemon of another build, a proxy).
    text = render(summarize(None, {}), ["http://x/metrics"])
    assert "None" not in text and "clients            ?   namespaces ?" in text
    assert "? resident, ? being stored, ? pinned; ? slots" in text
