"""BlockCopier's CUDA stream path: real bytes between GPU KV tensors and a pinned /dev/shm pool,
through each copy backend (one cuMemcpyBatchAsync per job, device gathers, per-row copies),
plus the expedited stream and a pageable pool.

Self-contained on purpose: it needs only torch (pytest optional, see the end of the file) and
the kvoffload sources, so scripts/gpu_check.sh can run it on a bare GPU box.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from kvoffload.connector.transfer.cuda import BatchMemcpy
from kvoffload.connector.transfer.engine import (
    STORE,
    BlockCopier,
    CopyResult,
    KVLayout,
    PoolMapping,
)

try:
    import pytest
except ImportError:  # run as a script (see the end of the file)
    pass
else:
    pytestmark = [
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ]

NUM_BLOCKS = 64
PAGE = 64 * 1024
SLOT_BYTES = 4 * PAGE
NUM_SLOTS = 32
SENTINEL = 0x5A


def backends() -> list[str]:
    """The copy paths this box can run (batch needs a CUDA 12.8+ driver)."""
    return (["batch"] if BatchMemcpy.load() is not None else []) + ["index", "rows"]


BACKENDS = backends() if torch.cuda.is_available() else []


@contextlib.contextmanager
def pool(size: int = SLOT_BYTES * NUM_SLOTS, pin: bool | None = None) -> Iterator[PoolMapping]:
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="kvoffload-cuda-test-", dir=folder)
    os.write(fd, bytes([SENTINEL]) * size)
    os.close(fd)
    mapping = PoolMapping(path, size, pin=pin)
    try:
        yield mapping
    finally:
        mapping.close()
        os.unlink(path)


def make_layout(seed: int) -> KVLayout:
    """Group 0: two whole pages plus a strided-row tensor; group 1 (Mamba-like): prefixes of
    the same tensors (aliased, as vLLM overlays groups) and an inner sub-range."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randint(-128, 128, shape, dtype=torch.int8, device="cuda", generator=gen)

    t0, t1 = rand(NUM_BLOCKS, PAGE), rand(NUM_BLOCKS, PAGE)
    t2 = rand(NUM_BLOCKS, 3 * PAGE // 2)[:, :PAGE]
    return KVLayout(
        [t0, t1, t2],
        [[(0, 0, PAGE), (1, 0, PAGE), (2, 0, PAGE)], [(0, 0, 4096), (1, 0, 4096), (2, 512, 1000)]],
    )


def zeros_like(layout: KVLayout) -> KVLayout:
    ranges = [[(r.tensor_idx, r.offset, r.nbytes) for r in g.regions] for g in layout.groups]
    return KVLayout([torch.zeros_like(t) for t in layout.tensors], ranges)


def block_bytes(layout: KVLayout, group: int, block: int) -> torch.Tensor:
    regions = layout.groups[group].regions
    parts = [layout.tensors[r.tensor_idx][block, r.offset : r.offset + r.nbytes] for r in regions]
    return torch.cat(parts).cpu()


def run(
    copier: BlockCopier, job_id: int, store: bool, items: list[tuple[int, int, int]]
) -> CopyResult:
    (copier.submit_store if store else copier.submit_load)(job_id, items)
    copier.wait([job_id])
    results = copier.get_finished()
    assert [r.job_id for r in results] == [job_id]
    return results[0]


def _params(name: str) -> Any:
    return pytest.mark.parametrize(name, BACKENDS) if "pytest" in globals() else (lambda f: f)


@_params("backend")
def test_pinned_round_trip_every_group(backend: str, pin: bool | None = None) -> None:
    src = make_layout(1)
    items = [(0, 3, 4), (0, 4, 5), (0, 5, 6), (0, 40, 1), (1, 10, 0), (1, 11, 20), (1, 63, 31)]
    with pool(pin=pin) as m:
        assert m.pinned is (pin is not False)
        with BlockCopier(m, src, 0, 1, SLOT_BYTES, cuda_backend=backend) as w:
            assert w.cuda_backend == backend
            res = run(w, 1, True, items)
            assert res.ok and res.seconds > 0
            assert (
                res.nbytes == 4 * src.groups[0].bytes_per_block + 3 * src.groups[1].bytes_per_block
            )
        slots = m.slot_view(SLOT_BYTES)
        for g, b, s in items:
            n = src.groups[g].bytes_per_block
            assert torch.equal(slots[s, :n], block_bytes(src, g, b))
            assert bool((slots[s, n:] == SENTINEL).all())
        dst = zeros_like(src)
        loads = [(g, (b + 7) % NUM_BLOCKS, s) for g, b, s in items]
        with BlockCopier(m, dst, 0, 1, SLOT_BYTES, cuda_backend=backend) as r:
            assert run(r, 2, False, loads).ok
        torch.cuda.synchronize()
        for (g, b, _), (_, b2, _) in zip(items, loads, strict=True):
            assert torch.equal(block_bytes(dst, g, b2), block_bytes(src, g, b))


def test_pageable_pool_round_trip() -> None:
    test_pinned_round_trip_every_group(BACKENDS[0], pin=False)


@_params("backend")
def test_contiguous_runs_one_copy(backend: str) -> None:
    """One tensor whose page fills the whole slot: a run is contiguous on both sides."""
    kv = torch.randint(-128, 128, (NUM_BLOCKS, SLOT_BYTES), dtype=torch.int8, device="cuda")
    layout = KVLayout([kv], [[(0, 0, SLOT_BYTES)]])
    with pool() as m, BlockCopier(m, layout, 0, 1, SLOT_BYTES, cuda_backend=backend) as w:
        assert run(w, 1, True, [(0, b, b - 10) for b in range(10, 30)]).ok
        assert torch.equal(m.slot_view(SLOT_BYTES)[0:20], kv[10:30].cpu())
        kv[40:60].zero_()
        assert run(w, 2, False, [(0, 40 + i, i) for i in range(20)]).ok
        assert torch.equal(kv[40:60], kv[10:30])


@_params("backend")
def test_store_waits_for_compute_stream(backend: str) -> None:
    """A store submitted right after the compute stream writes the block must see the write."""
    src = make_layout(2)
    with pool() as m, BlockCopier(m, src, 0, 1, SLOT_BYTES, cuda_backend=backend) as w:
        for attempt in range(3):
            torch.cuda._sleep(50_000_000)  # keep the compute stream busy (~tens of ms)
            src.tensors[0][5].fill_(attempt + 1)  # queued behind the sleep
            assert run(w, attempt, True, [(0, 5, 2)]).ok
            assert bool((m.slot_view(SLOT_BYTES)[2, :PAGE] == attempt + 1).all())


def test_tp2_rank_pages_and_bad_job() -> None:
    ranks = [make_layout(10), make_layout(11)]
    items = [(0, 1, 3), (1, 2, 4)]
    half = SLOT_BYTES // 2
    with pool() as m:
        copiers = [BlockCopier(m, ranks[r], r, 2, SLOT_BYTES) for r in range(2)]
        for w in copiers:
            assert run(w, 1, True, items).ok
        slots = m.slot_view(SLOT_BYTES)
        for g, b, s in items:
            n = ranks[0].groups[g].bytes_per_block
            assert torch.equal(slots[s, :n], block_bytes(ranks[0], g, b))
            assert torch.equal(slots[s, half : half + n], block_bytes(ranks[1], g, b))
        before = m.tensor.clone()
        assert copiers[0].submit_store(9, [(0, 1, 3), (0, 2, NUM_SLOTS)]) is False
        assert copiers[0].get_finished() == [CopyResult(9, False, 0, 0.0)]
        assert torch.equal(m.tensor, before)
        for w in copiers:
            w.close()


@_params("backend")
def test_expedited_load_not_behind_a_store(backend: str) -> None:
    """The store stream is held up (a long sleep kernel queued on it): a store job waits behind
    it, an expedited load and a regular load complete anyway."""
    src = make_layout(3)
    with pool() as m, BlockCopier(m, src, 0, 1, SLOT_BYTES, cuda_backend=backend) as w:
        assert run(w, 1, True, [(0, 2, 2), (0, 3, 3)]).ok
        with torch.cuda.stream(w._streams[STORE]):
            torch.cuda._sleep(2_000_000_000)  # about a second of GPU clocks
        w.submit_store(2, [(0, 4, 4)])
        w.submit_load(3, [(0, 50, 2)], expedited=True)
        w.submit_load(4, [(0, 51, 3)])
        w.wait([3, 4])
        done = {r.job_id: r.ok for r in w.get_finished()}
        assert done == {3: True, 4: True}, done  # the store (2) is still queued
        w.wait([2])
        assert [(r.job_id, r.ok) for r in w.get_finished()] == [(2, True)]
        assert torch.equal(block_bytes(src, 0, 50), block_bytes(src, 0, 2))


if __name__ == "__main__":  # for a GPU box without pytest
    if not torch.cuda.is_available():
        raise SystemExit("CUDA not available")
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and callable(fn):
            for backend in BACKENDS if "backend" in fn.__code__.co_varnames else [None]:
                fn(*(() if backend is None else (backend,)))
                print("PASSED", name, backend or "")
