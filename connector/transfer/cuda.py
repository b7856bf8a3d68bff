"""CUDA execution of a copy plan (plan.py), three ways, best first.

* ``batch``: the whole job as ONE ``cuMemcpyBatchAsync`` (driver API, CUDA >= 12.8) on the job's
  stream. Called through ctypes on ``libcuda.so.1`` with the numpy pointer arrays of
  ``work_entries`` passed as they are: cuda-python's binding wants one Python ``CUdeviceptr``
  object per copy, which for a 32-layer job of 48 blocks (3,000 copies) costs as much host time
  as the copy itself. CUDA 13 renamed the entry point ``cuMemcpyBatchAsync_v2`` and dropped its
  ``failIdx`` argument; both are handled.
* ``index``: a device-side ``index_select`` gathers a store's blocks into a contiguous staging
  buffer (a load: ``index_copy_`` scatters it), and each block crosses PCIe as one contiguous
  copy of its whole segment (all layers), so a job costs one copy call per block, not one per
  block and layer. Staging is allocated on the copy stream in bounded chunks: the caching
  allocator only hands a freed chunk to later work of the same stream, so dropping it after
  enqueueing is safe.
* ``rows``: one ``copy_(non_blocking=True)`` per contiguous row, the last fallback. (torch
  copies host<->device without a synchronous bounce only when both sides are contiguous.)

``index`` and ``rows`` are plain torch and run unchanged on CPU tensors, which is how the tests
check them without a GPU; ``batch`` is checked on CPU through ``work_entries``'s addresses.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np
import torch
from kvoffload.connector.transfer.plan import CopyOp, SegmentWork, ops, work_entries

logger = logging.getLogger("kvoffload.connector")

BACKENDS = ("batch", "index", "rows")
_STAGING_BYTES = 64 << 20
_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_MIN_DRIVER = 12080  # cuMemcpyBatchAsync appeared in CUDA 12.8


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


class BatchMemcpy:
    """``cuMemcpyBatchAsync`` through ctypes; ``load()`` returns None where it is missing."""

    def __init__(self, fn: Any, with_fail_idx: bool) -> None:
        self._fn = fn
        self._with_fail_idx = with_fail_idx
        self._attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM)  # copies read in stream order
        self._attr_idx = (ctypes.c_size_t * 1)(0)

    @classmethod
    def load(cls) -> BatchMemcpy | None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            version = ctypes.c_int(0)
            if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < _MIN_DRIVER:
                logger.info("CUDA driver %d has no cuMemcpyBatchAsync", version.value)
                return None
        except (OSError, AttributeError):
            return None
        for name, with_fail_idx in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                return cls(fn, with_fail_idx)
        return None

    def launch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        if len(dsts) == 0:
            return
        d = np.ascontiguousarray(dsts, dtype=np.uint64)
        s = np.ascontiguousarray(srcs, dtype=np.uint64)
        n = np.ascontiguousarray(sizes, dtype=np.uint64)
        args: list[Any] = [
            ctypes.c_void_p(d.ctypes.data),
            ctypes.c_void_p(s.ctypes.data),
            ctypes.c_void_p(n.ctypes.data),
            ctypes.c_size_t(len(d)),
            ctypes.byref(self._attrs),
            self._attr_idx,
            ctypes.c_size_t(1),
        ]
        fail = ctypes.c_size_t(0)
        if self._with_fail_idx:
            args.append(ctypes.byref(fail))
        args.append(ctypes.c_void_p(stream))
        # The driver reads the arrays during the call only; they may be dropped afterwards.
        err = self._fn(*args)
        if err != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync error {err} (copy {fail.value} of {len(d)})")


def launch_rows(copy_ops: list[CopyOp]) -> None:
    """One ``copy_`` per pair that is contiguous on both sides, splitting the rest by rows."""
    stack = list(copy_ops)
    while stack:
        dst, src = stack.pop()
        if dst.dim() <= 1 or (dst.is_contiguous() and src.is_contiguous()):
            dst.copy_(src, non_blocking=True)
        else:
            stack.extend((dst[i], src[i]) for i in range(dst.shape[0]))


def launch_index(work: list[SegmentWork], store: bool, device: torch.device,
                 staging_bytes: int = _STAGING_BYTES) -> None:
    """Gather/scatter on the device side; on the host side one contiguous copy per run of
    consecutive slots where the pool rows of a run are contiguous, else per slot."""
    for w in work:
        row = int(w.kv.shape[1] * w.kv.shape[2])
        per = max(1, staging_bytes // max(row, 1))
        order = np.argsort(w.slots, kind="stable")  # slot order: consecutive slots coalesce
        slots = w.slots[order]
        blocks = torch.from_numpy(w.blocks[order]).to(device, non_blocking=True)
        for c in range(0, len(slots), per):
            idx = blocks[c : c + per]
            runs = _slot_runs(w.pool, slots[c : c + per])
            if store:
                staging = w.kv.index_select(0, idx)
                for i, s0, n in runs:
                    w.pool[s0 : s0 + n].copy_(staging[i : i + n], non_blocking=True)
            else:
                staging = torch.empty((len(idx), *w.kv.shape[1:]), dtype=torch.int8,
                                      device=device)
                for i, s0, n in runs:
                    staging[i : i + n].copy_(w.pool[s0 : s0 + n], non_blocking=True)
                w.kv.index_copy_(0, idx, staging)


def _slot_runs(pool: torch.Tensor, slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(offset in ``slots``, first slot, count) per copy: maximal runs of consecutive slots
    when their rows are one contiguous piece of the pool (a whole slot per key: TP 1 and the
    group filling the page), else one slot each (a slot's own rows always are)."""
    n = len(slots)
    if n == 0:
        return []
    if n == 1 or not pool[0:2].is_contiguous():
        return [(i, int(s), 1) for i, s in enumerate(slots.tolist())]
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [n])))
    return list(zip(starts.tolist(), slots[starts].tolist(), lengths.tolist(), strict=True))

class CudaLauncher:
    """Enqueues a job's copies on a stream with the best backend this process has."""

    def __init__(self, device: torch.device, backend: str = "auto") -> None:
        if backend not in ("auto", *BACKENDS):
            raise ValueError(f"cuda backend must be auto or one of {BACKENDS}, got {backend!r}")
        self.device = device
        self._batch = BatchMemcpy.load() if backend in ("auto", "batch") else None
        if backend == "batch" and self._batch is None:
            raise RuntimeError("cuMemcpyBatchAsync is not available (needs a CUDA 12.8 driver)")
        self.backend = "batch" if self._batch is not None else (
            "rows" if backend == "rows" else "index")
        logger.info("kvoffload copier on %s: %s copies", device, self.backend)

    def launch(self, work: list[SegmentWork], store: bool, stream: Any) -> None:
        """Call inside ``torch.cuda.stream(stream)``."""
        if self._batch is not None:
            try:
                dsts, srcs, sizes = work_entries(work, store)
                self._batch.launch(dsts, srcs, sizes, int(stream.cuda_stream))
                return
            except RuntimeError:
                # Copies are idempotent: redoing the whole job with gathers is safe even if
                # the driver ran part of the batch. Fall back for good.
                logger.exception("batched copy failed; using device gathers from now on")
                self._batch = None
                self.backend = "index"
        if self.backend == "rows":
            launch_rows(ops(work, store))
        else:
            launch_index(work, store, self.device)
