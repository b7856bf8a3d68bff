"""``PoolSlotsSpec`` as vLLM ships it to every worker: pickled once per step, unpickled per rank."""

from __future__ import annotations

import pickle

import pytest

from tests.vllm_harness import vllm_import_error

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]

POOL = ("d-5f3a", "/dev/shm/kvoffload-pool-5f3a", 1 << 33, 4 << 20, 1 << 20,
        "/dev/shm/kvoffload-index-5f3a")


def test_a_spec_survives_pickling_whole() -> None:
    from kvoffload.connector.vllm.load_spec import PoolInfo, PoolSlotsSpec
    from vllm.v1.kv_offload.base import LoadStoreSpec

    info = PoolInfo(*POOL)
    for spec in (PoolSlotsSpec([7, -1, 12], info, [3, 0, 9], "req-1"),
                 PoolSlotsSpec([4], info),  # a store: generations default to 0, no request
                 PoolSlotsSpec([], None)):  # the empty store of an offline step
        back = pickle.loads(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
        assert isinstance(back, PoolSlotsSpec) and isinstance(back, LoadStoreSpec)
        assert (back.slots, back.gens, back.req_id) == (spec.slots, spec.gens, spec.req_id)
        assert back.pool == spec.pool
    # The pool as the worker reads it, field by field (a frozen, hashable value).
    back_info = pickle.loads(pickle.dumps(info))
    assert back_info == info and hash(back_info) == hash(info)
    assert (back_info.daemon_id, back_info.pool_path, back_info.pool_bytes, back_info.slot_bytes,
            back_info.rank_bytes, back_info.index_path) == POOL


def test_the_pickle_carries_values_not_attribute_names() -> None:
    from kvoffload.connector.vllm.load_spec import PoolInfo, PoolSlotsSpec

    data = pickle.dumps(PoolSlotsSpec([7, 8], PoolInfo(*POOL), [1, 1], "req-2"), protocol=5)
    for name in (b"slots", b"gens", b"req_id", b"daemon_id", b"pool_path", b"index_path"):
        assert name not in data
    assert b"req-2" in data and POOL[1].encode() in data


def test_specs_of_one_step_share_one_pool_record() -> None:
    """vLLM pickles the step's metadata as one object: the pool's paths go in once."""
    from kvoffload.connector.vllm.load_spec import PoolInfo, PoolSlotsSpec

    info = PoolInfo(*POOL)
    jobs = {i: PoolSlotsSpec([i], info, [1]) for i in range(8)}
    data = pickle.dumps(jobs, protocol=5)
    assert data.count(POOL[1].encode()) == 1
    back = pickle.loads(data)
    assert all(back[i].pool is back[0].pool for i in range(8))
