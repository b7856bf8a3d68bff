"""Two vLLM engines (each vLLM's real core Scheduler + WORKER connector, plugin_engine.py) on
one daemon: what one stores the other loads, byte for byte; keys the other's stores evicted are
offered again; one engine's connector reset leaves the other's blocks."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_helpers import DaemonHandle, run_daemon  # noqa: E402
from tests.plugin_common import plugin_config  # noqa: E402
from tests.vllm_harness import vllm_import_error  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonHandle]:
    with run_daemon(tmp_path, pool_bytes=64 * 4096, slot_bytes=4096) as d:  # 64 slots
        yield d


def _engine(control: str, **extra: Any) -> Any:
    from tests.plugin_engine import MiniEngine

    return MiniEngine(plugin_config(control, kvoffload_copy_async=False,
                                    kvoffload_store_reserve=8, **extra),
                      connector="KVOffloadConnector", connector_module="kvoffload.connector.vllm")


def _prompt(name: str, n: int = 30) -> list[int]:
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % 40_000
    return list(range(seed, seed + n))


def _serve(e: Any, tokens: list[int], req_id: str) -> int:
    e.add(tokens, req_id, max_tokens=2)
    e.run()
    return e.prefill_tokens[req_id]


def _committed(daemon: DaemonHandle, e: Any) -> None:
    """Wait until the daemon holds no store of ``e`` still pending."""
    import time

    from tests.plugin_common import connect

    c = connect(daemon.control, e.connector.scheduler.manager.geometry)
    deadline = time.monotonic() + 30
    while c.stats()["pending"] and time.monotonic() < deadline:
        time.sleep(0.01)
    c.close()


def _reset_handled(daemon: DaemonHandle) -> None:
    """Wait until the daemon has answered one Reset (its handler drops the blocks at once)."""
    import time

    from kvoffload.bench.suites.load import metric_sum, scrape_metrics

    deadline = time.monotonic() + 30
    while metric_sum(scrape_metrics(daemon.http_url), "kvoffload_requests_total",
                     op="reset") < 1:
        assert time.monotonic() < deadline, "the daemon never got the Reset"
        time.sleep(0.01)


def _fresh(e: Any) -> None:
    assert e.scheduler.reset_prefix_cache()
    e.scribble()


def test_engine_b_loads_what_engine_a_stored(daemon: DaemonHandle) -> None:
    from tests.plugin_engine import BLOCK, ROW, token_row

    a, b = _engine(daemon.control), _engine(daemon.control)
    prompt = _prompt("shared")
    assert _serve(a, prompt, "a1") == 30
    _committed(daemon, a)  # A's last commit may still be on its way when A goes idle
    seen: dict[str, bool] = {}

    def check(req_id: str) -> None:
        attn, _ = b.block_table(req_id)
        seen["ok"] = all(
            bytes(b.pages["attn.0"][attn[t // BLOCK], ROW * (t % BLOCK):ROW * (t % BLOCK + 1)]
                  .numpy()) == bytes(token_row(prompt, t).numpy()) for t in range(28))

    b.on_loaded = check
    assert _serve(b, prompt, "b1") == 2  # 28 tokens from A's blocks
    assert seen == {"ok": True}
    a.shutdown()
    b.shutdown()


def test_keys_evicted_by_another_engine_are_offered_again(daemon: DaemonHandle) -> None:
    a, b = _engine(daemon.control), _engine(daemon.control)
    prompt = _prompt("first")
    assert _serve(a, prompt, "a1") == 30
    offered = a.connector.scheduler.manager.counters["stores_offered"]
    for i in range(20):  # B's stores fill the 64-slot pool: A's blocks are evicted
        assert _serve(b, _prompt(f"filler-{i}"), f"b{i}") == 30
    _fresh(a)
    assert _serve(a, prompt, "a2") == 30  # gone: recomputed ...
    # ... and offered again, because "already stored" is read from the daemon's index.
    assert a.connector.scheduler.manager.counters["stores_offered"] > offered
    _committed(daemon, a)
    _fresh(a)
    assert _serve(a, prompt, "a3") == 2
    a.shutdown()
    b.shutdown()


def test_one_engines_connector_reset_leaves_the_others_blocks(daemon: DaemonHandle) -> None:
    a, b = _engine(daemon.control), _engine(daemon.control)
    mine, theirs = _prompt("a-only"), _prompt("b-only")
    assert _serve(a, mine, "a1") == 30
    assert _serve(b, theirs, "b1") == 30
    _committed(daemon, b)
    # vLLM's reset_prefix_cache(reset_connector=True) on A: only A's blocks go (the default).
    assert a.scheduler.reset_prefix_cache(reset_connector=True)
    a.run(until=lambda: not a.busy())
    # A's Reset leaves on A's session in the background: nothing orders it before B's
    # lookups on B's own socket (A's own lookups would follow it). Wait until it is handled.
    _reset_handled(daemon)
    a.scribble()
    _fresh(b)
    assert _serve(b, theirs, "b2") == 2  # B's blocks are still there
    assert _serve(b, mine, "b3") == 30  # A's are gone
    a.shutdown()
    b.shutdown()
