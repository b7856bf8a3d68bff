"""A load is correct bytes or a recompute, never a success without bytes.

Through vLLM 0.33's real core Scheduler and WORKER-role connector (plugin_engine.py), with the
blocks taken away between vLLM's lookup and the worker's copy: the namespace reset by another
engine, the blocks evicted by another engine's stores, the daemon killed and replaced by a new
one on the same pool. Every byte the model then reads is checked against what the fake model
would have computed, with our ``KVOffloadConnector`` and with vLLM's stock connector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_helpers import DaemonHandle, run_daemon  # noqa: E402
from tests.plugin_common import connect, plugin_config, wait_until  # noqa: E402
from tests.vllm_harness import vllm_import_error  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]

CONNECTORS = ["KVOffloadConnector", "OffloadingConnector"]
PROMPT = list(range(300, 330))  # 30 tokens: 28 can load (chunk + tail), 2 are computed


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonHandle]:
    # A small pool (24 slots): another engine's stores evict quickly.
    # Another engine drops the namespace between lookup and copy: the any-registrant rule.
    with run_daemon(tmp_path, pool_bytes=24 * 4096, slot_bytes=4096,
                    env={"KVOFFLOAD_RESET_NAMESPACE": "any"}) as d:
        yield d


def _engine(control: str, connector: str) -> Any:
    from tests.plugin_engine import MiniEngine

    module = "kvoffload.connector.vllm" if connector == "KVOffloadConnector" else None
    return MiniEngine(plugin_config(control, kvoffload_copy_async=False,
                                    kvoffload_liveness_ms=60_000),
                      connector=connector, connector_module=module)


def _before_copy(e: Any, action: Callable[[], None]) -> None:
    """Run ``action`` once, after vLLM scheduled the load, right before the worker copies."""
    original = e.worker.start_load_kv
    state = {"done": False}

    def start_load_kv(ctx: Any) -> None:
        if e.worker._connector_metadata.load_jobs and not state["done"]:
            state["done"] = True
            action()
        original(ctx)

    e.worker.start_load_kv = start_load_kv


def _check_bytes(e: Any, req_id: str, upto: int) -> None:
    from tests.plugin_engine import BLOCK, ROW, state_page, token_row

    attn, mamba = e.block_table(req_id)
    for t in range(upto):
        got = bytes(e.pages["attn.0"][attn[t // BLOCK], ROW * (t % BLOCK):
                                      ROW * (t % BLOCK + 1)].numpy())
        assert got == bytes(token_row(PROMPT, t).numpy()), f"token {t} of {req_id}"
    assert bytes(e.pages["mamba.0"][mamba[(upto - 1) // BLOCK]].numpy()) == bytes(
        state_page(PROMPT[:upto]).numpy())


def _stored_then_fresh(e: Any) -> None:
    e.add(PROMPT, "first", max_tokens=2)
    e.run()
    assert e.scheduler.reset_prefix_cache()
    e.scribble()  # every KV byte is garbage now: only a correct load restores a prefix


def _serve_second(e: Any) -> dict[str, bool]:
    """Runs the second request; checks the KV the model holds once the load is done."""
    seen = {"checked": False}

    def on_loaded(req_id: str) -> None:
        _check_bytes(e, req_id, 28)
        seen["checked"] = True

    e.on_loaded = on_loaded
    e.add(PROMPT, "second", max_tokens=2)
    e.run()
    return seen


@pytest.mark.parametrize("connector", CONNECTORS)
def test_namespace_reset_between_lookup_and_copy_loads_correct_bytes(
        daemon: DaemonHandle, connector: str) -> None:
    e = _engine(daemon.control, connector)
    _stored_then_fresh(e)
    other = connect(daemon.control, e.connector.scheduler.manager.geometry)
    dropped: list[int] = []

    def reset() -> None:
        # Once the daemon holds the load's pins: the Step that carries them goes out without
        # waiting, and a reset read before it would drop the blocks (a failed load, correctly
        # recomputed, but not the race this test is about).
        assert wait_until(lambda: other.stats()["pinned"] > 0)
        dropped.append(other.reset())

    _before_copy(e, reset)
    seen = _serve_second(e)
    # The reset dropped the blocks (retired, not reused: our pins and epoch hold them) and
    # the copy still read exactly the bytes that were stored.
    assert dropped and dropped[0] >= 0
    assert seen["checked"] and e.prefill_tokens["second"] == 2
    e.shutdown()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_blocks_evicted_between_lookup_and_copy_load_correct_bytes(
        daemon: DaemonHandle, connector: str) -> None:
    import hashlib

    from kvoffload.daemon.base import make_key
    from kvoffload.daemon.control import protocol as p

    e = _engine(daemon.control, connector)
    _stored_then_fresh(e)
    other = connect(daemon.control, e.connector.scheduler.manager.geometry)

    def flood() -> None:  # another engine stores more than the pool holds
        for i in range(40):
            key = make_key(hashlib.sha256(f"flood-{i}".encode()).digest(), 0)
            grant = other.prepare_store([p.StoreItem(key=key, end_token=16)])
            if grant.outcomes == [p.StoreOutcome.GRANTED]:
                other.commit_store([key])

    _before_copy(e, flood)
    seen = _serve_second(e)
    assert seen["checked"] and e.prefill_tokens["second"] == 2
    e.shutdown()


def _replaced_before_copy(daemon: DaemonHandle, connector: str) -> Any:
    """An engine whose next load finds a new daemon on the pool (killed and restarted after
    vLLM scheduled the load, before the worker copies); the second request is added."""
    e = _engine(daemon.control, connector)
    _stored_then_fresh(e)

    def replace() -> None:
        daemon.kill()
        daemon.start()

    _before_copy(e, replace)
    e.add(PROMPT, "second", max_tokens=2)
    return e


def test_daemon_replaced_between_lookup_and_copy_is_recomputed(daemon: DaemonHandle) -> None:
    """A new daemon on the same pool supersedes the old index: the copy cannot prove its
    slots intact, so vLLM is told the load failed and recomputes; nothing wrong is read."""
    e = _replaced_before_copy(daemon, "KVOffloadConnector")
    e.scheduler.recompute_kv_load_failures = True  # kv_load_failure_policy = "recompute"
    e.run()
    assert "second" in e.failed_loads
    assert e.prefill_tokens["second"] == 30  # recomputed in full, from correct tokens
    e.shutdown()


def test_daemon_replaced_under_the_stock_connector_stops_loudly(daemon: DaemonHandle) -> None:
    """vLLM's stock connector cannot take a failed load: the job is reported failed and vLLM
    stops (its assert) instead of running on KV it does not have."""
    e = _replaced_before_copy(daemon, "OffloadingConnector")
    with pytest.raises(AssertionError):
        e.run()
    e.shutdown()
