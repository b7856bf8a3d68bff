"""The vLLM plugin in front of vLLM 0.33's own SCHEDULER-role OffloadingConnector and a real
daemon process: the upstream partial-tail example, pins, futures, settings, geometry."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.daemon_helpers import DaemonHandle, run_daemon  # noqa: E402
from tests.plugin_common import (  # noqa: E402
    connect,
    end_step,
    keys_at,
    offload_key,
    plugin_config,
    store,
)
from tests.vllm_harness import (  # noqa: E402
    build_scheduler_connector,
    daemon_manager,
    make_request,
    require_vllm,
    vllm_import_error,
)

if TYPE_CHECKING:
    from kvoffload.connector.vllm.manager import DaemonOffloadingManager
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_offload.base import PrepareStoreOutput

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]


def _blocks(*groups: list[int]) -> KVCacheBlocks:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(tuple(
        [KVCacheBlock(block_id=0, is_null=True) if b == 0 else KVCacheBlock(block_id=b)
         for b in group] for group in groups))


def _offered(out: PrepareStoreOutput | None) -> PrepareStoreOutput:
    """prepare_store's answer: vLLM's None ("cannot store now") is never right here."""
    assert out is not None
    return out


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonHandle]:
    # Another engine drops the namespace in some tests: the old any-registrant rule.
    with run_daemon(tmp_path, env={"KVOFFLOAD_RESET_NAMESPACE": "any"}) as d:
        yield d


def test_import_does_not_import_vllm() -> None:
    code = ("import sys, kvoffload.connector.vllm as m; assert 'vllm' not in sys.modules; "
            "m.KVOffloadSpec; assert 'vllm' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env={"VLLM_TARGET_DEVICE": "cpu",
                                                                  "PATH": "/usr/bin:/bin"})


def test_geometry_from_vllm_config(daemon: DaemonHandle) -> None:
    from kvoffload.daemon.base import GroupKind

    conn = build_scheduler_connector(plugin_config(daemon.control))
    geo = daemon_manager(conn).geometry
    assert [g.kind for g in geo.groups] == [GroupKind.FULL_ATTENTION, GroupKind.MAMBA]
    assert geo.groups[1].mamba_align and geo.tokens_per_hash == 4
    assert [g.tokens_per_block for g in geo.groups] == [16, 16]
    assert geo.tp_world_size == 1 and geo.blocks_per_chunk == 1
    # The same engine config gives the same namespace; another model revision does not.
    again = daemon_manager(build_scheduler_connector(plugin_config(daemon.control))).geometry
    other = daemon_manager(build_scheduler_connector(
        plugin_config(daemon.control, kvoffload_namespace="rev2"))).geometry
    assert again.namespace == geo.namespace != other.namespace


def test_bad_settings_are_refused() -> None:
    require_vllm()
    with pytest.raises(ValueError, match="kvoffload_control"):
        build_scheduler_connector({"spec_name": "KVOffloadSpec",
                                   "spec_module_path": "kvoffload.connector.vllm"})
    with pytest.raises(ValueError, match="kvoffload_timeout_ms"):
        build_scheduler_connector(plugin_config("ipc:///nowhere", kvoffload_timeout_ms="soon"))
    with pytest.raises(ValueError, match="set together"):
        build_scheduler_connector(plugin_config("ipc:///nowhere",
                                                kvoffload_prefill_tokens_per_s=10_000))
    with pytest.raises(ValueError, match="kvoffload_reset_daemon"):
        build_scheduler_connector(plugin_config("ipc:///nowhere", kvoffload_reset_daemon="all"))
    for bad in (0, -4, "many"):
        with pytest.raises(ValueError, match="kvoffload_store_reserve"):
            build_scheduler_connector(plugin_config("ipc:///nowhere",
                                                    kvoffload_store_reserve=bad))


def test_the_store_reserve_is_a_number_or_auto() -> None:
    from kvoffload.connector.vllm.settings import manager_settings

    assert manager_settings({}).reserve is None  # auto: a share of the pool
    assert manager_settings({"kvoffload_store_reserve": "AUTO"}).reserve is None
    assert manager_settings({"kvoffload_store_reserve": "12"}).reserve == 12


def test_time_model_reaches_the_daemon_and_declines_tails(daemon: DaemonHandle) -> None:
    """With a time model under which no tail pays, vLLM's own scan stops at the chunk hit:
    the daemon marks the stored tail not worth loading in the shared index once an engine of
    the namespace registers that time model."""
    plain = build_scheduler_connector(plugin_config(daemon.control))
    req = make_request(list(range(30)), "declined")
    h = req.block_hashes
    other = connect(daemon.control, daemon_manager(plain).geometry)
    store(other, keys_at(h, 3), end_token=16)
    store(other, keys_at(h, 6), end_token=28)  # a tail, stored before any time model
    plain.on_new_request(req)
    assert plain.get_num_new_matched_tokens(req, 0)[0] == 28
    conn = build_scheduler_connector(plugin_config(
        daemon.control, kvoffload_prefill_tokens_per_s=1e12, kvoffload_copy_bytes_per_s=1.0))
    again = make_request(list(range(30)), "declined-2")
    conn.on_new_request(again)
    hit, _ = conn.get_num_new_matched_tokens(again, 0)
    assert hit == 16  # the tail at 28 is stored, but cannot repay its load
    assert daemon_manager(conn).counters["tails_declined"] > 0


def _settle(pred: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Steps go out without waiting: the daemon applies them a moment later."""
    import time

    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _sent(manager: DaemonOffloadingManager) -> tuple[int, int]:
    """(messages sent, round trips waited for) by the manager so far."""
    return manager.session.counters["steps_sent"], manager.session.client.round_trips


def test_worked_example_tail_hit_and_load_job(daemon: DaemonHandle) -> None:
    """Upstream numbers: 30 tokens, block 16, unit 4 -> 28 with the tail, answered from the
    shared index with no message; a load job writing blocks [31, 32, 41] from the slots (and
    generations) the index holds; pins taken by the step's one message, released after."""
    conn = build_scheduler_connector(plugin_config(daemon.control))
    manager = daemon_manager(conn)
    req = make_request(list(range(30)), "worked")
    h = req.block_hashes
    other = connect(daemon.control, manager.geometry)
    slots = dict(zip(keys_at(h, 3) + keys_at(h, 6), store(other, keys_at(h, 3) + keys_at(h, 6)),
                     strict=True))

    conn.on_new_request(req)
    before = _sent(manager)
    assert conn.get_num_new_matched_tokens(req, 0) == (28, True)
    assert _sent(manager) == before  # ~10 key lookups, no message at all

    conn.update_state_after_alloc(req, _blocks([31, 32], [0, 41]), 28)
    (job,) = conn.scheduler._current_batch_load_jobs.values()
    from kvoffload.connector.vllm.load_spec import PoolSlotsSpec
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    assert isinstance(job.dst_spec, GPULoadStoreSpec) and isinstance(job.src_spec, PoolSlotsSpec)
    assert list(job.dst_spec.block_ids) == [31, 32, 41]
    assert list(job.dst_spec.group_sizes) == [2, 1]
    assert list(job.dst_spec.block_indices) == [0, 1]
    loaded = [offload_key(h[3], 0), offload_key(h[6], 0), offload_key(h[6], 1)]
    assert job.src_spec.slots == [slots[k] for k in loaded]
    assert all(g > 0 for g in job.src_spec.gens) and job.src_spec.req_id == "worked"
    assert job.src_spec.pool is not None and job.src_spec.pool.pool_path == daemon.pool_path
    assert other.stats()["pinned"] == 0  # nothing sent yet
    end_step(conn)
    assert _sent(manager)[0] == before[0] + 1 and _sent(manager)[1] == before[1]
    # h3@g0, h6@g0, h6@g1: the keys the load reads, pinned when the step's message arrives.
    assert _settle(lambda: other.stats()["pinned"] == 3)

    # The worker reports the load done: the pins go back in the next step's message.
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput

    (job_id,) = conn.scheduler._jobs
    conn.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs={job_id: 1})))
    assert other.stats()["pinned"] == 3
    assert conn.has_pending_push_work()  # the engine keeps stepping until released
    end_step(conn)
    assert _settle(lambda: other.stats()["pinned"] == 0)
    manager.shutdown()


def test_group_missing_the_tail_gives_16(daemon: DaemonHandle) -> None:
    conn = build_scheduler_connector(plugin_config(daemon.control))
    manager = daemon_manager(conn)
    req = make_request(list(range(100, 130)), "no-tail")
    h = req.block_hashes
    other = connect(daemon.control, manager.geometry)
    store(other, keys_at(h, 3) + keys_at(h, 6, groups=(0,)))  # Mamba lacks h6
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (16, True)
    conn.update_state_after_alloc(req, _blocks([31], [41]), 16)
    end_step(conn)
    # Only the keys a load of the 16-token hit reads are pinned (Mamba's h3, attention's h3).
    assert _settle(lambda: other.stats()["pinned"] == 2)
    manager.shutdown()


def test_pending_keys_defer_then_hit_once_committed(daemon: DaemonHandle) -> None:
    """Keys being written answer HIT_PENDING (the request waits, asking nothing); the step
    after the writer commits, the index says READY and vLLM takes the hit."""
    conn = build_scheduler_connector(plugin_config(daemon.control))
    manager = daemon_manager(conn)
    req = make_request(list(range(200, 230)), "pending")
    h = req.block_hashes
    other = connect(daemon.control, manager.geometry)
    keys = keys_at(h, 3) + keys_at(h, 6)
    store(other, keys, commit=False)  # granted, being written
    conn.on_new_request(req)
    before = _sent(manager)
    assert conn.get_num_new_matched_tokens(req, 0) == (None, False)
    end_step(conn)
    assert conn.get_num_new_matched_tokens(req, 0) == (None, False)
    end_step(conn)
    assert _sent(manager)[1] == before[1]  # no round trip: nobody polls the daemon
    other.commit_store(keys)
    assert conn.get_num_new_matched_tokens(req, 0) == (28, True)
    manager.shutdown()


def test_stores_use_the_reservation_and_skip_stored_keys(daemon: DaemonHandle) -> None:
    from kvoffload.daemon.base import KeyStatus
    from vllm.v1.kv_offload.base import ReqContext

    conn = build_scheduler_connector(plugin_config(daemon.control))
    manager = daemon_manager(conn)
    assert len(manager._reserved) == manager.reservation.floor  # filled at start
    req = make_request(list(range(300, 330)), "store")
    conn.on_new_request(req)
    ctx = ReqContext(req_id="store")
    k0, k1 = keys_at(req.block_hashes, 3)
    ctx.set_offload_key_position(k0, 16)
    ctx.set_offload_key_position(k1, 16)
    before = _sent(manager)
    out = _offered(manager.prepare_store([k0, k1], ctx))
    again = _offered(manager.prepare_store([k0, k1], ctx))  # same step, already being stored
    assert out.keys_to_store == [k0, k1] and again.keys_to_store == []
    from kvoffload.connector.vllm.load_spec import PoolSlotsSpec

    assert isinstance(out.store_spec, PoolSlotsSpec)
    assert len(set(out.store_spec.slots)) == 2 and min(out.store_spec.slots) >= 0
    assert _sent(manager) == before  # slots came from the reservation: no message
    other = connect(daemon.control, manager.geometry)
    end_step(conn)  # the claims go out: the keys read PENDING for everyone
    assert _settle(lambda: other.probe([k0, k1]) == [KeyStatus.HIT_PENDING] * 2)
    manager.complete_store([k0, k1], ctx)  # the commits ride the next step's message
    assert manager.has_pending_work()  # ... so vLLM steps the engine once more
    assert other.probe([k0, k1]) == [KeyStatus.HIT_PENDING] * 2
    end_step(conn)
    assert _settle(lambda: other.probe([k0, k1]) == [KeyStatus.HIT] * 2)
    assert _sent(manager)[0] == before[0] + 2  # one Step per step: no message of their own
    end_step(conn)
    assert _offered(manager.prepare_store([k0, k1], ctx)).keys_to_store == []  # not offered
    # ... but reused: the daemon hears of it (recency, as vLLM's own manager records reuse).
    assert manager._batch.touches == [k0, k1]
    manager.shutdown()


def test_keys_another_engine_evicted_are_offered_again(daemon: DaemonHandle) -> None:
    """"Already stored" is read from the index: once the block is gone (evicted, reset by
    someone else), prepare_store offers it again."""
    from vllm.v1.kv_offload.base import ReqContext

    conn = build_scheduler_connector(plugin_config(daemon.control))
    manager = daemon_manager(conn)
    req = make_request(list(range(600, 630)), "again")
    k0, k1 = keys_at(req.block_hashes, 3)
    other = connect(daemon.control, manager.geometry)
    store(other, [k0, k1])
    ctx = ReqContext(req_id="again")
    end_step(conn)
    assert _offered(manager.prepare_store([k0, k1], ctx)).keys_to_store == []
    end_step(conn)
    assert other.reset() == 2  # the other engine drops them
    assert _offered(manager.prepare_store([k0, k1], ctx)).keys_to_store == [k0, k1]
    manager.shutdown()


def test_daemon_down_lookups_miss_and_stores_skip(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import ReqContext

    require_vllm()
    with run_daemon(tmp_path) as d:
        conn = build_scheduler_connector(plugin_config(d.control, kvoffload_timeout_ms=200,
                                                       kvoffload_retry_ms=60_000,
                                                       kvoffload_liveness_ms=300))
        manager = daemon_manager(conn)
        d.kill()
        assert _settle(lambda: manager.session.view is None or
                       manager.session._healthy() is not None)
        req = make_request(list(range(30)), "down")
        conn.on_new_request(req)
        assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
        k0, k1 = keys_at(req.block_hashes, 3)
        out = _offered(manager.prepare_store([k0, k1], ReqContext(req_id="down")))
        assert out.keys_to_store == []
        assert manager.counters["stores_skipped_offline"] == 2
        assert manager.session.counters["offline_events"] >= 1
        end_step(conn)
        manager.shutdown()


def test_kvoffload_connector_subclass(daemon: DaemonHandle) -> None:
    """The documented path: the KVCacheConfig and requests are handed over explicitly."""
    from kvoffload.connector.vllm import KVOffloadConnector
    from kvoffload.daemon.base import GroupKind

    conn = build_scheduler_connector(plugin_config(daemon.control),
                                     connector_class=KVOffloadConnector)
    manager = daemon_manager(conn)
    assert [g.spec_kind for g in manager.geometry.groups] == ["full_attention", "mamba"]
    assert [g.kind for g in manager.geometry.groups] == [GroupKind.FULL_ATTENTION,
                                                         GroupKind.MAMBA]
    req = make_request(list(range(400, 430)), "subclass")
    store(connect(daemon.control, manager.geometry),
          keys_at(req.block_hashes, 3) + keys_at(req.block_hashes, 6))
    conn.on_new_request(req)
    assert "subclass" in manager.requests
    assert conn.get_num_new_matched_tokens(req, 0) == (28, True)
    (pending,) = manager._batch.lookups
    from kvoffload.connector.vllm.requests import lookup_report

    # The deferred form (manager.report_lookup): what the step's message carries, built there.
    report = lookup_report(manager.geometry.groups[0].tokens_per_block, *pending)
    assert (report.req_id, report.hit_tokens, report.chunk_tokens, report.tail_boundary) == (
        "subclass", 28, 16, 28)
    manager.shutdown()


def test_worker_rank_pages_generations_and_failed_loads(tmp_path: Path) -> None:
    """Each TP rank copies its own page of a slot; a slot of -1 copies nothing; a load whose
    slot went to another writer (its generation moved) is never reported as a good load."""
    import os
    import uuid

    import torch
    from kvoffload.connector.vllm.load_spec import PoolInfo, PoolSlotsSpec
    from kvoffload.connector.vllm.worker import DaemonOffloadingWorker
    from kvoffload.daemon.store import shared_index as si
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )

    page, slots_n = 512, 8
    path = f"/dev/shm/kvoffload-plugin-{uuid.uuid4().hex[:8]}"
    with open(path, "wb") as f:
        f.truncate(slots_n * 2 * page)
    index = si.SharedIndexWriter(f"{path}.index", slots_n, "d1")
    for slot in (3, 5):
        index.write(slot, 1, 0, si.FREE, 0, None)  # generation 1: reserved for our stores
    try:
        pool = PoolInfo("d1", path, slots_n * 2 * page, 2 * page, page, str(index.path))
        kv, workers = [], []
        for rank in range(2):
            t = torch.randint(-128, 128, (8, page), dtype=torch.int8)
            canonical = CanonicalKVCaches([CanonicalKVCacheTensor(t, page)],
                                          [[CanonicalKVCacheRef(0, page)],
                                           [CanonicalKVCacheRef(0, page // 2)]])
            kv.append(t)
            workers.append(DaemonOffloadingWorker(canonical, rank, 2, cpu_async=False,
                                                  reports_load_errors=rank == 0))
        before = [t.clone() for t in kv]
        for job, w in enumerate(workers):
            src = GPULoadStoreSpec([1, 2, 3], group_sizes=[2, 1], block_indices=[0, 0])
            assert w.submit_store(job, src, PoolSlotsSpec([3, -1, 5], pool, [1, 0, 1]))
            (result,) = w.get_finished()
            assert result.success and result.transfer_size == page + page // 2
        raw = torch.from_file(path, shared=False, size=slots_n * 2 * page, dtype=torch.int8)
        for rank in range(2):  # slot 3 holds block 1 of each rank, in that rank's page
            assert torch.equal(raw[3 * 2 * page + rank * page:][:page], before[rank][1])
        for t in kv:
            t.zero_()
        for job, w in enumerate(workers, start=10):
            dst = GPULoadStoreSpec([6, 7], group_sizes=[1, 1], block_indices=[0, 0])
            assert w.submit_load(job, PoolSlotsSpec([3, 5], pool, [1, 1], "r"), dst)
            assert [r.success for r in w.get_finished()] == [True]
        for rank in range(2):
            assert torch.equal(kv[rank][6], before[rank][1])
            assert torch.equal(kv[rank][7][: page // 2], before[rank][3][: page // 2])
        # Nothing to copy (every store refused): done at once, nothing moved.
        src = GPULoadStoreSpec([1], group_sizes=[1, 0], block_indices=[0, 0])
        assert workers[0].submit_store(99, src, PoolSlotsSpec([-1], pool))
        assert [(r.job_id, r.success, r.transfer_size) for r in workers[0].get_finished()] == [
            (99, True, 0)]
        # Slot 3 goes to another writer: a load expecting generation 1 must not pass.
        index.write(3, 2, 0, si.FREE, 0, None)
        for t in kv:
            t.zero_()
        dst = GPULoadStoreSpec([6], group_sizes=[1, 0], block_indices=[0, 0])
        # Under KVOffloadConnector: the job completes, its request is a failed load.
        assert workers[0].submit_load(20, PoolSlotsSpec([3], pool, [1], "r2"), dst)
        assert [r.success for r in workers[0].get_finished()] == [True]
        assert workers[0].take_failed_requests() == {"r2"}
        # Under the stock connector (no way to report it): the job itself fails.
        assert workers[1].submit_load(21, PoolSlotsSpec([3], pool, [1], "r2"), dst)
        assert [r.success for r in workers[1].get_finished()] == [False]
        assert not kv[1][6].any()  # nothing was copied from a slot that is not ours
        # A key the manager had no slot for is a failed load too, never an empty success.
        assert workers[1].submit_load(22, PoolSlotsSpec([-1], pool, [0], "r3"), dst)
        assert [r.success for r in workers[1].get_finished()] == [False]
        # A superseded index (a newer daemon owns the pool) fails every check.
        si.supersede(index.path)
        assert workers[0].submit_load(23, PoolSlotsSpec([5], pool, [1], "r4"), dst)
        workers[0].get_finished()
        assert workers[0].take_failed_requests() == {"r4"}
        for w in workers:
            w.shutdown()
    finally:
        index.close()
        os.unlink(path)


def test_store_items_describe_their_tokens(daemon: DaemonHandle) -> None:
    """What a store claim tells the daemon (for self-describing events) about each key, with
    the request handed over by KVOffloadConnector."""
    from kvoffload.connector.vllm import KVOffloadConnector

    conn = build_scheduler_connector(plugin_config(daemon.control),
                                     connector_class=KVOffloadConnector)
    manager = daemon_manager(conn)
    req = make_request(list(range(500, 530)), "items")
    conn.on_new_request(req)
    conn.get_num_new_matched_tokens(req, 0)  # vLLM records every chunk key's position
    h = req.block_hashes
    chunk, tail = offload_key(h[3], 0), offload_key(h[6], 1)
    ctx = conn.scheduler._req_status["items"].req_context
    ctx.set_offload_key_position(tail, 28)
    manager.prepare_store([chunk, tail], ctx)
    items = {c.item.key: c.item for c in manager._batch.claims}
    assert items[chunk].token_ids == list(range(500, 516)) and not items[chunk].tail
    assert items[chunk].block_hashes == h[0:4] and items[chunk].parent_hash is None
    assert items[tail].token_ids == list(range(516, 528)) and items[tail].tail
    assert items[tail].end_token == 28 and items[tail].parent_hash == h[3]
    assert items[tail].block_hashes == h[4:7]
    manager.shutdown()


def test_untested_vllm_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvoffload.connector.vllm.settings import UntestedVllm, check_vllm_version

    monkeypatch.delenv("KVOFFLOAD_ALLOW_UNTESTED_VLLM", raising=False)
    with pytest.raises(UntestedVllm, match="tested with vLLM 0.33.0, not 0.34.0"):
        check_vllm_version("0.34.0")
    monkeypatch.setenv("KVOFFLOAD_ALLOW_UNTESTED_VLLM", "1")
    check_vllm_version("0.34.0")


def test_an_idle_engine_stays_attached(daemon: DaemonHandle) -> None:
    """No step for longer than the liveness window: the replies were only unread, the daemon
    is alive, and the next step answers from the index without re-attaching."""
    import time

    from kvoffload.connector.vllm import KVOffloadConnector

    conn = build_scheduler_connector(plugin_config(daemon.control, kvoffload_liveness_ms=300),
                                     connector_class=KVOffloadConnector)
    manager = daemon_manager(conn)
    req = make_request(list(range(700, 730)), "idle")
    store(connect(daemon.control, manager.geometry),
          keys_at(req.block_hashes, 3) + keys_at(req.block_hashes, 6))
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (28, True)
    end_step(conn)  # a Step (its lookup report) goes out; nobody reads the reply yet
    time.sleep(0.8)
    again = make_request(list(range(700, 730)), "idle-2")
    conn.on_new_request(again)
    assert conn.get_num_new_matched_tokens(again, 0) == (28, True)
    assert manager.session.counters["offline_events"] == 0
    assert manager.session.counters["attaches"] == 1
    manager.shutdown()


def test_a_frozen_daemon_means_misses_then_the_plugin_comes_back(daemon: DaemonHandle) -> None:
    """SIGSTOP: past the liveness window lookups answer MISS without waiting on the daemon;
    after SIGCONT the plugin re-attaches by itself and hits again."""
    import os
    import signal
    import time

    conn = build_scheduler_connector(plugin_config(
        daemon.control, kvoffload_liveness_ms=300, kvoffload_retry_ms=200,
        kvoffload_timeout_ms=300))
    manager = daemon_manager(conn)
    req = make_request(list(range(800, 830)), "frozen")
    store(connect(daemon.control, manager.geometry),
          keys_at(req.block_hashes, 3) + keys_at(req.block_hashes, 6))
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(0.6)  # the index heartbeat goes stale
        conn.on_new_request(req)
        assert conn.get_num_new_matched_tokens(req, 0) == (0, False)  # MISS, nothing waited on
        end_step(conn)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert manager.session.counters["offline_events"] >= 1
    deadline = time.monotonic() + 30
    hit = None
    while time.monotonic() < deadline:
        again = make_request(list(range(800, 830)), f"thawed-{time.monotonic()}")
        conn.on_new_request(again)
        hit, _ = conn.get_num_new_matched_tokens(again, 0)
        end_step(conn)
        if hit == 28:
            break
        time.sleep(0.05)
    assert hit == 28 and manager.session.counters["attaches"] >= 2
    manager.shutdown()
