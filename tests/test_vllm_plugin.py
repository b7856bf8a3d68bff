"""The vLLM plugin in front of vLLM 0.33's own SCHEDULER-role OffloadingConnector and a real
daemon process: the upstream partial-tail example, pins, futures, settings, geometry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from daemon_helpers import run_daemon  # noqa: E402
from plugin_common import connect, end_step, keys_at, plugin_config, store  # noqa: E402
from vllm_harness import (  # noqa: E402
    build_scheduler_connector,
    hybrid_kv_cache_config,
    make_request,
    require_vllm,
    vllm_import_error,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]


def _blocks(*groups: list[int]) -> object:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(tuple(
        [KVCacheBlock(block_id=0, is_null=True) if b == 0 else KVCacheBlock(block_id=b)
         for b in group] for group in groups))


@pytest.fixture
def daemon(tmp_path: Path):  # type: ignore[no-untyped-def]
    with run_daemon(tmp_path) as d:
        yield d


def test_import_does_not_import_vllm() -> None:
    code = ("import sys, kvoffload.connector.vllm as m; assert 'vllm' not in sys.modules; "
            "m.KVOffloadSpec; assert 'vllm' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env={"VLLM_TARGET_DEVICE": "cpu",
                                                                  "PATH": "/usr/bin:/bin"})


def test_geometry_from_vllm_config(daemon) -> None:  # type: ignore[no-untyped-def]
    from kvoffload.daemon.types import GroupKind

    conn = build_scheduler_connector(plugin_config(daemon.control))
    geo = conn.scheduler.manager.geometry
    assert [g.kind for g in geo.groups] == [GroupKind.FULL_ATTENTION, GroupKind.MAMBA]
    assert geo.groups[1].mamba_align and geo.tokens_per_hash == 4
    assert [g.tokens_per_block for g in geo.groups] == [16, 16]
    assert geo.tp_world_size == 1 and geo.blocks_per_chunk == 1
    # The same engine config gives the same namespace; another model revision does not.
    again = build_scheduler_connector(plugin_config(daemon.control)).scheduler.manager.geometry
    other = build_scheduler_connector(
        plugin_config(daemon.control, kvoffload_namespace="rev2")).scheduler.manager.geometry
    assert again.namespace == geo.namespace != other.namespace
    # The manager found vLLM's per-request state (no per-key fallback).
    assert conn.scheduler.manager.requests is not None


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


def test_time_model_reaches_the_daemon_and_declines_tails(daemon) -> None:  # type: ignore[no-untyped-def]
    """With a time model under which no tail pays, vLLM's own scan stops at the chunk hit."""
    conn = build_scheduler_connector(plugin_config(
        daemon.control, kvoffload_prefill_tokens_per_s=1e12, kvoffload_copy_bytes_per_s=1.0))
    manager = conn.scheduler.manager
    req = make_request(list(range(30)), "declined")
    h = req.block_hashes
    other = connect(daemon.control, manager.geometry)
    store(other, keys_at(h, 3) + keys_at(h, 6))
    conn.on_new_request(req)
    hit, _ = conn.get_num_new_matched_tokens(req, 0)
    assert hit == 16  # the tail at 28 is stored, but cannot repay its load


def test_worked_example_tail_hit_and_load_job(daemon) -> None:  # type: ignore[no-untyped-def]
    """Upstream numbers: 30 tokens, block 16, unit 4 -> 28 with the tail, one round trip,
    a load job writing blocks [31, 32, 41] from the slots the daemon pinned."""
    conn = build_scheduler_connector(plugin_config(daemon.control))
    manager = conn.scheduler.manager
    req = make_request(list(range(30)), "worked")
    h = req.block_hashes
    other = connect(daemon.control, manager.geometry)
    slots = dict(zip(keys_at(h, 3) + keys_at(h, 6), store(other, keys_at(h, 3) + keys_at(h, 6)),
                     strict=True))

    conn.on_new_request(req)
    before = manager.client.round_trips
    assert conn.get_num_new_matched_tokens(req, 0) == (28, True)
    assert manager.client.round_trips - before == 1  # ~10 key lookups, one Lookup
    assert other.stats()["pinned"] == 3  # h3@g0, h6@g0, h6@g1: the keys the load reads

    conn.update_state_after_alloc(req, _blocks([31, 32], [0, 41]), 28)
    (job,) = conn.scheduler._current_batch_load_jobs.values()
    assert list(job.dst_spec.block_ids) == [31, 32, 41]
    assert list(job.dst_spec.group_sizes) == [2, 1]
    assert list(job.dst_spec.block_indices) == [0, 1]
    from kvoffload.daemon.types import make_key

    loaded = [make_key(h[3], 0), make_key(h[6], 0), make_key(h[6], 1)]
    assert job.src_spec.slots == [slots[k] for k in loaded]
    assert job.src_spec.pool.pool_path == daemon.pool_path
    end_step(conn)

    # The worker reports the load done: the pins go back in the next step's one batch.
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
    assert other.stats()["pinned"] == 0
    manager.shutdown()


def test_group_missing_the_tail_gives_16(daemon) -> None:  # type: ignore[no-untyped-def]
    conn = build_scheduler_connector(plugin_config(daemon.control))
    manager = conn.scheduler.manager
    req = make_request(list(range(100, 130)), "no-tail")
    h = req.block_hashes
    other = connect(daemon.control, manager.geometry)
    store(other, keys_at(h, 3) + keys_at(h, 6, groups=(0,)))  # Mamba lacks h6
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (16, True)
    # Only the keys a load of the 16-token hit reads are pinned (Mamba's h3, attention's h3).
    assert other.stats()["pinned"] == 2
    manager.shutdown()


def test_pending_keys_defer_then_resolve_through_a_future(daemon) -> None:  # type: ignore[no-untyped-def]
    """Keys being written answer HIT_PENDING; the manager parks the request on the daemon's
    future and spends no round trip on it until the daemon resolves it."""
    conn = build_scheduler_connector(plugin_config(daemon.control))
    manager = conn.scheduler.manager
    req = make_request(list(range(200, 230)), "pending")
    h = req.block_hashes
    other = connect(daemon.control, manager.geometry)
    keys = keys_at(h, 3) + keys_at(h, 6)
    store(other, keys, commit=False)  # granted, being written
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (None, False)
    assert manager.counters["parked"] == 1
    end_step(conn)

    before = manager.client.round_trips
    assert conn.get_num_new_matched_tokens(req, 0) == (None, False)
    assert manager.client.round_trips == before  # parked: no polling
    end_step(conn)

    other.commit_store(keys)  # the daemon resolves the parked lookup's future
    answer = manager._answers["pending"].parked.result(timeout=30)
    assert answer.hit_tokens == 28
    assert conn.get_num_new_matched_tokens(req, 0) == (28, True)
    manager.shutdown()


def test_stores_are_batched_and_skip_known_keys(daemon) -> None:  # type: ignore[no-untyped-def]
    from vllm.v1.kv_offload.base import ReqContext

    conn = build_scheduler_connector(plugin_config(daemon.control))
    manager = conn.scheduler.manager
    req = make_request(list(range(300, 330)), "store")
    conn.on_new_request(req)
    ctx = ReqContext(req_id="store")
    k0, k1 = keys_at(req.block_hashes, 3)
    ctx.set_offload_key_position(k0, 16)
    ctx.set_offload_key_position(k1, 16)
    before = manager.client.round_trips
    out = manager.prepare_store([k0, k1], ctx)
    again = manager.prepare_store([k0, k1], ctx)  # same step, already offered
    assert out.keys_to_store == [k0, k1] and again.keys_to_store == []
    assert out.store_spec.slots == [-1, -1]  # filled at the end of the step
    assert manager.client.round_trips == before
    end_step(conn)
    assert manager.client.round_trips == before + 1
    assert sorted(out.store_spec.slots) == sorted(set(out.store_spec.slots)) and min(
        out.store_spec.slots) >= 0
    manager.complete_store([k0, k1], ctx)
    end_step(conn)  # commit
    assert manager.prepare_store([k0, k1], ctx).keys_to_store == []  # known: not offered
    other = connect(daemon.control, manager.geometry)
    from kvoffload.daemon.types import KeyStatus

    assert other.probe([k0, k1]) == [KeyStatus.HIT, KeyStatus.HIT]
    manager.shutdown()


def test_daemon_down_lookups_miss_and_stores_skip(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import ReqContext

    require_vllm()
    with run_daemon(tmp_path) as d:
        conn = build_scheduler_connector(plugin_config(d.control, kvoffload_timeout_ms=200,
                                                       kvoffload_retry_ms=60_000))
        manager = conn.scheduler.manager
        d.kill()
        req = make_request(list(range(30)), "down")
        conn.on_new_request(req)
        assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
        k0, k1 = keys_at(req.block_hashes, 3)
        out = manager.prepare_store([k0, k1], ReqContext(req_id="down"))
        assert out.keys_to_store == []
        assert manager.counters["stores_skipped_offline"] == 2
        assert manager.counters["offline_events"] >= 1
        end_step(conn)
        manager.shutdown()


def test_kvoffload_connector_subclass(daemon) -> None:  # type: ignore[no-untyped-def]
    """The explicit path: no frame inspection needed, same behaviour."""
    from kvoffload.connector.vllm import KVOffloadConnector
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm_harness import build_vllm_config

    vc = build_vllm_config(plugin_config(daemon.control))
    conn = KVOffloadConnector(vc, KVConnectorRole.SCHEDULER, hybrid_kv_cache_config())
    manager = conn.scheduler.manager
    assert manager.requests is not None
    req = make_request(list(range(400, 430)), "subclass")
    store(connect(daemon.control, manager.geometry),
          keys_at(req.block_hashes, 3) + keys_at(req.block_hashes, 6))
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (28, True)
    manager.shutdown()


def test_worker_rank_pages_and_refused_slots(tmp_path: Path) -> None:
    """Each TP rank copies its own page of a slot; a slot of -1 copies nothing."""
    import os
    import uuid

    import torch
    from kvoffload.connector.vllm.worker import DaemonOffloadingWorker, PoolInfo, PoolSlotsSpec
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
    try:
        pool = PoolInfo("d1", path, slots_n * 2 * page, 2 * page, page)
        kv, workers = [], []
        for rank in range(2):
            t = torch.randint(-128, 128, (8, page), dtype=torch.int8)
            canonical = CanonicalKVCaches([CanonicalKVCacheTensor(t, page)],
                                          [[CanonicalKVCacheRef(0, page)],
                                           [CanonicalKVCacheRef(0, page // 2)]])
            kv.append(t)
            workers.append(DaemonOffloadingWorker(canonical, rank, 2, cpu_async=False))
        before = [t.clone() for t in kv]
        for job, w in enumerate(workers):
            src = GPULoadStoreSpec([1, 2, 3], group_sizes=[2, 1], block_indices=[0, 0])
            assert w.submit_store(job, src, PoolSlotsSpec([3, -1, 5], pool))
            (result,) = w.get_finished()
            assert result.success and result.transfer_size == page + page // 2
        raw = torch.from_file(path, shared=False, size=slots_n * 2 * page, dtype=torch.int8)
        for rank in range(2):  # slot 3 holds block 1 of each rank, in that rank's page
            assert torch.equal(raw[3 * 2 * page + rank * page:][:page], before[rank][1])
        for t in kv:
            t.zero_()
        for job, w in enumerate(workers, start=10):
            dst = GPULoadStoreSpec([6, 7], group_sizes=[1, 1], block_indices=[0, 0])
            assert w.submit_load(job, PoolSlotsSpec([3, 5], pool), dst)
            assert [r.success for r in w.get_finished()] == [True]
        for rank in range(2):
            assert torch.equal(kv[rank][6], before[rank][1])
            assert torch.equal(kv[rank][7][: page // 2], before[rank][3][: page // 2])
        # Nothing to copy (every store refused): done at once, nothing moved.
        src = GPULoadStoreSpec([1], group_sizes=[1, 0], block_indices=[0, 0])
        assert workers[0].submit_store(99, src, PoolSlotsSpec([-1], pool))
        assert [(r.job_id, r.success, r.transfer_size) for r in workers[0].get_finished()] == [
            (99, True, 0)]
        for w in workers:
            w.shutdown()
    finally:
        os.unlink(path)


def test_store_items_describe_their_tokens(daemon) -> None:  # type: ignore[no-untyped-def]
    """What PrepareStore tells the daemon (for self-describing events) about each key."""
    from kvoffload.daemon.types import make_key
    from vllm.v1.kv_offload.base import ReqContext

    conn = build_scheduler_connector(plugin_config(daemon.control))
    manager = conn.scheduler.manager
    req = make_request(list(range(500, 530)), "items")
    conn.on_new_request(req)
    conn.get_num_new_matched_tokens(req, 0)  # vLLM records every chunk key's position
    h = req.block_hashes
    chunk, tail = make_key(h[3], 0), make_key(h[6], 1)
    ctx = conn.scheduler._req_status["items"].req_context
    ctx.set_offload_key_position(tail, 28)
    manager.prepare_store([chunk, tail], ctx)
    items = {item.key: item for item, _, _ in manager._store_batch}
    assert items[chunk].token_ids == list(range(500, 516)) and not items[chunk].tail
    assert items[chunk].block_hashes == h[0:4] and items[chunk].parent_hash is None
    assert items[tail].token_ids == list(range(516, 528)) and items[tail].tail
    assert items[tail].end_token == 28 and items[tail].parent_hash == h[3]
    assert items[tail].block_hashes == h[4:7]
    assert isinstance(ctx, ReqContext)
    manager.shutdown()


def test_keep_alive_only_when_idle(daemon) -> None:  # type: ignore[no-untyped-def]
    conn = build_scheduler_connector(plugin_config(daemon.control))
    link = conn.scheduler.manager.link
    before = link.client.round_trips
    link.keep_alive()  # just registered: nothing to do
    assert link.client.round_trips == before
    link._last_call = 0.0  # as if a whole lease went by without a call
    link.keep_alive()
    assert link.client.round_trips == before + 1
    conn.scheduler.manager.shutdown()
