"""daemon/lookup/plan.py: unit tests, properties, and a differential test against vLLM 0.33."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, KeyStatus, make_key
from kvoffload.daemon.lookup.plan import (
    LookupPlan,
    LookupQuery,
    chunk_keys,
    lookup,
    plan_for,
    supports_partial_tail,
    tail_key,
)

from tests.vllm_harness import (
    blocks_for_load,
    build_scheduler_connector,
    full_attention_spec,
    make_kv_cache_config,
    make_request,
    mamba_spec,
    new_kv_cache_manager,
    require_vllm,
    sliding_window_spec,
    tokens_per_hash,
)

HIT, MISS, PENDING, RETRY = KeyStatus.HIT, KeyStatus.MISS, KeyStatus.HIT_PENDING, KeyStatus.RETRY
FULL, MAMBA, SWA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA, GroupKind.SLIDING_WINDOW


def geometry(
    *kinds: GroupKind,
    block: int = 16,
    tph: int = 4,
    bpc: int = 1,
    window: int = 40,
    align: bool = True,
) -> Geometry:
    groups = tuple(
        GroupSpec(
            kind,
            block,
            1024,
            sliding_window_tokens=window if kind is SWA else None,
            mamba_align=align,
        )
        for kind in kinds
    )
    return Geometry("test", groups, tokens_per_hash=tph, blocks_per_chunk=bpc)


HYBRID = geometry(FULL, MAMBA)


def fake_hashes(n: int, salt: int = 0) -> list[bytes]:
    return [f"h{salt}-{i}".encode().ljust(8, b".") for i in range(n)]


def prober(statuses: Mapping[bytes, KeyStatus]) -> tuple[Callable[[bytes], KeyStatus], list]:
    seen: list[bytes] = []

    def probe(key: bytes) -> KeyStatus:
        seen.append(key)
        return statuses.get(key, MISS)

    return probe, seen


def store(hashes: Sequence[bytes], groups: Sequence[int], status: KeyStatus = HIT) -> dict:
    return {make_key(h, g): status for h in hashes for g in groups}


def run(
    geo: Geometry,
    hashes: Sequence[bytes],
    statuses: Mapping,
    n: int,
    local: int = 0,
    prompt: int | None = None,
):
    probe, seen = prober(statuses)
    out = lookup(geo, LookupQuery(hashes, n, n if prompt is None else prompt, local), probe)
    assert out.probes == len(seen)
    return out


# --------------------------------------------------------------------------- worked example


class TestWorkedExample:
    """shared/spec/partial-tail.md: block 16, tph 4, attention + Mamba align, 30 tokens."""

    h = fake_hashes(7)

    def test_every_key_hits_gives_tail_28(self) -> None:
        out = run(HYBRID, self.h, store(self.h, (0, 1)), 30)
        assert (out.hit_tokens, out.chunk_tokens, out.tail_boundary) == (28, 16, 28)
        h = self.h
        assert out.load_keys == [make_key(h[3], 0), make_key(h[6], 0), make_key(h[6], 1)]
        assert out.deferred_keys == []
        # chunk h3@g0, Mamba's last chunk h3@g1, tail at 28 in both groups.
        assert out.probes == 4

    def test_group_one_with_only_h3_gives_16(self) -> None:
        statuses = store(self.h, (0,)) | {make_key(self.h[3], 1): HIT}
        out = run(HYBRID, self.h, statuses, 30)
        assert (out.hit_tokens, out.chunk_tokens, out.tail_boundary) == (16, 16, None)
        assert out.load_keys == [make_key(self.h[3], 0), make_key(self.h[3], 1)]

    def test_missing_highest_tail_falls_back_to_lower_boundary(self) -> None:
        statuses = store(self.h, (0, 1))
        del statuses[make_key(self.h[6], 1)]
        out = run(HYBRID, self.h, statuses, 30)
        assert (out.hit_tokens, out.tail_boundary) == (24, 24)
        assert out.load_keys[-1] == make_key(self.h[5], 1)

    def test_tail_without_complete_chunks_after_local_prefix(self) -> None:
        # 16 tokens on the GPU: the complete-chunk scan has nothing left (the n-1 rule),
        # the tail search still finds 28.
        out = run(HYBRID, self.h, store(self.h, (0, 1)), 30, local=16)
        assert (out.hit_tokens, out.chunk_tokens, out.tail_boundary) == (12, 0, 28)
        assert out.load_keys == [make_key(self.h[6], 0), make_key(self.h[6], 1)]


# --------------------------------------------------------------------------- deferral rules


class TestDeferral:
    h = fake_hashes(16)

    def test_pending_chunk_defers_and_is_reported(self) -> None:
        statuses = store(self.h, (0, 1)) | {make_key(self.h[3], 0): PENDING}
        out = run(HYBRID, self.h, statuses, 64)
        assert out.hit_tokens is None and out.deferred
        assert out.deferred_keys == [make_key(self.h[3], 0)]
        assert out.load_keys == []

    def test_retry_keeps_scanning_so_every_slow_key_is_asked(self) -> None:
        geo = geometry(FULL, block=16, tph=16)
        h = self.h[:6]
        statuses = store(h, (0,)) | {make_key(h[1], 0): RETRY, make_key(h[3], 0): RETRY}
        out = run(geo, h, statuses, 96)
        assert out.hit_tokens is None
        assert out.deferred_keys == [make_key(h[1], 0), make_key(h[3], 0)]
        assert out.probes == 6

    def test_miss_before_pending_means_no_deferral(self) -> None:
        geo = geometry(FULL, block=16, tph=16)
        h = self.h[:4]
        statuses = {make_key(h[0], 0): HIT, make_key(h[2], 0): PENDING}
        out = run(geo, h, statuses, 64)
        assert (out.hit_tokens, out.deferred_keys) == (16, [])

    def test_pending_tail_defers_only_without_complete_hit(self) -> None:
        h = fake_hashes(7)
        statuses = store(h, (0, 1)) | {make_key(h[6], 1): PENDING}
        # local 16: complete hit 0 -> deferred on the pending tail, even though 24 hits.
        out = run(HYBRID, h, statuses, 30, local=16)
        assert out.hit_tokens == 8 and out.tail_boundary == 24
        statuses = {k: v for k, v in statuses.items() if k[:-4] not in (h[4], h[5])}
        out = run(HYBRID, h, statuses, 30, local=16)
        assert out.hit_tokens is None
        assert out.deferred_keys == [make_key(h[6], 1)]
        # With a complete hit the pending tail is ignored: the complete hit is served.
        out = run(HYBRID, h, statuses, 30)
        assert (out.hit_tokens, out.tail_boundary, out.deferred_keys) == (16, None, [])

    def test_mamba_pending_state_defers(self) -> None:
        statuses = store(self.h, (0, 1)) | {make_key(self.h[11], 1): PENDING}
        out = run(HYBRID, self.h, statuses, 50)  # Mamba state at 48 is the one to load
        assert out.hit_tokens is None
        assert out.deferred_keys == [make_key(self.h[11], 1)]


# --------------------------------------------------------------------------- rules


class TestRules:
    def test_attention_only_loads_every_chunk_and_keeps_no_token(self) -> None:
        geo = geometry(FULL, block=16, tph=16)
        h = fake_hashes(4)
        out = run(geo, h, store(h, (0,)), 64)
        # Full attention alone may load the whole request (vLLM recomputes nothing here).
        assert out.hit_tokens == 64
        assert out.load_keys == [make_key(x, 0) for x in h]

    def test_full_attention_prefix_stops_at_first_miss(self) -> None:
        geo = geometry(FULL, block=16, tph=16)
        h = fake_hashes(4)
        statuses = store(h, (0,))
        del statuses[make_key(h[1], 0)]
        out = run(geo, h, statuses, 64)
        assert out.hit_tokens == 16 and out.probes == 2

    def test_mamba_needs_state_at_the_boundary(self) -> None:
        h = fake_hashes(16)
        # Attention everywhere, Mamba only at 32: the hit is 32 (align to 16, n - 1 cap).
        statuses = store(h, (0,)) | {make_key(h[7], 1): HIT}
        out = run(HYBRID, h, statuses, 64)
        assert (out.hit_tokens, out.tail_boundary) == (32, None)
        assert out.load_keys == [make_key(h[3], 0), make_key(h[7], 0), make_key(h[7], 1)]

    def test_local_prefix_shifts_the_load(self) -> None:
        h = fake_hashes(16)
        out = run(HYBRID, h, store(h, (0, 1)), 64, local=32)
        # n - 1 = 63 rounds down to 48; the tail search then finds 60.
        assert (out.chunk_tokens, out.hit_tokens, out.tail_boundary) == (16, 28, 60)
        assert out.load_keys == [make_key(h[11], 0), make_key(h[14], 0), make_key(h[14], 1)]

    def test_blocks_per_chunk_two(self) -> None:
        geo = geometry(FULL, MAMBA, bpc=2)
        assert not supports_partial_tail(geo)
        h = fake_hashes(24)
        out = run(geo, h, store(h, (0, 1)), 96)
        # align = 32 tokens: 95 -> 64; keys are every 8th hash; Mamba loads its last chunk.
        assert (out.hit_tokens, out.tail_boundary) == (64, None)
        assert out.load_keys == [make_key(h[7], 0), make_key(h[15], 0), make_key(h[15], 1)]

    def test_sliding_window_loads_only_the_window(self) -> None:
        geo = geometry(FULL, SWA, window=20)
        h = fake_hashes(24)
        out = run(geo, h, store(h, (0, 1)), 96)
        # Without a Mamba align group the n - 1 cap is not rounded: the hit ends inside
        # the last chunk (vLLM loads that chunk whole and recomputes token 95).
        assert out.hit_tokens == 95
        # Attention loads all 6 chunks; the window (tokens 76..94) only blocks 4 and 5.
        assert out.load_keys == [make_key(h[i], 0) for i in (3, 7, 11, 15, 19, 23)] + [
            make_key(h[19], 1),
            make_key(h[23], 1),
        ]

    def test_sliding_window_gap_limits_the_hit(self) -> None:
        geo = geometry(FULL, SWA, window=20)
        h = fake_hashes(24)
        statuses = store(h, (0, 1))
        del statuses[make_key(h[19], 1)]  # block 4 of the window group
        out = run(geo, h, statuses, 96)
        # Scanning from the right: block 5 alone is too short a run, blocks 2..3 are not.
        assert out.hit_tokens == 64
        assert out.load_keys[-2:] == [make_key(h[11], 1), make_key(h[15], 1)]

    def test_not_enough_hashes_is_an_error(self) -> None:
        with pytest.raises(ValueError, match="cannot cover"):
            lookup(HYBRID, LookupQuery(fake_hashes(3), 30, 30, 0), lambda k: HIT)


class TestPartialTailSupport:
    @pytest.mark.parametrize(
        ("geo", "expected"),
        [
            (geometry(FULL, MAMBA), True),
            (geometry(MAMBA, FULL, MAMBA), True),
            (geometry(FULL, MAMBA, bpc=2), False),
            (geometry(FULL, MAMBA, SWA), False),
            (geometry(FULL, MAMBA, align=False), False),
            (geometry(FULL, MAMBA, block=4, tph=4), False),
            (geometry(FULL), False),
            (
                Geometry(
                    "x",
                    (GroupSpec(FULL, 32, 1), GroupSpec(MAMBA, 16, 1)),
                    tokens_per_hash=4,
                ),
                False,
            ),
        ],
    )
    def test_rule(self, geo: Geometry, expected: bool) -> None:
        assert supports_partial_tail(geo) is expected
        assert plan_for(geo).supports_partial_tail is expected

    def test_no_tail_lookup_when_unsupported(self) -> None:
        geo = geometry(FULL, MAMBA, SWA, window=16)
        h = fake_hashes(7)
        out = run(geo, h, store(h, (0, 1, 2)), 30)
        assert (out.hit_tokens, out.tail_boundary) == (16, None)


class TestKeys:
    def test_chunk_and_tail_keys(self) -> None:
        h = fake_hashes(13)
        assert chunk_keys(HYBRID, h, 1) == [
            make_key(h[3], 1),
            make_key(h[7], 1),
            make_key(h[11], 1),
        ]
        assert tail_key(HYBRID, h, 0, 28) == make_key(h[6], 0)
        with pytest.raises(ValueError):
            tail_key(HYBRID, h, 0, 30)

    def test_bad_geometry(self) -> None:
        with pytest.raises(ValueError, match="multiple"):
            LookupPlan(geometry(FULL, block=18, tph=4))
        with pytest.raises(ValueError, match="sliding_window_tokens"):
            LookupPlan(Geometry("x", (GroupSpec(SWA, 16, 1),), tokens_per_hash=4))

    def test_plan_is_cached_per_geometry(self) -> None:
        assert plan_for(geometry(FULL, MAMBA)) is plan_for(geometry(FULL, MAMBA))


# --------------------------------------------------------------------------- performance


QWEN36 = Geometry(
    "qwen3.6-27b",
    (
        GroupSpec(FULL, 784, 1),
        GroupSpec(MAMBA, 784, 1),
        GroupSpec(MAMBA, 784, 1),
        GroupSpec(MAMBA, 784, 1),
    ),
    tokens_per_hash=16,
)


def test_qwen36_32k_prompt_probes_few_keys() -> None:
    n = 32_000
    h = fake_hashes(n // 16)
    statuses = store(h, range(4))
    out = run(QWEN36, h, statuses, n)
    # 40 chunks x 1 prefix scan + 3 Mamba states + 4 keys of the top tail boundary.
    assert out.chunk_tokens == 31_360 and out.tail_boundary == 31_984
    assert out.probes == 40 + 3 + 4
    assert len(out.load_keys) == 40 + 1 + 3  # chunks + tail for attention, tail per Mamba
    probe = statuses.get
    query = LookupQuery(h, n, n, 0)
    start = time.perf_counter()
    for _ in range(200):
        lookup(QWEN36, query, lambda k: probe(k, MISS))
    per_call = (time.perf_counter() - start) / 200
    assert per_call < 0.005, f"{per_call * 1e6:.0f} us per 32k lookup"


# --------------------------------------------------------------------------- properties


@st.composite
def scenarios(draw: Any) -> tuple[Geometry, list[bytes], dict, int, int, int]:
    kinds = draw(st.sampled_from([(FULL, MAMBA), (FULL,), (MAMBA, FULL, MAMBA), (FULL, SWA)]))
    tph = draw(st.sampled_from([4, 8]))
    geo = geometry(*kinds, tph=tph, window=24)
    prompt = draw(st.integers(1, 90))
    extra = draw(st.integers(0, 10))
    n = prompt + extra
    h = fake_hashes(n // tph)
    statuses = {}
    for g in range(len(kinds)):
        for x in h:
            statuses[make_key(x, g)] = draw(
                st.sampled_from([HIT, HIT, HIT, HIT, MISS, PENDING, RETRY])
            )
    local = draw(st.integers(0, max(0, n - 1))) // 16 * 16
    return geo, h, statuses, n, prompt, local


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_properties(scenario: tuple[Geometry, list[bytes], dict, int, int, int]) -> None:
    geo, h, statuses, n, prompt, local = scenario
    out = run(geo, h, statuses, n, local=local, prompt=prompt)
    if out.hit_tokens is None:
        assert out.deferred_keys
        assert all(statuses.get(k) in (PENDING, RETRY) for k in out.deferred_keys)
        assert out.load_keys == []
        return
    assert out.deferred_keys == []
    # Only ready keys are ever loaded.
    assert all(statuses.get(k) is HIT for k in out.load_keys)
    assert len(set(out.load_keys)) == len(out.load_keys)
    end = local + out.hit_tokens
    assert end <= n
    if any(g.kind is not FULL for g in geo.groups):
        assert out.hit_tokens == 0 or end <= n - 1
    if out.tail_boundary is not None:
        assert end == out.tail_boundary <= prompt - 1
        assert out.tail_boundary % geo.tokens_per_hash == 0
    else:
        assert out.hit_tokens == out.chunk_tokens
    if out.hit_tokens == 0:
        assert out.load_keys == []
    # Deterministic probes give deterministic answers.
    assert run(geo, h, statuses, n, local=local, prompt=prompt) == out


# --------------------------------------------------------------------------- vs vLLM


@dataclass(frozen=True)
class Setup:
    name: str
    kinds: tuple[GroupKind, ...]
    prefix_match_unit: int | None
    blocks_per_chunk: int = 1
    window: int = 40


SETUPS = [
    Setup("hybrid", (FULL, MAMBA), 4),
    Setup("attention", (FULL,), None),
    Setup("mamba_first", (MAMBA, FULL, MAMBA), 4),
    Setup("hybrid_bpc2", (FULL, MAMBA), 4, blocks_per_chunk=2),
    Setup("swa", (FULL, SWA), 4, window=40),
    Setup("swa_mamba", (FULL, SWA, MAMBA), 8, window=24),
]
TRIALS = 1000


def _vllm_specs(setup: Setup) -> list[Any]:
    out: list[Any] = []  # vLLM's KVCacheSpec subclasses (vLLM is imported lazily)
    for kind in setup.kinds:
        if kind is FULL:
            out.append(full_attention_spec(16))
        elif kind is MAMBA:
            out.append(mamba_spec(16))
        else:
            out.append(sliding_window_spec(16, setup.window))
    return out


def _random_statuses(rng: random.Random, hashes: Sequence[bytes], groups: int) -> dict:
    """Mostly-stored prefixes with holes, sparse stored tails, sometimes slow keys."""
    noisy = rng.random() < 0.5
    statuses: dict[bytes, KeyStatus] = {}
    for g in range(groups):
        depth = rng.randint(0, len(hashes))
        for i, x in enumerate(hashes):
            p_hit = 0.92 if i < depth else 0.15
            r = rng.random()
            if noisy and r < 0.08:
                status = PENDING if rng.random() < 0.5 else RETRY
            else:
                status = HIT if rng.random() < p_hit else MISS
            statuses[make_key(x, g)] = status
    return statuses


@pytest.mark.vllm
@pytest.mark.parametrize("setup", SETUPS, ids=[s.name for s in SETUPS])
def test_matches_vllm_scheduler(setup: Setup) -> None:
    require_vllm()
    import tests.lookup_vllm_harness as harness

    extra: dict[str, Any] = {
        "spec_name": "DictOffloadingSpec",
        "spec_module_path": harness.__name__,
    }
    if setup.blocks_per_chunk != 1:
        extra["blocks_per_chunk"] = setup.blocks_per_chunk
    kv_cache_config = make_kv_cache_config(_vllm_specs(setup), num_blocks=4096)
    conn = build_scheduler_connector(
        extra, kv_cache_config, block_size=16, prefix_match_unit=setup.prefix_match_unit
    )
    tph = tokens_per_hash(conn)
    sched = conn.scheduler
    assert sched.config.blocks_per_chunk == setup.blocks_per_chunk
    geo = geometry(*setup.kinds, tph=tph, bpc=setup.blocks_per_chunk, window=setup.window)
    assert supports_partial_tail(geo) == sched.config.supports_partial_tail
    manager = sched.manager
    assert isinstance(manager, harness.DictOffloadingManager)
    km = new_kv_cache_manager(kv_cache_config, 16, tph)

    rng = random.Random(f"lookup-{setup.name}")
    seen = {"hit": 0, "tail": 0, "deferred": 0, "loads": 0, "bridge": 0, "rescan": 0}
    for trial in range(TRIALS):
        prompt = rng.randint(1, 9 * 16 * setup.blocks_per_chunk)
        req = make_request(
            [rng.randrange(50_000) for _ in range(prompt)],
            f"{setup.name}-{trial}",
            hash_block_size=tph,
        )
        if rng.random() < 0.15:  # a preempted request that already generated tokens
            req.append_output_token_ids([rng.randrange(50_000) for _ in range(rng.randint(1, 40))])
        hashes = list(req.block_hashes)
        statuses = _random_statuses(rng, hashes, len(setup.kinds))
        r = rng.random()
        if r < 0.45:
            local = 0
        elif r < 0.85:
            local = rng.randrange(0, req.num_tokens) // 16 * 16
        else:  # unaligned local prefix: lookup only (vLLM asserts alignment at load)
            local = rng.randrange(0, req.num_tokens) // tph * tph

        manager.set_statuses(statuses)
        manager.reset_calls()
        # The scheduler's "already being loaded" delay is scheduler-local; start clean.
        if sched._chunks_being_loaded is not None:
            sched._chunks_being_loaded.clear()
        conn.on_new_request(req)
        vllm_hit, _ = conn.get_num_new_matched_tokens(req, local)

        query = LookupQuery(hashes, req.num_tokens, req.num_prompt_tokens, local)
        probe, probed = prober(statuses)
        out = lookup(geo, query, probe)
        context = f"{setup.name} trial {trial}: n={req.num_tokens} local={local}"
        assert out.hit_tokens == vllm_hit, context
        # Same keys asked, in the same order: the plugin can answer vLLM from our batch.
        assert probed == manager.lookups, context

        seen["hit"] += bool(vllm_hit)
        seen["tail"] += out.tail_boundary is not None
        seen["deferred"] += vllm_hit is None
        # A tail past the first block edge above the complete hit also loads that block.
        seen["bridge"] += (
            out.tail_boundary is not None
            and out.tail_boundary >= ((local + out.chunk_tokens) // 16 + 1) * 16
        )
        seen["rescan"] += len(set(probed)) < len(probed)  # convergence loop asked again
        if vllm_hit and local % 16 == 0:
            blocks = blocks_for_load(km, req, local, vllm_hit)
            conn.update_state_after_alloc(req, blocks, vllm_hit)
            assert manager.loads == [out.load_keys], context
            seen["loads"] += 1
            if local == 0:
                km.free(req)
        sched._req_status.pop(req.request_id, None)
        sched._release_step()
    # The random cases must have exercised every path.
    assert seen["hit"] > TRIALS // 5 and seen["deferred"] > 20 and seen["loads"] > 100, seen
    if sched.config.supports_partial_tail:
        assert seen["tail"] > 100 and seen["bridge"] > 0, seen
    if len(setup.kinds) > 2:
        assert seen["rescan"] > 0, seen
