"""vLLM 0.33's own scheduler over our plugin + a live daemon versus vLLM's scheduler over a
manager that holds the same key set in a dict: equal hits and equal load keys, over random
prompts and key sets, in every configuration the engine-path issue lists (attention only,
hybrid align, sliding window, chunked local attention, an EAGLE/MTP draft group inside the
attention group and as its own group, ``max_load_tokens``, ``extra_retained_tokens``, group
ids that are not 0..n-1).

Our answers come from the shared index the daemon publishes (no daemon-side plan is
involved), so vLLM's scan runs over true per-key states; the reference is vLLM's own scan
over a dict. Keys are stored in the daemon through the control protocol of another client,
exactly as another engine on the node would store them.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.daemon_helpers import DaemonHandle, run_daemon  # noqa: E402
from tests.plugin_common import connect, end_step, plugin_config  # noqa: E402
from tests.vllm_harness import (  # noqa: E402
    blocks_for_load,
    build_scheduler_connector,
    daemon_manager,
    full_attention_spec,
    make_request,
    mamba_spec,
    manager_of,
    new_kv_cache_manager,
    sliding_window_spec,
    tokens_per_hash,
    vllm_import_error,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]

TRIALS = 130  # per setup: 9 setups, > 1,000 cases


@dataclass(frozen=True)
class Setup:
    name: str
    groups: tuple[str, ...]  # full, mamba, swa, chunked, swa_retained, uncached
    unit: int | None = 4
    eagle: tuple[int, ...] = ()  # group indices flagged is_eagle_group
    max_load: bool = False  # requests carry kv_transfer_params max_load_tokens


SETUPS = [
    Setup("attention", ("full",), unit=None),
    Setup("hybrid", ("full", "mamba")),
    Setup("swa", ("full", "swa")),
    Setup("chunked_local", ("full", "chunked")),
    Setup("eagle_in_attention", ("full", "mamba"), eagle=(0,)),
    Setup("eagle_own_group", ("full", "mamba", "full"), eagle=(2,)),
    Setup("max_load_tokens", ("full", "mamba"), max_load=True),
    Setup("extra_retained", ("full", "swa_retained")),
    Setup("group_ids_not_dense", ("uncached", "full", "mamba")),
]


def _spec(kind: str) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec

    if kind == "full":
        return full_attention_spec(16)
    if kind == "mamba":
        return mamba_spec(16)
    if kind == "swa":
        return sliding_window_spec(16, 40)
    if kind == "swa_retained":
        return dataclasses.replace(sliding_window_spec(16, 40), extra_retained_tokens=20)
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=1, head_size=8,
                                         dtype=torch.float16, attention_chunk_size=48)

    @dataclass(frozen=True, kw_only=True)
    class UncachedAttentionSpec(FullAttentionSpec):
        """A group vLLM does not offload (not prefix-cacheable): later groups keep ids 1, 2."""

        @property
        def prefix_cacheable(self) -> bool:
            return False

    assert kind == "uncached"
    return UncachedAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)


def _kv_cache_config(setup: Setup) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=4096, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"layer{i}"], _spec(kind), is_eagle_group=i in setup.eagle)
        for i, kind in enumerate(setup.groups)])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    with run_daemon(tmp_path_factory.mktemp("equiv"), pool_bytes=256 << 20,
                    slot_bytes=4096) as d:
        yield d


def _statuses(rng: random.Random, keys_by_group: list[list[bytes]]) -> dict[bytes, str]:
    """Mostly-stored prefixes with holes, sparse deeper keys, sometimes keys being written."""
    out: dict[bytes, str] = {}
    for keys in keys_by_group:
        depth = rng.randint(0, len(keys))
        for i, key in enumerate(keys):
            r = rng.random()
            if r < 0.05:
                out[key] = "pending"
            elif r < (0.92 if i < depth else 0.2):
                out[key] = "hit"
    return out


@pytest.mark.parametrize("setup", SETUPS, ids=[s.name for s in SETUPS])
def test_hits_and_loads_equal_vllm_over_the_same_keys(daemon: DaemonHandle, setup: Setup) -> None:
    from kvoffload.connector.vllm import KVOffloadConnector
    from kvoffload.daemon.control import protocol as p
    from vllm.v1.kv_offload.base import LookupResult, make_offload_key

    import tests.lookup_vllm_harness as harness

    kv_cache_config = _kv_cache_config(setup)
    ours = build_scheduler_connector(
        plugin_config(daemon.control, kvoffload_namespace=setup.name), kv_cache_config,
        prefix_match_unit=setup.unit, connector_class=KVOffloadConnector)
    ref = build_scheduler_connector(
        {"spec_name": "DictOffloadingSpec", "spec_module_path": harness.__name__},
        kv_cache_config, prefix_match_unit=setup.unit)
    tph = tokens_per_hash(ours)
    manager, reference = daemon_manager(ours), manager_of(ref, harness.DictOffloadingManager)
    group_ids = [g.group_idx for g in ours.scheduler.config.kv_group_configs]
    assert group_ids == [g.group_idx for g in ref.scheduler.config.kv_group_configs]
    if setup.name == "group_ids_not_dense":
        assert group_ids == [1, 2] and manager.geometry.group_ids == (1, 2)
    if setup.eagle:
        assert any(g.is_eagle_group for g in ours.scheduler.config.kv_group_configs)
    writer = connect(daemon.control, manager.geometry)
    km_ours = new_kv_cache_manager(kv_cache_config, 16, tph)
    km_ref = new_kv_cache_manager(kv_cache_config, 16, tph)
    rng = random.Random(f"equiv-{setup.name}")
    seen = {"hit": 0, "deferred": 0, "loads": 0, "tail": 0, "capped": 0}
    for trial in range(TRIALS):
        prompt = rng.randint(1, 9 * 16)
        tokens = [rng.randrange(50_000) for _ in range(prompt)]
        params = ({"max_load_tokens": rng.choice([0, 4, 8, 16, 20, 32, 100])}
                  if setup.max_load else None)
        rid = f"{setup.name}-{trial}"
        reqs = [make_request(tokens, rid, hash_block_size=tph, kv_transfer_params=params)
                for _ in range(2)]
        hashes = list(reqs[0].block_hashes)
        statuses = _statuses(rng, [[make_offload_key(h, g) for h in hashes] for g in group_ids])
        ready = [k for k, s in statuses.items() if s == "hit"]
        pending = [k for k, s in statuses.items() if s == "pending"]
        slots: dict[bytes, int] = {}
        for keys, commit in ((ready, True), (pending, False)):
            if keys:
                grant = writer.prepare_store([p.StoreItem(key=k, end_token=0) for k in keys])
                assert all(o == p.StoreOutcome.GRANTED for o in grant.outcomes), grant
                slots.update(zip(keys, grant.slots, strict=True))
                if commit:
                    writer.commit_store(keys)
        reference.statuses = {k: LookupResult.HIT if s == "hit" else LookupResult.HIT_PENDING
                              for k, s in statuses.items()}
        reference.reset_calls()
        local = 0 if rng.random() < 0.6 else rng.randrange(0, prompt) // 16 * 16
        results = []
        for conn, req in ((ours, reqs[0]), (ref, reqs[1])):
            conn.on_new_request(req)
            results.append(conn.get_num_new_matched_tokens(req, local))
        context = f"{setup.name} trial {trial}: {prompt} tokens, local {local}"
        assert results[0] == results[1], context
        hit = results[0][0]
        seen["hit"] += bool(hit)
        seen["deferred"] += hit is None
        seen["tail"] += bool(hit and (local + hit) % 16 != 0)
        seen["capped"] += bool(params and hit and hit == params["max_load_tokens"])
        if hit and local == 0:
            for conn, req, km in ((ours, reqs[0], km_ours), (ref, reqs[1], km_ref)):
                conn.update_state_after_alloc(req, blocks_for_load(km, req, 0, hit), hit)
                km.free(req)
            refs = manager._loads[rid]
            assert [r.key for r in refs] == reference.loads[-1], context
            assert all(slots[r.key] == r.slot for r in refs), context  # the daemon's slots
            seen["loads"] += 1
        for conn in (ours, ref):
            conn.scheduler._req_status.pop(rid, None)
            end_step(conn)
    # The random cases must have exercised every path.
    assert seen["hit"] > TRIALS // 5 and seen["deferred"] > 3 and seen["loads"] > 10, seen
    if ours.scheduler.config.supports_partial_tail:
        assert seen["tail"] > 5, seen
    if setup.max_load:
        assert seen["capped"] > 3, seen
    manager.shutdown()
    writer.close()
