"""One copy job as views and pointer arrays: the plan both devices execute.

A job's items are validated and grouped per KV-cache group; each group's items become, per
``Segment`` (layout.py: the regions one strided view covers, usually every layer of the group),
a ``SegmentWork``: the segment's ``(num_blocks, count, nbytes)`` KV view, the matching
``(num_slots, count, nbytes)`` view of this rank's pool pages, and the item's block ids and slots.

Executors then pick the form they are fastest with:

* ``ops``: ``(dst, src)`` view pairs, one per run of consecutive blocks landing in consecutive
  slots (CPU memcpy pieces; CUDA per-row fallback);
* ``work_entries``: flat ``(dst, src, size)`` pointer arrays with adjacent copies merged, the
  input of one ``cuMemcpyBatchAsync``, by array arithmetic (``batch_entries`` builds the same
  from the ``ops`` views: the reference the tests compare it with);
* the ``SegmentWork`` itself: device-side ``index_select`` / ``index_copy_`` gathers (CUDA
  fallback without the batch API).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np
import torch
from kvoffload.connector.transfer.layout import KVLayout, block_run_arrays

CopyOp = tuple[Any, Any]  # (dst, src) views of equal shape, last dim contiguous


@dataclass
class SegmentWork:
    """Torch views on CUDA; on CPU numpy arrays over the same memory (cheaper to index)."""

    kv: Any  # (num_blocks, count, nbytes)
    pool: Any  # (num_slots, count, nbytes)
    blocks: np.ndarray  # int64, one per item
    slots: np.ndarray  # int64, the item's slot
    # Copy in slot order (stores: the pool is written front to back) rather than block order.
    by_slot: bool = False

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * int(self.kv.shape[1]) * int(self.kv.shape[2])


SegmentViews = list[list[tuple[Any, Any]]]  # per group: (kv, pool) per segment


def segment_views(layout: KVLayout, pages: torch.Tensor) -> SegmentViews:
    """Per group, per segment: the ``(num_blocks, count, nbytes)`` KV view and the matching
    ``(num_slots, count, nbytes)`` view of ``pages`` (this rank's ``(num_slots, rank_bytes)``
    pages of the pool). Built once; a job only indexes them."""
    return [
        [
            (layout.segment_view(seg),
             pages[:, seg.page_offset : seg.page_offset + seg.total_bytes]
             .unflatten(1, (seg.count, seg.nbytes)))
            for seg in segs
        ]
        for segs in layout.segments
    ]


def plan_work(views: SegmentViews, arr: np.ndarray, by_slot: bool = False,
              presorted: bool = False) -> list[SegmentWork]:
    """``arr``: validated ``(group, block, slot)`` rows. Each group's items are copied in block
    order, or in slot order with ``by_slot`` (stores: writing the pool in address order
    measured ~8 % faster than writing it in the shuffled order of the blocks; loads gain
    nothing from reading it so). ``presorted``: ``arr`` is in that order already (by slot, or
    by (group, block)), so a group's rows only need selecting."""
    work: list[SegmentWork] = []
    if len(arr) == 0:
        return work
    groups = arr[:, 0]
    one = groups.min() == groups.max()  # the common case: one boolean mask fewer
    for g in ([int(groups[0])] if one else np.unique(groups).tolist()):
        sel = arr if one else arr[groups == g]
        if presorted:
            blocks, slots = sel[:, 1], sel[:, 2]
        else:
            order = np.argsort(sel[:, 2 if by_slot else 1], kind="stable")
            blocks, slots = sel[order, 1], sel[order, 2]
        for kv, pool in views[g]:
            work.append(SegmentWork(kv, pool, blocks, slots, by_slot))
    return work


def iter_ops(work: list[SegmentWork], store: bool) -> Iterator[CopyOp]:
    """One view pair per run of consecutive blocks in consecutive slots, per segment."""
    for w in work:
        if len(w.blocks) == 0:
            continue
        b0s, s0s, ns = block_run_arrays(w.blocks, w.slots, w.by_slot, ordered=True)
        for b0, s0, n in zip(b0s.tolist(), s0s.tolist(), ns.tolist(), strict=True):
            kv = w.kv[b0] if n == 1 else w.kv[b0 : b0 + n]
            pool = w.pool[s0] if n == 1 else w.pool[s0 : s0 + n]
            yield (pool, kv) if store else (kv, pool)


def ops(work: list[SegmentWork], store: bool) -> list[CopyOp]:
    return list(iter_ops(work, store))


Unit = tuple[int, int, int, int, int, int]  # (work index, block, slot, blocks, layer0, layer1)


def copy_units(work: list[SegmentWork], limit: int) -> list[Unit]:
    """The job cut into units of about ``limit`` bytes for several threads: runs of blocks
    split by whole blocks, and a block larger than ``limit`` split by layers (the segment's
    regions). Cheap tuples, built with numpy (a Python loop here cost ~0.3 ms per 48 MiB job
    of 16-token blocks, 14 % of its copy time); each thread makes the views of its own units."""
    units: list[Unit] = []
    for i, w in enumerate(work):
        if len(w.blocks) == 0:
            continue
        count, width = int(w.kv.shape[1]), int(w.kv.shape[2])
        row = count * width
        b0, s0, n = block_run_arrays(w.blocks, w.slots, w.by_slot, ordered=True)
        if row <= limit and int(n.max()) <= max(1, limit // max(row, 1)):
            # Every run is one unit (scattered items, the usual case): no splitting.
            units.extend(zip(repeat(i), b0.tolist(), s0.tolist(), n.tolist(), repeat(0),
                             repeat(count)))
        elif row <= limit:
            step = max(1, limit // max(row, 1))
            pieces_per_run = (n + step - 1) // step
            run = np.repeat(np.arange(len(n)), pieces_per_run)
            first = np.repeat(np.cumsum(pieces_per_run) - pieces_per_run, pieces_per_run)
            off = (np.arange(len(run)) - first) * step
            size = np.minimum(step, n[run] - off)
            units.extend(zip(repeat(i), (b0[run] + off).tolist(), (s0[run] + off).tolist(),
                             size.tolist(), repeat(0), repeat(count)))
        else:
            per = max(1, limit // max(width, 1))
            units.extend((i, b + k, s + k, 1, j, min(j + per, count))
                         for b, s, m in zip(b0.tolist(), s0.tolist(), n.tolist(), strict=True)
                         for k in range(m) for j in range(0, count, per))
    return units


def unit_views(work: list[SegmentWork], units: list[Unit], store: bool) -> Iterator[CopyOp]:
    for i, b0, s0, n, j0, j1 in units:
        w = work[i]
        if n != 1:
            kv, pool = w.kv[b0 : b0 + n], w.pool[s0 : s0 + n]
        elif j0 == 0 and j1 == w.kv.shape[1]:
            kv, pool = w.kv[b0], w.pool[s0]
        else:
            kv, pool = w.kv[b0, j0:j1], w.pool[s0, j0:j1]
        yield (pool, kv) if store else (kv, pool)


def _pointers(t: torch.Tensor) -> np.ndarray:
    """Start address of every last-dim row of ``t`` (element size 1), row-major order."""
    idx = np.zeros(1, dtype=np.int64)
    for size, stride in zip(t.shape[:-1], t.stride()[:-1], strict=True):
        idx = (idx[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).ravel()
    return idx + t.data_ptr()


def batch_entries(copy_ops: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat ``(dst, src, size)`` uint64 arrays for the ops; copies that continue the previous
    one on both sides are merged (a block-packed layout becomes one copy per run). The
    reference form: ``work_entries`` computes the same arrays without a view per op."""
    dsts, srcs, sizes = [], [], []
    for dst, src in copy_ops:
        width = int(dst.shape[-1])
        d, s = _pointers(dst), _pointers(src)
        dsts.append(d)
        srcs.append(s)
        sizes.append(np.full(len(d), width, dtype=np.int64))
    return _merged(dsts, srcs, sizes)


def work_entries(work: list[SegmentWork], store: bool
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``batch_entries(ops(work, store))`` from the work's block and slot arrays directly: one
    address per (item, region) by array arithmetic. On CUDA this runs on the engine's step:
    the per-op form cost 3.7 ms of Python for a 384-block shuffled job (a view and a pointer
    walk per op), more than the copy itself takes on the device."""
    dsts, srcs, sizes = [], [], []
    for w in work:
        if len(w.blocks) == 0:
            continue
        count, width = int(w.kv.shape[1]), int(w.kv.shape[2])
        if w.kv.element_size() != 1 or w.kv.stride(2) != 1 or w.pool.stride(2) != 1:
            raise ValueError("batch entries need byte views with contiguous rows")
        region = np.arange(count, dtype=np.int64)[None, :]
        kv = (w.kv.data_ptr() + w.blocks[:, None] * w.kv.stride(0)
              + region * w.kv.stride(1)).ravel()
        pool = (w.pool.data_ptr() + w.slots[:, None] * w.pool.stride(0)
                + region * w.pool.stride(1)).ravel()
        dsts.append(pool if store else kv)
        srcs.append(kv if store else pool)
        sizes.append(np.full(len(kv), width, dtype=np.int64))
    return _merged(dsts, srcs, sizes)


def _merged(dsts: list[np.ndarray], srcs: list[np.ndarray], sizes: list[np.ndarray]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not dsts:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty, empty
    d, s, n = np.concatenate(dsts), np.concatenate(srcs), np.concatenate(sizes)
    # Entry i continues entry i-1 when both sides start where i-1 ended.
    cont = np.zeros(len(d), dtype=bool)
    cont[1:] = (d[1:] == d[:-1] + n[:-1]) & (s[1:] == s[:-1] + n[:-1])
    heads = np.flatnonzero(~cont)
    merged = np.add.reduceat(n, heads)
    return d[heads].astype(np.uint64), s[heads].astype(np.uint64), merged.astype(np.uint64)


def pieces(d: np.ndarray, s: np.ndarray, limit: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Split one (dst, src) numpy view pair into pieces of about ``limit`` bytes (views)."""
    if d.nbytes <= limit or d.ndim == 0:
        yield d, s
    elif d.ndim == 1:
        for c in range(0, len(d), limit):
            yield d[c : c + limit], s[c : c + limit]
    else:
        row = d[0].nbytes
        if row >= limit:
            for i in range(d.shape[0]):
                yield from pieces(d[i], s[i], limit)
        else:
            step = max(1, limit // max(row, 1))
            for i in range(0, d.shape[0], step):
                yield d[i : i + step], s[i : i + step]
