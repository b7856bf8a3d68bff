"""This engine's own stores through vLLM 0.33's real Scheduler and worker connector (MiniEngine)
against a daemon process: never forgotten while the daemon is slow, and, once gone from the
index, offered again at once.

* The daemon stopped (SIGSTOP) for many steps while it has not applied a store's claim and
  commit: the request that wants the prefix waits (HIT_PENDING), it is never answered MISS,
  and once the daemon runs again it loads the prefix, bytes checked.
* The daemon stopped after it applied the claims, with the commit still on its way: the
  store is this engine's own HIT and loads while the daemon is stopped, bytes checked.
* Another engine drops the blocks right after this engine committed them: the next request
  misses at once (no deferral) and stores them again.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_helpers import DaemonHandle, run_daemon
from tests.plugin_common import connect, keys_at, plugin_config
from tests.vllm_harness import vllm_import_error

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]

PROMPT = list(range(900, 930))  # 30 tokens: 28 can load (chunk + tail), 2 are computed


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonHandle]:
    with run_daemon(tmp_path, env={"KVOFFLOAD_RESET_NAMESPACE": "any"}) as d:
        yield d


def _engine(control: str, shape: Any = None) -> Any:
    from kvoffload.bench.vllm_engine import MiniEngine, Shape

    # No wait at a step's start for the daemon's replies (a stopped daemon never answers), and
    # a liveness window longer than the stop: the session stays attached throughout.
    return MiniEngine(plugin_config(control, kvoffload_copy_async=False, kvoffload_sync_ms=0,
                                    kvoffload_liveness_ms=60_000),
                      connector="KVOffloadConnector", connector_module="kvoffload.connector.vllm",
                      shape=shape or Shape())


def _answers(e: Any) -> list[tuple[str, int | None]]:
    calls: list[tuple[str, int | None]] = []
    original = e.connector.get_num_new_matched_tokens

    def recording(request: Any, local: int) -> Any:
        hit, is_async = original(request, local)
        calls.append((request.request_id, hit))
        return hit, is_async

    e.connector.get_num_new_matched_tokens = recording
    return calls


def _checked_loads(e: Any) -> dict[str, bool]:
    ok: dict[str, bool] = {}
    e.on_loaded = lambda req_id: ok.__setitem__(req_id, e.verify(req_id, PROMPT))
    return ok


def _keys(req: Any) -> list[Any]:
    """The prompt's stored keys: chunk 0 and the tail at 28, attention and Mamba each."""
    return keys_at(req.block_hashes, 3) + keys_at(req.block_hashes, 6)


def _fresh(e: Any) -> None:
    assert e.scheduler.reset_prefix_cache()
    e.scribble()  # only a correct load restores the prefix now


class _Stopped:
    """The daemon process stopped (SIGSTOP) inside the block, continued after it."""

    def __init__(self, d: DaemonHandle) -> None:
        assert d.proc is not None
        self.pid = d.proc.pid

    def __enter__(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def __exit__(self, *exc: object) -> None:
        os.kill(self.pid, signal.SIGCONT)


def test_stores_the_stopped_daemon_has_not_applied_wait_and_then_load(
        daemon: DaemonHandle) -> None:
    from kvoffload.daemon.base import KeyStatus

    e = _engine(daemon.control)
    answers = _answers(e)
    loaded = _checked_loads(e)
    with _Stopped(daemon):
        # Stopped before the first claim arrives: claims and commits wait in the socket.
        keys = _keys(e.add(PROMPT, "first", max_tokens=2))
        e.run()
        assert e.connector.scheduler.manager.counters["stores_committed"] == 4
        _fresh(e)
        e.add(PROMPT, "second", max_tokens=2)
        for _ in range(40):  # many steps, 0.4 s: far past any "two steps" of patience
            e.step()
            time.sleep(0.01)
        assert "second" not in e.prefill_tokens  # waiting for our own stores, not computed
        assert answers[-1] == ("second", None)
    # Once the daemon has taken everything (vLLM itself takes a chunk hit below a tail still
    # pending, so the test waits for the whole prompt rather than race the daemon):
    other = connect(daemon.control, e.connector.scheduler.manager.geometry)
    deadline = time.monotonic() + 30
    while other.probe(keys) != [KeyStatus.HIT] * 4:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    other.close()
    e.run(max_steps=2000)
    hits = [hit for req, hit in answers if req == "second"]
    assert 0 not in hits, hits  # never a MISS
    assert hits[-1] == 28 and e.prefill_tokens["second"] == 2
    assert loaded == {"second": True} and not e.failed_loads
    e.shutdown()


def test_own_commits_load_while_the_daemon_is_stopped(daemon: DaemonHandle) -> None:
    """The next request is looked up in the very step whose message carries the commits: its
    pins ride the same Step, after them (the daemon applies commits first: none is lost)."""
    from kvoffload.daemon.base import KeyStatus

    e = _engine(daemon.control)
    manager = e.connector.scheduler.manager
    answers = _answers(e)
    loaded = _checked_loads(e)
    other = connect(daemon.control, manager.geometry)
    keys = _keys(e.add(PROMPT, "first", max_tokens=2))
    # Until the workers are done and the commits are queued (not sent yet).
    for _ in range(200):
        if manager.counters["stores_committed"] == 4:
            break
        e.step()
    assert manager.counters["stores_committed"] == 4
    queued = {ref.key for ref in manager._batch.commits}
    assert queued  # the last commits wait for the next step's message
    deadline = time.monotonic() + 30
    while [s is KeyStatus.HIT_PENDING for s in other.probe(keys)] != [k in queued for k in keys]:
        assert time.monotonic() < deadline, other.probe(keys)  # the daemon has the claims
        time.sleep(0.01)
    with _Stopped(daemon):
        _fresh(e)
        e.add(PROMPT, "second", max_tokens=2)
        e.run()
        # Our own HIT: loaded and computed while the daemon is stopped.
        assert e.prefill_tokens["second"] == 2 and loaded == {"second": True}
    assert ("second", 28) in answers and not e.failed_loads
    deadline = time.monotonic() + 30
    session = manager.session
    while (other.probe(keys) != [KeyStatus.HIT] * 4
           or session.counters["replies"] < session.counters["steps_sent"]):
        assert time.monotonic() < deadline, (other.probe(keys), session.counters)
        e.step()  # an idle step reads the replies
        time.sleep(0.01)
    assert manager.counters["pins_lost"] == 0
    other.close()
    e.shutdown()


def test_blocks_another_engine_dropped_after_our_commit_are_stored_again_at_once(
        daemon: DaemonHandle) -> None:
    """Attention only, a 32-token prompt computed in one step: both of its blocks are
    committed in the request's last step, and dropped by another engine before this engine's
    next step, whose request must then miss at once and store them again."""
    from kvoffload.bench.vllm_engine import Shape
    from kvoffload.daemon.base import KeyStatus

    e = _engine(daemon.control, Shape(unit=16, mamba_groups=0))
    manager = e.connector.scheduler.manager
    answers = _answers(e)
    other = connect(daemon.control, manager.geometry)
    prompt = PROMPT + [1, 2]
    req = e.add(prompt, "first", max_tokens=1)
    keys = keys_at(req.block_hashes, 0, (0,)) + keys_at(req.block_hashes, 1, (0,))
    e.run()  # stored; the commits went out in the last step's message
    deadline = time.monotonic() + 30
    while other.probe(keys) != [KeyStatus.HIT] * 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert other.reset() == 2  # another engine drops them before this engine's next step
    _fresh(e)
    offered = manager.counters["stores_offered"]
    e.add(prompt, "second", max_tokens=1)
    out = e.step()
    # A MISS at once: scheduled in its first step, not withheld as if still pending.
    assert answers[-1] == ("second", 0) and out.num_scheduled_tokens.get("second") == 32
    e.run()
    assert manager.counters["stores_offered"] == offered + 2  # offered again, and stored
    _fresh(e)
    loaded: dict[str, bool] = {}
    e.on_loaded = lambda req_id: loaded.__setitem__(req_id, e.verify(req_id, prompt))
    e.add(prompt, "third", max_tokens=1)
    e.run()
    assert e.prefill_tokens["third"] == 1 and loaded == {"third": True}
    other.close()
    e.shutdown()
