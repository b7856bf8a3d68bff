"""The copy engine's paths on CPU: fused segment views, the CUDA backends with the device
swapped (same torch code on CPU tensors; the batched call's pointer arrays executed by memmove),
the expedited lane, background pool mapping and refused copiers."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from kvoffload.connector.transfer import cpu as copy_cpu
from kvoffload.connector.transfer import cuda as copy_cuda
from kvoffload.connector.transfer.engine import (
    EXPEDITED,
    LOAD,
    STORE,
    BlockCopier,
    CopyResult,
    KVLayout,
    MappingTask,
    PoolMapping,
    RefusedCopier,
)
from kvoffload.connector.transfer.plan import (
    batch_entries,
    ops,
    plan_work,
    segment_views,
    work_entries,
)
from prometheus_client import CollectorRegistry

LAYERS, NB, PAGE, MAMBA = 4, 40, 512, 96
SLOT = LAYERS * PAGE
SLOTS = 24
SENTINEL = 0x5A


def layer_compact(seed: int) -> KVLayout:
    """vLLM's LBHNC: one buffer, layer l's pages at l * NB * PAGE; an attention group (whole
    pages) and a Mamba-like group (a prefix of every page)."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randint(-128, 128, (LAYERS, NB, PAGE), dtype=torch.int8, generator=gen)
    tensors = [buf[i] for i in range(LAYERS)]
    return KVLayout(tensors, [[(i, 0, PAGE) for i in range(LAYERS)],
                              [(i, 0, MAMBA) for i in range(LAYERS)]])


def separate(seed: int) -> KVLayout:
    """Per-layer tensors allocated apart: no common storage, nothing to fuse."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(-128, 128, (NB, PAGE), dtype=torch.int8, generator=gen)
               for _ in range(LAYERS)]
    return KVLayout(tensors, [[(i, 0, PAGE) for i in range(LAYERS)],
                              [(i, 0, MAMBA) for i in range(LAYERS)]])


def block_packed(seed: int) -> KVLayout:
    """vLLM's BLHNC: one (NB, LAYERS * PAGE) tensor; regions merge into one per group."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(-128, 128, (NB, SLOT), dtype=torch.int8, generator=gen)
    return KVLayout([t], [[(0, 0, SLOT)], [(0, PAGE, MAMBA)]])


LAYOUTS = {"layer_compact": layer_compact, "separate": separate, "block_packed": block_packed}


def like(layout: KVLayout, value: int = 0) -> KVLayout:
    """An engine of the same structure (same storage sharing) with every byte ``value``."""
    storages: dict[int, torch.Tensor] = {}
    tensors = []
    for t in layout.tensors:
        key = t.untyped_storage().data_ptr()
        if key not in storages:
            base = torch.empty(0, dtype=torch.int8).set_(
                t.untyped_storage(), 0, (t.untyped_storage().nbytes(),), (1,))
            storages[key] = torch.full_like(base, value)
        tensors.append(storages[key].as_strided(t.shape, t.stride(), t.storage_offset()))
    ranges = [[(r.tensor_idx, r.offset, r.nbytes) for r in g.regions] for g in layout.groups]
    return KVLayout(tensors, ranges)


def block_bytes(layout: KVLayout, g: int, b: int) -> torch.Tensor:
    return torch.cat([layout.tensors[r.tensor_idx][b, r.offset : r.offset + r.nbytes]
                      for r in layout.groups[g].regions])


@pytest.fixture
def mapping(tmp_path: Path) -> Iterator[PoolMapping]:
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(folder, f"kvoffload-paths-{os.getpid()}-{id(tmp_path)}")
    with open(path, "wb") as f:
        f.write(bytes([SENTINEL]) * SLOT * SLOTS)
    m = PoolMapping(path, SLOT * SLOTS, registry=CollectorRegistry())
    yield m
    m.close()
    os.unlink(path)


# Shuffled items, a run of consecutive blocks into consecutive slots, and both groups.
STORES = [(0, 3, 7), (0, 4, 8), (0, 5, 9), (0, 30, 1), (0, 12, 20),
          (1, 6, 2), (1, 7, 3), (1, 39, 0), (1, 18, 15)]


def check_pool(pool: torch.Tensor, src: KVLayout, items: list[tuple[int, int, int]]) -> None:
    for g, b, s in items:
        n = src.groups[g].bytes_per_block
        assert torch.equal(pool[s, :n], block_bytes(src, g, b))
        assert bool((pool[s, n:] == SENTINEL).all())
    untouched = sorted(set(range(SLOTS)) - {s for _, _, s in items})
    assert bool((pool[untouched] == SENTINEL).all())


def check_loaded(dst: KVLayout, src: KVLayout, stores: list, loads: list) -> None:
    for (g, b, _), (_, b2, _) in zip(stores, loads, strict=True):
        assert torch.equal(block_bytes(dst, g, b2), block_bytes(src, g, b))
    written = {b2 for _, b2, _ in loads}
    for t in dst.tensors:  # no stray write into any other block
        others = [b for b in range(NB) if b not in written]
        assert not bool(t[others].any())


def test_segments_fuse_what_one_view_covers() -> None:
    fused = layer_compact(0).segments
    assert [(s.count, s.nbytes, s.step) for s in fused[0]] == [(LAYERS, PAGE, NB * PAGE)]
    assert [(s.count, s.nbytes, s.page_offset) for s in fused[1]] == [(LAYERS, MAMBA, 0)]
    assert [s.count for s in separate(0).segments[0]] == [1] * LAYERS
    assert [(s.count, s.nbytes) for s in block_packed(0).segments[0]] == [(1, SLOT)]
    # Unequal sizes break a segment; a gap in the slot page does not exist by construction.
    buf = torch.zeros(3, NB, PAGE, dtype=torch.int8)
    mixed = KVLayout([buf[0], buf[1], buf[2]], [[(0, 0, PAGE), (1, 0, PAGE), (2, 0, 100)]])
    assert [(s.count, s.nbytes, s.page_offset) for s in mixed.segments[0]] == [
        (2, PAGE, 0), (1, 100, 2 * PAGE)]
    view = layer_compact(1).segment_view(fused[0][0])
    assert view.shape == (NB, LAYERS, PAGE)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("threads, chunk", [(1, 1 << 20), (3, 1 << 20), (2, 300)])
def test_round_trip(mapping: PoolMapping, monkeypatch: pytest.MonkeyPatch, name: str,
                    threads: int, chunk: int) -> None:
    """Every layout, one or several threads, and units cut smaller than a page (by layers,
    then by bytes) all land the same bytes in the same places."""
    monkeypatch.setattr(copy_cpu, "_CHUNK_BYTES", chunk)
    src = LAYOUTS[name](2)
    with BlockCopier(mapping, src, 0, 1, SLOT, cpu_threads=threads) as w:
        w.submit_store(1, STORES)
        w.wait([1])
        (res,) = w.get_finished()
        mamba_block = MAMBA if name == "block_packed" else LAYERS * MAMBA
        assert res.ok and res.nbytes == 5 * SLOT + 4 * mamba_block
    check_pool(mapping.slot_view(SLOT), src, STORES)
    dst = like(src)
    loads = [(g, (b + 11) % NB, s) for g, b, s in STORES]
    with BlockCopier(mapping, dst, 0, 1, SLOT, cpu_threads=threads) as r:
        r.submit_load(2, loads)
        r.wait([2])
        assert [(x.job_id, x.ok) for x in r.get_finished()] == [(2, True)]
    check_loaded(dst, src, STORES, loads)


def torch_work(layout: KVLayout, mapping: PoolMapping, items: list, store: bool) -> list:
    pages = mapping.slot_view(SLOT)
    return plan_work(segment_views(layout, pages), np.asarray(items, dtype=np.int64))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("backend", ["index", "rows", "batch"])
def test_cuda_backends_with_the_device_swapped(mapping: PoolMapping, name: str,
                                               backend: str) -> None:
    """The CUDA paths' torch code run on CPU tensors; ``batch`` runs the pointer arrays that
    one cuMemcpyBatchAsync would get, copy by copy, with memmove."""
    src = LAYOUTS[name](3)
    dst = like(src)
    loads = [(g, (b + 5) % NB, s) for g, b, s in STORES]
    for layout, items, store in ((src, STORES, True), (dst, loads, False)):
        work = torch_work(layout, mapping, items, store)
        if backend == "index":
            copy_cuda.launch_index(work, store, torch.device("cpu"), staging_bytes=3 * PAGE)
        elif backend == "rows":
            copy_cuda.launch_rows(ops(work, store))
        else:
            d, s, n = work_entries(work, store)  # what CudaLauncher hands the driver
            for a, b, c in zip(d.tolist(), s.tolist(), n.tolist(), strict=True):
                ctypes.memmove(a, b, c)
    check_pool(mapping.slot_view(SLOT), src, STORES)
    check_loaded(dst, src, STORES, loads)


def test_batch_entries_merge_contiguous_copies(mapping: PoolMapping) -> None:
    run = [(0, 10 + i, 4 + i) for i in range(5)]  # 5 consecutive blocks, consecutive slots
    packed = batch_entries(ops(torch_work(block_packed(4), mapping, run, True), True))
    assert len(packed[0]) == 1 and int(packed[2][0]) == 5 * SLOT
    compact = batch_entries(ops(torch_work(layer_compact(4), mapping, run, True), True))
    assert len(compact[0]) == 5 * LAYERS  # layers are apart in the KV buffer
    assert set(compact[2].tolist()) == {PAGE}


class FakeDriver:
    """Stands in for libcuda's cuMemcpyBatchAsync: reads the arrays it is given as the driver
    would and moves the bytes, so argument order and types are checked for real."""

    def __init__(self, with_fail_idx: bool, error: int = 0) -> None:
        self.with_fail_idx = with_fail_idx
        self.error = error
        self.calls: list[tuple[int, int]] = []

    def __call__(self, *args: Any) -> int:
        assert len(args) == (9 if self.with_fail_idx else 8)
        dsts, srcs, sizes, count, attrs, attr_idx, num_attrs = args[:7]
        n = count.value
        arr = (ctypes.c_uint64 * n)
        d = arr.from_address(dsts.value)
        s = arr.from_address(srcs.value)
        z = arr.from_address(sizes.value)
        attr = ctypes.cast(attrs, ctypes.POINTER(copy_cuda._MemcpyAttributes)).contents
        assert attr.srcAccessOrder == 1 and attr_idx[0] == 0 and num_attrs.value == 1
        self.calls.append((n, args[-1].value or 0))
        if self.error:
            return self.error
        for i in range(n):
            ctypes.memmove(d[i], s[i], z[i])
        return 0


@pytest.mark.parametrize("with_fail_idx", [True, False])
def test_batched_call_marshalling_and_fallback(mapping: PoolMapping, with_fail_idx: bool) -> None:
    src = layer_compact(5)
    launcher = copy_cuda.CudaLauncher(torch.device("cpu"), "index")
    driver = FakeDriver(with_fail_idx)
    launcher._batch = copy_cuda.BatchMemcpy(driver, with_fail_idx)
    stream = SimpleNamespace(cuda_stream=1234)
    launcher.launch(torch_work(src, mapping, STORES, True), True, stream)
    assert driver.calls == [(len(STORES) * LAYERS, 1234)]  # one call for the whole job
    check_pool(mapping.slot_view(SLOT), src, STORES)
    # A driver that refuses the batch: the job is redone with gathers, and later jobs too.
    dst = like(src)
    loads = [(g, (b + 3) % NB, s) for g, b, s in STORES]
    launcher._batch = copy_cuda.BatchMemcpy(FakeDriver(with_fail_idx, error=801), with_fail_idx)
    launcher.launch(torch_work(dst, mapping, loads, False), False, stream)
    assert launcher.backend == "index" and launcher._batch is None
    check_loaded(dst, src, STORES, loads)


def test_no_batched_copies_without_a_driver() -> None:
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this machine has an NVIDIA driver")
    assert copy_cuda.BatchMemcpy.load() is None
    with pytest.raises(RuntimeError, match="cuMemcpyBatchAsync"):
        copy_cuda.CudaLauncher(torch.device("cpu"), "batch")
    with pytest.raises(ValueError):
        copy_cuda.CudaLauncher(torch.device("cpu"), "kernel")


def test_expedited_load_never_waits_behind_stores_or_loads(mapping: PoolMapping) -> None:
    src = layer_compact(6)
    release = threading.Event()
    started = {STORE: threading.Event(), LOAD: threading.Event()}
    with BlockCopier(mapping, src, 0, 1, SLOT) as w:
        for lane in (STORE, LOAD):  # a store and a regular load that cannot finish
            memcpy = w._lanes[lane].memcpy
            real = memcpy.copy

            def blocked(work: Any, store: bool, real: Any = real, lane: str = lane) -> None:
                started[lane].set()
                assert release.wait(30)
                real(work, store)

            memcpy.copy = blocked  # type: ignore[method-assign]
        w.submit_store(1, [(0, 1, 1), (0, 2, 2)])
        w.submit_load(2, [(0, 20, 5)])
        assert started[STORE].wait(10) and started[LOAD].wait(10)
        w.submit_load(3, [(0, 30, 6), (1, 31, 7)], expedited=True)
        w.expedited_jobs = {4}  # the worker's way to expedite without the keyword
        w.submit_load(4, [(0, 32, 8)])
        w.wait([3, 4])
        assert [(r.job_id, r.ok) for r in w.get_finished()] == [(3, True), (4, True)]
        assert torch.equal(block_bytes(src, 0, 30), mapping.slot_view(SLOT)[6, :SLOT])
        release.set()
        w.wait([1, 2])
        assert sorted((r.job_id, r.ok) for r in w.get_finished()) == [(1, True), (2, True)]
    assert set(w._lanes) == {STORE, LOAD, EXPEDITED}


def test_mapping_task_maps_in_the_background(mapping: PoolMapping,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    reg = CollectorRegistry()
    gate = threading.Event()
    real = PoolMapping._populate

    def slow_populate(self: PoolMapping) -> None:
        assert gate.wait(30)  # the first touch of a big pool: seconds, off the caller
        real(self)

    monkeypatch.setattr(PoolMapping, "_populate", slow_populate)
    task = MappingTask(mapping.path, registry=reg)  # size: the whole file
    assert not task.ready  # the constructor returned while the mapping is still being made
    assert reg.get_sample_value("kvoffload_worker_pin_seconds") == 0
    gate.set()
    m = task.wait_ready(30)
    assert m.size == SLOT * SLOTS and task.ready
    assert reg.get_sample_value("kvoffload_worker_pin_seconds") == task.seconds
    assert task.serves(mapping.path, SLOT * SLOTS)
    assert not task.serves(mapping.path, SLOT * SLOTS + 1)  # a larger pool than mapped
    task.close()
    assert not task.serves(mapping.path, SLOT * SLOTS)


def test_mapping_task_reports_failure_and_file_identity(tmp_path: Path) -> None:
    missing = MappingTask(str(tmp_path / "nope"), 4096, registry=CollectorRegistry())
    with pytest.raises(FileNotFoundError):
        missing.wait_ready(30)
    assert not missing.serves(str(tmp_path / "nope"), 4096)
    path = tmp_path / "pool"
    path.write_bytes(b"\0" * 8192)
    task = MappingTask(str(path), 8192, registry=CollectorRegistry())
    assert task.serves(str(path), 8192)
    path.unlink()  # a restarted daemon that recreated its pool file: a new inode
    path.write_bytes(b"\0" * 8192)
    assert not task.serves(str(path), 8192)
    task.close()


def test_refused_copier_fails_every_job() -> None:
    r = RefusedCopier("pool file missing")
    assert r.submit_store(1, [(0, 1, 1)]) is False
    assert r.submit_load(2, [(0, 1, 1)], expedited=True) is False
    r.wait([1, 2])
    assert r.get_finished() == [CopyResult(1, False, 0, 0.0), CopyResult(2, False, 0, 0.0)]
    assert r.get_finished() == []


def test_stores_write_the_pool_in_slot_order(mapping: PoolMapping) -> None:
    """A store's pieces come in slot order (the pool written front to back), a load's in block
    order (the KV written front to back); the copied bytes do not depend on it."""
    src = layer_compact(11)
    views = segment_views(src, mapping.slot_view(SLOT))
    arr = np.array(STORES, dtype=np.int64)

    def start(v: torch.Tensor) -> int:
        return int(v.data_ptr())

    for store in (True, False):
        for w in plan_work(views, arr, by_slot=store):
            pairs = ops([w], store)
            # The side written in order: the pool (dst of a store) or the KV (dst of a load).
            written = [start(dst) for dst, _ in pairs]
            assert written == sorted(written) and len(pairs) == 3  # one run of 2-3 blocks fused
    with BlockCopier(mapping, src, 0, 1, SLOT, cpu_async=False) as copier:
        assert copier.submit_store(1, STORES)
    check_pool(mapping.slot_view(SLOT), src, STORES)


def _huge_kib(lo: int, hi: int) -> int:
    """AnonHugePages (KiB) of the mappings overlapping [lo, hi)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                a, b = (int(x, 16) for x in head[0].split("-"))
                inside = a < hi and b > lo
            elif inside and head[0] == "AnonHugePages:":
                total += int(head[1])
    return total


def test_cpu_kv_tensors_go_onto_huge_pages(mapping: PoolMapping) -> None:
    """The copier advises the KV tensors' memory onto 2 MiB pages (where the kernel allows it)
    and their bytes are unchanged by it."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        mode = "[never]"
    buf = torch.randint(-128, 128, (LAYERS, 4096, PAGE), dtype=torch.int8,
                        generator=torch.Generator().manual_seed(3))  # 8 MiB
    before = buf.clone()
    layout = KVLayout([buf[i] for i in range(LAYERS)], [[(i, 0, PAGE) for i in range(LAYERS)]])
    with BlockCopier(mapping, layout, 0, 1, SLOT) as copier:
        assert copier.huge_pages is not None
        assert copier.huge_pages.wait(60)
        lo, hi = copier.huge_pages.ranges[0]
        assert buf.data_ptr() <= lo < hi <= buf.data_ptr() + buf.numel()  # never a neighbour
        assert copier.submit_store(1, [(0, 4000, 3)])
        copier.wait([1])
        assert copier.get_finished()[0].ok
    assert torch.equal(buf, before)
    assert torch.equal(mapping.slot_view(SLOT)[3], buf[:, 4000].reshape(-1))
    if "[never]" not in mode and copier.huge_pages.collapsed_bytes:
        assert _huge_kib(lo, hi) * 1024 >= copier.huge_pages.collapsed_bytes
    with BlockCopier(mapping, layout, 0, 1, SLOT, kv_huge_pages=False) as plain:
        assert plain.huge_pages is None


@pytest.mark.parametrize("limit", [SLOT // 4, SLOT, 3 * SLOT, 1 << 20])
def test_copy_units_cover_each_item_and_layer_once(mapping: PoolMapping, limit: int) -> None:
    """Units (the pieces threads share) cover every (block, slot, layer) of a job exactly once,
    each at most ``limit`` bytes when a region fits; long runs and large blocks are split."""
    from kvoffload.connector.transfer.plan import copy_units

    src = layer_compact(5)
    views = segment_views(src, mapping.slot_view(SLOT))
    items = [(0, b, b + 2) for b in range(3, 13)] + [(0, 30, 0), (0, 20, 1)]  # a run of 10
    work = plan_work(views, np.array(items, dtype=np.int64), by_slot=True)
    seen = []
    for i, b0, s0, n, j0, j1 in copy_units(work, limit):
        w = work[i]
        assert n * (j1 - j0) * int(w.kv.shape[2]) <= max(limit, int(w.kv.shape[2]))
        seen += [(b0 + k, s0 + k, j) for k in range(n) for j in range(j0, j1)]
    want = [(b, s, j) for _, b, s in items for j in range(LAYERS)]
    assert sorted(seen) == sorted(want)
