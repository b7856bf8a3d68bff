"""End to end through vLLM 0.33's real core Scheduler, its WORKER-role OffloadingConnector over
CPU KV tensors, our plugin and a real daemon process (see plugin_engine.py for the fake model)."""

from __future__ import annotations

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

BLOCK, UNIT = 16, 4


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonHandle]:
    with run_daemon(tmp_path) as d:
        yield d


def engine(control: str, connector: str = "OffloadingConnector", **extra: Any) -> Any:
    from tests.plugin_engine import MiniEngine

    module = "kvoffload.connector.vllm" if connector == "KVOffloadConnector" else None
    return MiniEngine(plugin_config(control, kvoffload_copy_async=False, **extra),
                      connector=connector, connector_module=module)


def serve(e: Any, tokens: list[int], req_id: str, max_tokens: int = 4) -> int:
    """Run one request to completion; returns the prompt tokens the model computed."""
    e.add(tokens, req_id, max_tokens)
    e.run()
    return e.prefill_tokens[req_id]


def fresh_gpu(e: Any) -> None:
    """Drop the GPU prefix cache and every KV byte: only the offload store can help now."""
    assert e.scheduler.reset_prefix_cache()
    e.scribble()


@pytest.mark.parametrize("connector", ["OffloadingConnector", "KVOffloadConnector"])
def test_store_then_load_bytes_through_the_pool(daemon: DaemonHandle, connector: str) -> None:
    from tests.plugin_engine import ROW, state_page, token_row

    e = engine(daemon.control, connector)
    prompt = list(range(7, 37))  # 30 tokens
    assert serve(e, prompt, "first") == 30
    manager = e.connector.scheduler.manager
    # Chunk 0 of both groups, the attention block at 28 and the core's CoW Mamba snapshot.
    assert manager.counters["stores_offered"] == 4
    fresh_gpu(e)

    seen: dict[str, Any] = {}

    def check(req_id: str) -> None:  # runs when the worker reports the load done
        attn, mamba = e.block_table(req_id)
        seen["attn"] = [bytes(e.pages["attn.0"][attn[t // BLOCK], ROW * (t % BLOCK):
                                                ROW * (t % BLOCK + 1)].numpy()) for t in range(28)]
        seen["state"] = bytes(e.pages["mamba.0"][mamba[1]].numpy())

    e.on_loaded = check
    assert serve(e, prompt, "second") == 2  # 28 loaded, 2 computed
    assert seen["attn"] == [bytes(token_row(prompt, t).numpy()) for t in range(28)]
    assert seen["state"] == bytes(state_page(prompt[:28]).numpy())
    e.shutdown()


def test_daemon_killed_and_restarted(daemon: DaemonHandle) -> None:
    import time

    e = engine(daemon.control, kvoffload_timeout_ms=300, kvoffload_retry_ms=0,
               kvoffload_liveness_ms=300)
    manager = e.connector.scheduler.manager
    prompt = list(range(50, 80))
    assert serve(e, prompt, "a") == 30
    fresh_gpu(e)
    daemon.kill()
    time.sleep(0.5)  # past the liveness window: the index's heartbeat is stale

    # The daemon is gone: the same prompt misses, in its first step, and nothing raises.
    e.add(prompt, "b")
    out = e.step()
    assert out.num_scheduled_tokens.get("b") == BLOCK  # scheduled at once: no deferral
    e.run()
    assert e.prefill_tokens["b"] == 30
    assert manager.session.counters["offline_events"] >= 1
    assert manager.counters["stores_skipped_offline"] > 0

    daemon.start()  # started without a state dir, it may come back empty: then the next
    # The engine re-attaches on a background thread (its steps never wait for it): idle
    # steps pick the new session up.
    deadline = time.monotonic() + 30
    while not manager.session.attached and time.monotonic() < deadline:
        e.step()
        time.sleep(0.01)
    assert manager.session.attached
    fresh_gpu(e)    # request stores again ...
    assert serve(e, prompt, "c") in (2, 30)
    fresh_gpu(e)
    assert serve(e, prompt, "d") == 2  # ... and hits come back
    e.shutdown()


def conversation(turns: int) -> list[list[int]]:
    """User messages of a multi-turn chat; turn k's prompt is everything so far."""
    return [list(range(1000 * (k + 1), 1000 * (k + 1) + 22 + 3 * k)) for k in range(turns)]


def replay(e: Any, turns: int) -> tuple[list[int], list[int]]:
    """Replay a chat (GPU cache dropped between turns); returns prompts' lengths and tokens
    computed per turn."""
    history: list[int] = []
    lengths, computed = [], []
    for k, message in enumerate(conversation(turns)):
        prompt = history + message
        computed.append(serve(e, prompt, f"turn{k}", max_tokens=3))
        lengths.append(len(prompt))
        # The assistant's reply (what the fake model samples) joins the history.
        history = prompt + [1000 + len(prompt) + i for i in range(3)]
        fresh_gpu(e)
    return lengths, computed


def test_multi_turn_serves_up_to_the_previous_turn(daemon: DaemonHandle) -> None:
    from tests.plugin_engine import MiniEngine

    ours = engine(daemon.control)
    lengths, computed = replay(ours, 5)
    ours.shutdown()
    # Every later turn loads up to the previous prompt's last hash boundary (its CoW tail),
    # not just up to the first turn's tail.
    for k in range(1, 5):
        boundary = (lengths[k - 1] - 1) // UNIT * UNIT
        assert computed[k] == lengths[k] - boundary, (k, lengths, computed)

    baseline = MiniEngine({"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 64 << 20},
                          real_worker=False)
    _, theirs = replay(baseline, 5)
    baseline.shutdown()
    assert computed[0] == theirs[0]
    assert sum(computed) < sum(theirs), (computed, theirs)

    # The gain is the offload policy: with vLLM's default CHUNK_LEVEL our plugin recomputes
    # exactly what vLLM's own CPU manager does (the block a tail half loaded is never stored).
    chunk = engine(daemon.control, kvoffload_offload_policy="chunk", kvoffload_namespace="chunk")
    _, chunk_computed = replay(chunk, 5)
    chunk.shutdown()
    assert chunk_computed == theirs


def baseline() -> Any:
    """vLLM's own in-process CPUOffloadingManager, same scheduler, same worker timing."""
    from tests.plugin_engine import MiniEngine

    return MiniEngine({"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 64 << 20},
                      real_worker=False)


def record_lookups(e: Any) -> list[tuple[int, str, Any]]:
    """Every get_num_new_matched_tokens answer as (step, request, (tokens, is_async))."""
    calls: list[tuple[int, str, Any]] = []
    original = e.connector.get_num_new_matched_tokens

    def recording(request: Any, num_computed_tokens: int) -> Any:
        result = original(request, num_computed_tokens)
        calls.append((e.steps, request.request_id, result))
        return result

    e.connector.get_num_new_matched_tokens = recording
    return calls


def hot_requests(e: Any, per_step: list[tuple[int, int]] | None = None) -> list[Any]:
    """Four stored prompts, GPU cache dropped, then all four again at once."""
    prompts = [list(range(100 * i, 100 * i + 30 + i)) for i in range(1, 5)]
    for i, prompt in enumerate(prompts):
        e.add(prompt, f"warm{i}")
    e.run()
    fresh_gpu(e)
    calls = record_lookups(e)
    for i, prompt in enumerate(prompts):
        e.add(prompt, f"hot{i}")
    manager = e.connector.scheduler.manager
    while e.busy():
        if per_step is None:
            e.step()
            continue
        trips, sent = manager.session.client.round_trips, manager.session.counters["steps_sent"]
        e.step()
        per_step.append((manager.session.client.round_trips - trips,
                         manager.session.counters["steps_sent"] - sent))
    return calls


def test_round_trips_per_step_and_no_deferral(daemon: DaemonHandle) -> None:
    e = engine(daemon.control)
    per_step: list[tuple[int, int]] = []
    calls = hot_requests(e, per_step)
    e.shutdown()
    # No round trip at all: lookups read the shared index; no request deferred.
    assert sum(trips for trips, _ in per_step) == 0, per_step
    assert [c for c in calls if c[2][0] is None] == []
    # Each prompt's last hash boundary below its end (prompts of 31..34 tokens).
    assert {r: res[0] for _, r, res in calls} == {"hot0": 28, "hot1": 28, "hot2": 32, "hot3": 32}
    # One Step per scheduler step, plus one commit message per finished store job.
    assert max(sent for _, sent in per_step) <= 1 + 4, per_step
    # vLLM's in-process manager answers the same, in the same steps.
    theirs = baseline()
    assert hot_requests(theirs) == calls
    theirs.shutdown()


def waiting_for_a_store(e: Any) -> tuple[list[Any], list[int]]:
    """B arrives while A's partial tail is being written."""
    prompt = list(range(600, 630))
    e.add(prompt, "A")
    for _ in range(3):  # 16, 12 (to 28), then 2 tokens: this step hands off the CoW tail
        e.step()
    manager = e.connector.scheduler.manager
    completed: list[int] = []
    original = manager.complete_store

    def complete_store(keys: Any, ctx: Any, success: bool = True) -> None:
        completed.append(e.steps)
        original(keys, ctx, success)

    manager.complete_store = complete_store
    calls = record_lookups(e)
    e.add(prompt, "B")
    e.run()
    assert e.prefill_tokens["B"] == 2
    return calls, completed


def test_request_waiting_for_our_own_store_hits_right_after_it(daemon: DaemonHandle) -> None:
    """B is deferred (HIT_PENDING) while A's tail is written, and hits right after A's store
    completed: our own commit makes the key a HIT at once, as in vLLM's in-process manager."""
    e = engine(daemon.control)
    calls, completed = waiting_for_a_store(e)
    e.shutdown()
    assert calls[0] == (3, "B", (None, False))  # the tail keys are being written
    # The step after the tail's store completed: 16 tokens from the GPU prefix cache, 12
    # loaded (up to the tail at 28). Our claim reaches the daemon a step before the commit,
    # so the index holds it PENDING in our slot by then.
    assert calls[-1] == (completed[0] + 1, "B", (12, True)), calls
    assert all(res == (None, False) for _, _, res in calls[:-1])
    theirs = baseline()
    their_calls = waiting_for_a_store(theirs)[0]
    theirs.shutdown()
    assert their_calls[-1][1:] == calls[-1][1:]
    assert calls[-1][0] - their_calls[-1][0] <= 2  # deferral: at most vLLM's + 2 steps
