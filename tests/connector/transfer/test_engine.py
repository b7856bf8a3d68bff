"""BlockCopier on CPU: real bytes through a real shared-memory pool file."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import tempfile
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kvoffload.connector.transfer import pool_map
from kvoffload.connector.transfer.engine import (
    BlockCopier,
    CopyResult,
    GeometryError,
    KVLayout,
    PoolMapping,
    group_bytes_per_block,
    items_for_groups,
    layout_from_canonical,
)
from kvoffload.connector.transfer.layout import block_runs
from kvoffload.connector.transfer.plan import SegmentWork
from prometheus_client import CollectorRegistry

NUM_BLOCKS = 128
PAGE = 1024
MAMBA_REAL = 160  # un-padded Mamba state bytes inside an attention-sized page
SLOT_BYTES = 8192
NUM_SLOTS = 48
SENTINEL = 0x5A


def make_layout(seed: int) -> KVLayout:
    """A hybrid-shaped layout: group 0 (attention) and group 1 (Mamba) alias tensors 0 and 1,
    as vLLM overlays cache groups; tensor 2 has strided rows (a packed layout's view) and
    contributes a whole page to group 0 and an inner sub-range to group 1."""
    gen = torch.Generator().manual_seed(seed)
    t0 = torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen)
    t1 = torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen)
    packed = torch.randint(-128, 128, (NUM_BLOCKS, 768), dtype=torch.int8, generator=gen)
    t2 = packed[:, :512]
    groups = [
        [(0, 0, PAGE), (1, 0, PAGE), (2, 0, 512)],
        [(1, 0, MAMBA_REAL), (0, 0, MAMBA_REAL), (2, 100, 200)],
    ]
    return KVLayout([t0, t1, t2], groups)


def zeros_like_layout(layout: KVLayout) -> KVLayout:
    """Another engine with the same structure and empty KV."""
    ranges = [[(r.tensor_idx, r.offset, r.nbytes) for r in g.regions] for g in layout.groups]
    return KVLayout([torch.zeros_like(t) for t in layout.tensors], ranges)


def block_bytes(layout: KVLayout, group: int, block: int) -> torch.Tensor:
    """Reference for the slot layout: the group's regions of one block, concatenated."""
    parts = [
        layout.tensors[r.tensor_idx][block, r.offset : r.offset + r.nbytes]
        for r in layout.groups[group].regions
    ]
    return torch.cat(parts)


@contextlib.contextmanager
def sentinel_file(size: int) -> Iterator[str]:
    """A pool file as the daemon would leave it, every byte SENTINEL."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="kvoffload-test-pool-", dir=folder)
    try:
        os.write(fd, bytes([SENTINEL]) * size)
        os.close(fd)
        yield path
    finally:
        os.unlink(path)


@pytest.fixture
def pool_file() -> Iterator[str]:
    with sentinel_file(SLOT_BYTES * NUM_SLOTS) as path:
        yield path


@pytest.fixture
def mapping(pool_file: str) -> Iterator[PoolMapping]:
    m = PoolMapping(pool_file, SLOT_BYTES * NUM_SLOTS, registry=CollectorRegistry())
    yield m
    m.close()


def run_job(
    copier: BlockCopier, job_id: int, store: bool, items: Any
) -> CopyResult:
    submit = copier.submit_store if store else copier.submit_load
    submit(job_id, items)
    copier.wait([job_id])
    results = copier.get_finished()
    assert [r.job_id for r in results] == [job_id]
    return results[0]


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=30))
def test_block_runs_cover_items_exactly(pairs: list[tuple[int, int]]) -> None:
    blocks = np.array([b for b, _ in pairs], dtype=np.int64)
    slots = np.array([s for _, s in pairs], dtype=np.int64)
    runs = block_runs(blocks, slots)
    expanded = sorted((b0 + i, s0 + i) for b0, s0, n in runs for i in range(n))
    assert expanded == sorted(pairs)


def test_layout_groups_and_bytes() -> None:
    layout = make_layout(0)
    assert layout.bytes_per_block() == (2 * PAGE + 512, 2 * MAMBA_REAL + 200)
    # Regions are in (tensor, offset) order whatever the order they were given in.
    assert [(r.tensor_idx, r.page_offset) for r in layout.groups[1].regions] == [
        (0, 0),
        (1, MAMBA_REAL),
        (2, 2 * MAMBA_REAL),
    ]


@pytest.mark.parametrize("cpu_async", [True, False])
def test_store_load_every_group(mapping: PoolMapping, cpu_async: bool) -> None:
    src = make_layout(1)
    dst = zeros_like_layout(src)
    store_items = [
        (0, 3, 10), (0, 4, 11), (0, 5, 12),  # a run: consecutive blocks into consecutive slots
        (0, 9, 2), (0, 70, 40),
        (1, 20, 0), (1, 21, 30), (1, 127, 47),
    ]  # fmt: skip
    with BlockCopier(mapping, src, 0, 1, SLOT_BYTES, cpu_async=cpu_async) as w:
        res = run_job(w, 1, True, store_items)
    assert (
        res.ok
        and res.nbytes == 5 * src.groups[0].bytes_per_block + 3 * src.groups[1].bytes_per_block
    )
    pool = mapping.slot_view(SLOT_BYTES)
    for g, b, s in store_items:
        n = src.groups[g].bytes_per_block
        assert torch.equal(pool[s, :n], block_bytes(src, g, b))
        assert bool((pool[s, n:] == SENTINEL).all())  # nothing written past the block
    untouched = sorted(set(range(NUM_SLOTS)) - {s for _, _, s in store_items})
    assert bool((pool[untouched] == SENTINEL).all())

    # Another engine loads the same slots into other block ids.
    load_items = [(g, (b + 40) % NUM_BLOCKS, s) for g, b, s in store_items]
    with BlockCopier(mapping, dst, 0, 1, SLOT_BYTES, cpu_async=cpu_async) as r:
        res = run_job(r, 2, False, load_items)
    assert res.ok and res.nbytes > 0
    for (g, b, _), (_, b2, _) in zip(store_items, load_items, strict=True):
        assert torch.equal(block_bytes(dst, g, b2), block_bytes(src, g, b))
    loaded = {b2 for _, b2, _ in load_items}
    for t in dst.tensors:
        others = [b for b in range(NUM_BLOCKS) if b not in loaded]
        assert not bool(t[others].any())  # no stray writes into other blocks
    # Padding and bytes outside every region of a loaded Mamba block stay untouched.
    assert not bool(dst.tensors[0][(20 + 40) % NUM_BLOCKS, MAMBA_REAL:].any())


def test_tp2_rank_pages(pool_file: str) -> None:
    size = SLOT_BYTES * NUM_SLOTS
    reg = CollectorRegistry()
    # Each rank process maps the file itself.
    m0, m1 = PoolMapping(pool_file, size, registry=reg), PoolMapping(pool_file, size, registry=reg)
    rank_bytes = SLOT_BYTES // 2
    ranks = [make_layout(10), make_layout(11)]
    items = [(0, 7, 5), (0, 8, 6), (1, 50, 7), (1, 51, 20), (0, 100, 33)]
    w0 = BlockCopier(m0, ranks[0], 0, 2, SLOT_BYTES)
    w1 = BlockCopier(m1, ranks[1], 1, 2, SLOT_BYTES)
    pool = m0.slot_view(SLOT_BYTES)
    assert run_job(w0, 1, True, items).ok
    # Rank 0 alone: rank 1's half of every slot is still untouched.
    assert bool((pool[:, rank_bytes:] == SENTINEL).all())
    assert run_job(w1, 1, True, items).ok
    for g, b, s in items:
        n = ranks[0].groups[g].bytes_per_block
        assert torch.equal(pool[s, :n], block_bytes(ranks[0], g, b))
        assert torch.equal(pool[s, rank_bytes : rank_bytes + n], block_bytes(ranks[1], g, b))
        assert not torch.equal(pool[s, :n], pool[s, rank_bytes : rank_bytes + n])
    w0.close()
    w1.close()

    loaded = [zeros_like_layout(x) for x in ranks]
    load_items = [(g, b + 1, s) for g, b, s in items]
    for rank, (mp, layout) in enumerate(zip((m0, m1), loaded, strict=True)):
        with BlockCopier(mp, layout, rank, 2, SLOT_BYTES) as r:
            assert run_job(r, 9, False, load_items).ok
    for rank in range(2):
        for (g, b, _), (_, b2, _) in zip(items, load_items, strict=True):
            assert torch.equal(block_bytes(loaded[rank], g, b2), block_bytes(ranks[rank], g, b))
    m0.close()
    m1.close()


def test_partial_tail_worked_example(mapping: PoolMapping) -> None:
    """spec/partial-tail.md: block 16, unit 4, 30-token prompt, tail at 28."""
    src = make_layout(2)
    # Make the live Mamba block 21 differ from its copy-on-write snapshot 99 in every byte.
    for region in src.groups[1].regions:
        t = src.tensors[region.tensor_idx]
        t[21, region.offset : region.offset + region.nbytes] = ~t[
            99, region.offset : region.offset + region.nbytes]
    slot = {"h3@g0": 4, "h6@g0": 17, "h6@g1": 18}
    with BlockCopier(mapping, src, 0, 1, SLOT_BYTES) as w:
        # Complete chunk 0 of the attention group (key h3) came from block 11 earlier.
        assert run_job(w, 1, True, [(0, 11, slot["h3@g0"])]).ok
        # The tail store: blocks [12, 99], group_sizes [1, 1] (attention 28 // 16 = 1; the
        # Mamba state from the CoW block 99, not the live block 21).
        items = items_for_groups([12, 99], [1, 1], [slot["h6@g0"], slot["h6@g1"]])
        assert items.tolist() == [[0, 12, 17], [1, 99, 18]]
        assert run_job(w, 2, True, items).ok

    dst = zeros_like_layout(src)
    # The load after allocation of [31, 32] (attention) and [null, 41] (Mamba): one job
    # writing [31, 32, 41], group_sizes [2, 1]; keys h3@g0, h6@g0, h6@g1.
    items = items_for_groups([31, 32, 41], [2, 1], [slot["h3@g0"], slot["h6@g0"], slot["h6@g1"]])
    with BlockCopier(mapping, dst, 0, 1, SLOT_BYTES) as r:
        assert run_job(r, 3, False, items).ok
    assert torch.equal(block_bytes(dst, 0, 31), block_bytes(src, 0, 11))
    assert torch.equal(block_bytes(dst, 0, 32), block_bytes(src, 0, 12))
    assert torch.equal(block_bytes(dst, 1, 41), block_bytes(src, 1, 99))
    assert not torch.equal(block_bytes(dst, 1, 41), block_bytes(src, 1, 21))


@pytest.mark.parametrize(
    "items",
    [
        [(0, 1, 2), (0, 2, NUM_SLOTS)],  # slot out of range (after a valid item)
        [(0, 1, -1)],
        [(2, 1, 2)],  # no group 2
        [(0, NUM_BLOCKS, 2)],
        [(0, 1)],  # not a triple
        [("a", 1, 2)],
    ],
)
def test_bad_job_is_reported_and_corrupts_nothing(mapping: PoolMapping, items: list) -> None:
    src = make_layout(3)
    before_kv = [t.clone() for t in src.tensors]
    before_pool = mapping.tensor.clone()
    with BlockCopier(mapping, src, 0, 1, SLOT_BYTES) as w:
        for store in (True, False):
            assert (w.submit_store if store else w.submit_load)(5, items) is False
            w.wait([5])
            assert w.get_finished() == [CopyResult(5, False, 0, 0.0)]
        assert torch.equal(mapping.tensor, before_pool)
        assert all(torch.equal(a, b) for a, b in zip(src.tensors, before_kv, strict=True))
        # The copier keeps working after a rejected job.
        assert run_job(w, 6, True, [(0, 1, 2)]).ok
    assert torch.equal(
        mapping.slot_view(SLOT_BYTES)[2, : src.groups[0].bytes_per_block], block_bytes(src, 0, 1)
    )


@pytest.mark.parametrize("threads", [1, 3])
def test_wide_pages_cross_chunk_boundaries(threads: int) -> None:
    """Pages wider than the 1 MiB CPU work unit (split by columns, uneven last piece) next to
    narrow ones (grouped by rows), with several copy threads."""
    wide = (5 << 19) + 123  # 2.5 MiB + 123 bytes
    gen = torch.Generator().manual_seed(9)
    big = torch.randint(-128, 128, (8, wide), dtype=torch.int8, generator=gen)
    small = torch.randint(-128, 128, (8, 64), dtype=torch.int8, generator=gen)
    layout = KVLayout([big, small], [[(0, 0, wide), (1, 0, 64)], [(1, 8, 32)]])
    slot_bytes = wide + 64
    items = [(0, 1, 2), (0, 2, 3), (0, 7, 0), (1, 4, 1)]
    with (
        sentinel_file(4 * slot_bytes) as path,
        PoolMapping(path, 4 * slot_bytes, registry=CollectorRegistry()) as m,
    ):
        with BlockCopier(m, layout, 0, 1, slot_bytes, cpu_threads=threads) as w:
            assert run_job(w, 1, True, items).ok
        for g, b, s in items:
            n = layout.groups[g].bytes_per_block
            assert torch.equal(m.slot_view(slot_bytes)[s, :n], block_bytes(layout, g, b))
        dst = zeros_like_layout(layout)
        loads = [(g, 7 - b, s) for g, b, s in items]
        with BlockCopier(m, dst, 0, 1, slot_bytes, cpu_threads=threads) as r:
            assert run_job(r, 2, False, loads).ok
    for (g, b, _), (_, b2, _) in zip(items, loads, strict=True):
        assert torch.equal(block_bytes(dst, g, b2), block_bytes(layout, g, b))


def test_duplicate_destinations_rejected(mapping: PoolMapping) -> None:
    with BlockCopier(mapping, make_layout(4), 0, 1, SLOT_BYTES) as w:
        assert w.submit_load(1, [(0, 3, 1), (0, 3, 2)]) is False  # one block written twice
        assert w.submit_store(2, [(0, 1, 2), (1, 5, 2)]) is False  # one slot written twice
        assert [(r.job_id, r.ok) for r in w.get_finished()] == [(1, False), (2, False)]
        assert bool((mapping.tensor == SENTINEL).all())


def test_failed_copy_reported_not_raised(
    mapping: PoolMapping, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = BlockCopier(mapping, make_layout(5), 0, 1, SLOT_BYTES)

    def broken_plan(arr: object, store: bool) -> list[SegmentWork]:
        # Views whose shapes disagree: the copy itself fails, on the lane's thread.
        one = np.array([1])
        return [SegmentWork(np.zeros((4, 1, 10), np.int8), np.zeros((4, 1, 20), np.int8),
                            one, one)]

    monkeypatch.setattr(w, "_plan", broken_plan)
    assert w.submit_store(7, [(0, 1, 1)]) is True
    w.wait([7])
    results = w.get_finished()  # must not raise
    assert [(r.job_id, r.ok, r.nbytes) for r in results] == [(7, False, 0)]
    w.close()


def test_job_id_in_flight_twice_is_reported_not_raised(mapping: PoolMapping) -> None:
    with BlockCopier(mapping, make_layout(6), 0, 1, SLOT_BYTES, cpu_async=False) as w:
        assert w.submit_store(1, [(0, 1, 1)]) is True
        assert w.submit_store(1, [(0, 2, 2)]) is False  # a caller bug, never an exception
        assert sorted((r.job_id, r.ok) for r in w.get_finished()) == [(1, False), (1, True)]
        assert w.submit_store(1, [(0, 2, 2)]) is True  # reusable once reported
        assert w.get_finished()[0].ok
    assert w.submit_store(2, [(0, 3, 3)]) is False  # closed: reported, not raised
    assert w.get_finished() == [CopyResult(2, False, 0, 0.0)]


def test_empty_job_and_results_in_submission_order(mapping: PoolMapping) -> None:
    with BlockCopier(mapping, make_layout(7), 0, 1, SLOT_BYTES) as w:
        w.submit_store(3, [])
        w.submit_store(1, [(0, 1, 1)])
        w.submit_load(2, [(0, 9, 1)])
        w.wait([1, 2, 3])
        assert [(r.job_id, r.ok) for r in w.get_finished()] == [(3, True), (1, True), (2, True)]


@pytest.mark.parametrize(
    "rank, world, slot_bytes, words",
    [
        (0, 4, SLOT_BYTES, "needs 2560 B per block"),  # 2048 B rank pages < 2560 B blocks
        (0, 3, SLOT_BYTES, "not a positive multiple of the 3 ranks"),  # --slot-bytes vs TP
        (2, 2, SLOT_BYTES, "outside a world of 2"),
        (0, 1, SLOT_BYTES * NUM_SLOTS * 2, "smaller than one"),
    ],
)
def test_impossible_geometry_refused_in_one_line(
    mapping: PoolMapping, rank: int, world: int, slot_bytes: int, words: str
) -> None:
    with pytest.raises(GeometryError) as info:
        BlockCopier(mapping, make_layout(8), rank, world, slot_bytes)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_pinned_metric_zero_on_cpu_and_logged_once(
    pool_file: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(pool_map, "_unpinned_logged", False)
    reg = CollectorRegistry()
    size = SLOT_BYTES * NUM_SLOTS
    with caplog.at_level(logging.INFO, logger="kvoffload.connector"):
        a = PoolMapping(pool_file, size, registry=reg)
        b = PoolMapping(pool_file, size, registry=reg)
    assert not a.pinned and not b.pinned
    assert reg.get_sample_value("kvoffload_connector_pool_pinned_bytes") == 0
    assert reg.get_sample_value("kvoffload_connector_pool_mapped_bytes") == 2 * size
    notes = [rec for rec in caplog.records if "not pinned" in rec.getMessage()]
    assert len(notes) == 1 and notes[0].name == "kvoffload.connector"
    a.close()
    b.close()
    assert reg.get_sample_value("kvoffload_connector_pool_mapped_bytes") == 0
    with pytest.raises(RuntimeError):
        PoolMapping(pool_file, size, pin=True, registry=reg)
    assert reg.get_sample_value("kvoffload_connector_pool_mapped_bytes") == 0


def test_mapping_is_shared_and_size_checked(pool_file: str) -> None:
    size = SLOT_BYTES * NUM_SLOTS
    with PoolMapping(pool_file, size, registry=CollectorRegistry()) as m:
        m.tensor[5] = 7
        m.tensor[size - 1] = 9
    with open(pool_file, "rb") as f:
        data = f.read()
    assert data[5] == 7 and data[size - 1] == 9
    with pytest.raises(ValueError):
        PoolMapping(pool_file, size + 1, registry=CollectorRegistry())


def test_group_bytes_from_duck_typed_canonical() -> None:
    """Padding after the un-padded page is not part of the block."""
    t = torch.zeros(NUM_BLOCKS, PAGE, dtype=torch.int8)
    u = torch.zeros(NUM_BLOCKS, 2 * PAGE, dtype=torch.float16)  # seen as int8 rows of 2*PAGE*2
    ref = SimpleNamespace
    kv = SimpleNamespace(
        tensors=[ref(tensor=t, page_size_bytes=PAGE), ref(tensor=u, page_size_bytes=4 * PAGE)],
        group_data_refs=[
            [ref(tensor_idx=0, page_size_bytes=PAGE), ref(tensor_idx=1, page_size_bytes=4 * PAGE)],
            [ref(tensor_idx=0, page_size_bytes=100), ref(tensor_idx=1, page_size_bytes=300)],
        ],
    )
    layout = layout_from_canonical(kv)
    assert group_bytes_per_block(kv) == list(layout.bytes_per_block()) == [5 * PAGE, 400]
    assert layout.tensors[1].shape == (NUM_BLOCKS, 4 * PAGE)
    assert layout.tensors[1].data_ptr() == u.data_ptr()  # a view, not a copy


# ---- vLLM's own CanonicalKVCaches -------------------------------------------------------


def _vllm_canonical(kv_cache_layout: str) -> tuple[object, dict[str, torch.Tensor], int]:
    """Build a hybrid FullAttention + Mamba KV cache on CPU the way vLLM does and let vLLM's
    WORKER-role OffloadingConnector canonicalize it. Returns (CanonicalKVCaches, layer views,
    num_blocks)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    pytest.importorskip("vllm")
    from kvoffload.bench.vllm_baseline import StubModelConfig
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        MambaSpec,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    spec_mod = importlib.import_module("tests.copier_vllm_spec")


    vc = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=spec_mod.spec_extra_config(),
        ),
        cache_config=CacheConfig(block_size=16, mamba_cache_mode="align"),
    )
    vc.model_config = StubModelConfig(4096, kv_heads=2)  # type: ignore[assignment]
    vc.cache_config.kv_cache_layout = kv_cache_layout
    att = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    mamba = MambaSpec(
        block_size=16,
        shapes=((3, 16), (4, 8)),
        dtypes=(torch.float16, torch.float16),
        page_size_padded=att.page_size_bytes,
        mamba_cache_mode="align",
    )
    groups = [
        KVCacheGroupSpec(["attn.0", "attn.1"], att),
        KVCacheGroupSpec(["mamba.0", "mamba.1"], mamba),
    ]
    cfg = get_kv_cache_config_from_groups(vc, groups, 64 * 2 * att.page_size_bytes)
    # What vLLM's allocate_kv_cache does (its module needs GPU-only imports): one backing
    # buffer, one [B, H, N, C] view per layer through vLLM's own create_kv_cache_views.
    buf = torch.randint(-128, 128, (cfg.kv_cache_tensors[0].size,), dtype=torch.int8)
    layout_enum = KVCacheLayout[kv_cache_layout]
    views: dict[str, torch.Tensor] = {}
    for kt in cfg.kv_cache_tensors:
        spec = next(g.kv_cache_spec for g in cfg.kv_cache_groups if kt.layers[0] in g.layer_names)
        views.update(
            zip(
                kt.layers,
                create_kv_cache_views(buf, spec, cfg.num_blocks, layout_enum, kt),
                strict=True,
            )
        )
    conn = OffloadingConnector(vc, KVConnectorRole.WORKER, cfg)
    spec_mod.CAPTURED.clear()
    conn.register_kv_caches(views)
    assert len(spec_mod.CAPTURED) == 1
    return spec_mod.CAPTURED[0], views, cfg.num_blocks


def _layer_bytes(view: torch.Tensor, block: int) -> bytes:
    return view[block].contiguous().view(torch.int8).numpy().tobytes()


@pytest.mark.vllm
@pytest.mark.parametrize("kv_cache_layout", ["LBHNC", "BLHNC"])  # layer-compact, block-packed
def test_layout_from_vllm_canonical(pool_file: str, kv_cache_layout: str) -> None:
    canonical, views, num_blocks = _vllm_canonical(kv_cache_layout)
    layout = layout_from_canonical(canonical)
    assert layout.num_blocks == num_blocks
    expected = (2048, 320) if kv_cache_layout == "LBHNC" else (2048, 2048)  # packed: whole block
    assert layout.bytes_per_block() == expected
    assert group_bytes_per_block(canonical) == list(expected)
    # The layout views vLLM's memory; it copies nothing.
    assert all(
        t.untyped_storage().data_ptr() == views["attn.0"].untyped_storage().data_ptr()
        for t in layout.tensors
    )

    # Attention blocks 1, 2 and Mamba blocks 3, 4 round-trip into blocks 10, 11, 12, 13.
    layers = {0: ["attn.0", "attn.1"], 1: ["mamba.0", "mamba.1"]}
    stored = [(0, 1, 0), (0, 2, 1), (1, 3, 2), (1, 4, 3)]
    before = {(g, b): [_layer_bytes(views[n], b) for n in layers[g]] for g, b, _ in stored}
    loaded = [(g, b + 9, s) for g, b, s in stored]
    with (
        PoolMapping(pool_file, SLOT_BYTES * NUM_SLOTS, registry=CollectorRegistry()) as m,
        BlockCopier(m, layout, 0, 1, 4096) as w,
    ):
        assert run_job(w, 1, True, stored).ok
        assert run_job(w, 2, False, loaded).ok
    for (g, b, _), (_, b2, _) in zip(stored, loaded, strict=True):
        # vLLM's own per-layer views see the restored KV (and Mamba state) bytes.
        assert [_layer_bytes(views[n], b2) for n in layers[g]] == before[(g, b)]
