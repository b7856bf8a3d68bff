"""Moves KV blocks between an engine's KV tensors and its page of the shared pool.

One job is a list of ``(group_idx, block_id, slot)`` items: a store copies block ``block_id``
of group ``group_idx`` into this rank's page of pool slot ``slot``; a load copies it back.
Slot layout (see ``layout.py``): rank ``r``'s page starts at ``r * rank_bytes`` inside the slot
(``rank_bytes = slot_bytes // tp_world_size``); the group's block is the concatenation of its
regions from the page start.

Both devices share the planning: items are validated (a bad job copies nothing and is reported
``ok=False``) and coalesced into runs of consecutive block ids landing in consecutive slots, so
each (run, region) is one 2-D strided view pair. Only execution differs:

* CUDA: two dedicated copy streams (stores and loads, so a load never queues behind a large
  store and both PCIe directions are used). Each job first makes its stream wait on an event
  recorded on the caller's current stream at submit time: a store must not read KV that the
  compute stream has not finished writing, and a load must not race earlier writes (e.g. the
  zeroing of a freshly allocated block); this is a stream-to-stream dependency, not a host sync.
  torch only copies host<->device without a synchronous bounce when both sides are contiguous,
  so a strided run is issued as one ``copy_(non_blocking=True)`` per row. Completion and timing
  come from a pair of CUDA events per job.
* CPU: the same views, copied as ~1 MiB memcpy pieces (numpy views of the same memory) by a
  few threads, not with ``Tensor.copy_``: every ``copy_`` forks and joins torch's OpenMP team,
  which stalls whenever another process holds a core (see ``_CpuMemcpy``). Jobs run on one
  background thread in submission order, so ``submit_*`` returns at once as on CUDA and the
  engine keeps stepping (memcpy releases the GIL); ``get_finished`` reports them when done.
  ``cpu_async=False`` copies inside ``submit_*`` instead (simplest to reason about in tests).

Errors never escape ``get_finished``: they become ``CopyResult(ok=False)``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from kvoffload.connector.layout import (
    KVLayout,
    block_runs,
    group_bytes_per_block,
    items_for_groups,
    layout_from_canonical,
)
from kvoffload.connector.metrics import get_metrics
from kvoffload.connector.pool_map import PoolMapping

__all__ = [
    "BlockCopier",
    "CopyResult",
    "KVLayout",
    "PoolMapping",
    "group_bytes_per_block",
    "items_for_groups",
    "layout_from_canonical",
]

logger = logging.getLogger("kvoffload.connector")

STORE = "store"
LOAD = "load"

CopyOp = tuple[torch.Tensor, torch.Tensor]  # (dst, src), equal shapes


class CopyResult(NamedTuple):
    job_id: int
    ok: bool
    nbytes: int  # bytes this rank moved (0 for a failed job)
    seconds: float


@dataclass
class _Job:
    job_id: int
    direction: str
    ops: list[CopyOp]
    nbytes: int
    done: threading.Event = field(default_factory=threading.Event)
    result: CopyResult | None = None
    start_event: Any = None  # CUDA timing events
    end_event: Any = None


_CHUNK_BYTES = 1 << 20  # CPU work unit: big enough to amortize ~1 us of Python per chunk


def _chunks(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split one (rows, bytes) view pair into ~1 MiB numpy pieces (zero-copy views)."""
    d, s = dst.numpy(), src.numpy()
    if d.ndim == 1:
        d, s = d[None], s[None]
    rows, width = d.shape
    if width >= _CHUNK_BYTES:
        return [
            (d[r, c : c + _CHUNK_BYTES], s[r, c : c + _CHUNK_BYTES])
            for r in range(rows)
            for c in range(0, width, _CHUNK_BYTES)
        ]
    step = max(1, _CHUNK_BYTES // max(width, 1))
    return [(d[r : r + step], s[r : r + step]) for r in range(0, rows, step)]


def _copy_chunks(chunks: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for d, s in chunks:
        np.copyto(d, s)  # a memcpy that releases the GIL


class _CpuMemcpy:
    """Runs a job's copies as ~1 MiB memcpys spread over a few threads.

    Why not ``Tensor.copy_`` per view: each call forks and joins torch's OpenMP team, which
    costs little on an idle machine but stalls whenever a core is busy elsewhere (the engine's
    own compute, the daemon): measured here with load ~4 on 2 cores, per-row ``copy_`` reached
    0.06-0.6 of a contiguous copy while single-threaded memcpy pieces reached 0.7-1.8 of it.
    Plain memcpy pieces (numpy views of the same tensors) never wait on a team.
    """

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads - 1) if self.threads > 1 else None

    def copy(self, ops: list[CopyOp]) -> None:
        chunks = [c for dst, src in ops for c in _chunks(dst, src)]
        # Round-robin over equal-sized chunks balances bytes across threads.
        parts = [chunks[i :: self.threads] for i in range(self.threads)]
        futures = [self._pool.submit(_copy_chunks, p) for p in parts[1:] if p] if self._pool else []
        try:
            _copy_chunks(parts[0])
        finally:
            # Every piece must have stopped before the job is reported, even a failed one.
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class BlockCopier:
    """Copies (group, block_id, slot) items between KV tensors and this rank's slot pages."""

    def __init__(
        self,
        mapping: PoolMapping,
        layout: KVLayout,
        rank: int,
        tp_world_size: int,
        slot_bytes: int,
        device: torch.device | str | None = None,
        *,
        cpu_async: bool = True,
        cpu_threads: int | None = None,
        registry: Any = None,
    ) -> None:
        if tp_world_size <= 0 or not 0 <= rank < tp_world_size:
            raise ValueError(f"rank {rank} outside tp_world_size {tp_world_size}")
        if slot_bytes <= 0 or slot_bytes % tp_world_size:
            raise ValueError("slot_bytes must be a positive multiple of tp_world_size")
        self.rank_bytes = slot_bytes // tp_world_size
        if layout.max_bytes_per_block() > self.rank_bytes:
            raise ValueError(
                f"a block needs {layout.max_bytes_per_block()} bytes, a rank page has "
                f"{self.rank_bytes}"
            )
        dev = torch.device(device) if device is not None else layout.device
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if layout.device != dev:
            raise ValueError(f"layout tensors are on {layout.device}, copier device is {dev}")
        self.device = dev
        self.layout = layout
        self.rank = rank
        self.slot_bytes = slot_bytes
        self.num_slots = mapping.size // slot_bytes
        if self.num_slots == 0:
            raise ValueError("pool smaller than one slot")
        self._mapping = mapping
        self._metrics = get_metrics(registry)
        page_start = rank * self.rank_bytes
        rank_pages = mapping.slot_view(slot_bytes)[:, page_start : page_start + self.rank_bytes]
        # Per group, per region: the (num_blocks, nbytes) KV view and (num_slots, nbytes) pool
        # view. Built once so a job only slices them.
        self._views: list[list[tuple[torch.Tensor, torch.Tensor]]] = [
            [
                (
                    layout.tensors[r.tensor_idx][:, r.offset : r.offset + r.nbytes],
                    rank_pages[:, r.page_offset : r.page_offset + r.nbytes],
                )
                for r in g.regions
            ]
            for g in layout.groups
        ]
        self._inflight: dict[int, _Job] = {}
        self._cuda = dev.type == "cuda"
        self._streams: dict[str, Any] = {}
        self._queue: queue.Queue[_Job | None] | None = None
        self._thread: threading.Thread | None = None
        self._memcpy: _CpuMemcpy | None = None
        if self._cuda:
            self._streams = {STORE: torch.cuda.Stream(dev), LOAD: torch.cuda.Stream(dev)}
        else:
            n = cpu_threads or min(torch.get_num_threads(), os.cpu_count() or 1, 8)
            self._memcpy = _CpuMemcpy(n)
            if cpu_async:
                self._queue = queue.Queue()
                self._thread = threading.Thread(
                    target=self._cpu_worker, name=f"kvoffload-copier-r{rank}", daemon=True
                )
                self._thread.start()
        self._closed = False

    # ---- submission ---------------------------------------------------------------------

    def submit_store(self, job_id: int, items: Iterable[Sequence[int]]) -> bool:
        """Copy KV blocks into pool slots. Returns False if the job was rejected (it is still
        reported by ``get_finished``, with ok=False)."""
        return self._submit(job_id, STORE, items)

    def submit_load(self, job_id: int, items: Iterable[Sequence[int]]) -> bool:
        """Copy pool slots into KV blocks. Same contract as ``submit_store``."""
        return self._submit(job_id, LOAD, items)

    def _submit(self, job_id: int, direction: str, items: Iterable[Sequence[int]]) -> bool:
        if self._closed:
            raise RuntimeError("BlockCopier is closed")
        if job_id in self._inflight:
            # A caller bug: two results with one id could not be told apart.
            raise ValueError(f"job {job_id} is already in flight")
        job = _Job(job_id, direction, [], 0)
        self._inflight[job_id] = job
        checked = self._check_items(items, direction)
        if isinstance(checked, str):
            logger.warning("rejecting %s job %d: %s", direction, job_id, checked)
            self._finish(job, ok=False, seconds=0.0)
            return False
        try:
            job.ops, job.nbytes = self._plan(checked, direction == STORE)
        except Exception:
            logger.exception("planning %s job %d failed", direction, job_id)
            self._finish(job, ok=False, seconds=0.0)
            return False
        if self._cuda:
            self._launch_cuda(job)
        elif self._queue is not None:
            self._queue.put(job)
        else:
            self._run_cpu(job)
        return True

    def _check_items(self, items: Iterable[Sequence[int]], direction: str) -> np.ndarray | str:
        """Validate every item before any byte moves, so a bad job corrupts nothing."""
        try:
            arr = np.asarray(list(items), dtype=np.int64)
        except (TypeError, ValueError, OverflowError) as exc:
            return f"items are not integer triples ({exc})"
        if arr.size == 0:
            return arr.reshape(0, 3)
        if arr.ndim != 2 or arr.shape[1] != 3:
            return f"items must be (group_idx, block_id, slot) triples, got shape {arr.shape}"
        groups, blocks, slots = arr[:, 0], arr[:, 1], arr[:, 2]
        if groups.min() < 0 or groups.max() >= len(self.layout.groups):
            return f"group index outside [0, {len(self.layout.groups)})"
        if blocks.min() < 0 or blocks.max() >= self.layout.num_blocks:
            return f"block id outside [0, {self.layout.num_blocks})"
        if slots.min() < 0 or slots.max() >= self.num_slots:
            return f"slot outside [0, {self.num_slots})"
        # Two items writing the same destination would make the result depend on copy order.
        if direction == STORE and len(np.unique(slots)) != len(slots):
            return "a slot appears twice in one store"
        if direction == LOAD and len(np.unique(arr[:, :2], axis=0)) != len(arr):
            return "a (group, block) appears twice in one load"
        return arr

    def _plan(self, arr: np.ndarray, store: bool) -> tuple[list[CopyOp], int]:
        ops: list[CopyOp] = []
        nbytes = 0
        for g in np.unique(arr[:, 0]).tolist():
            sel = arr[arr[:, 0] == g]
            views = self._views[g]
            for b0, s0, n in block_runs(sel[:, 1], sel[:, 2]):
                for kv_view, pool_view in views:
                    kv = kv_view[b0 : b0 + n]
                    pool = pool_view[s0 : s0 + n]
                    dst, src = (pool, kv) if store else (kv, pool)
                    if not self._cuda or n == 1 or (dst.is_contiguous() and src.is_contiguous()):
                        ops.append((dst, src))
                    else:
                        ops.extend((dst[i], src[i]) for i in range(n))
            nbytes += len(sel) * self.layout.groups[g].bytes_per_block
        return ops, nbytes

    # ---- execution ----------------------------------------------------------------------

    def _launch_cuda(self, job: _Job) -> None:
        stream = self._streams[job.direction]
        try:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            job.start_event = torch.cuda.Event(enable_timing=True)
            job.end_event = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                job.start_event.record(stream)
                for dst, src in job.ops:
                    dst.copy_(src, non_blocking=True)
                job.end_event.record(stream)
        except Exception:
            logger.exception("enqueueing %s job %d failed", job.direction, job.job_id)
            self._finish(job, ok=False, seconds=0.0)
        # Views are only Python handles; the stream keeps no reference to them.
        job.ops = []

    def _run_cpu(self, job: _Job) -> None:
        t0 = time.perf_counter()
        ok = True
        try:
            assert self._memcpy is not None
            self._memcpy.copy(job.ops)
        except Exception:
            logger.exception("%s job %d failed", job.direction, job.job_id)
            ok = False
        job.ops = []
        self._finish(job, ok=ok, seconds=time.perf_counter() - t0)

    def _cpu_worker(self) -> None:
        assert self._queue is not None
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._run_cpu(job)

    def _finish(self, job: _Job, ok: bool, seconds: float) -> None:
        job.result = CopyResult(job.job_id, ok, job.nbytes if ok else 0, seconds)
        job.done.set()

    def _poll(self, job: _Job) -> bool:
        """Whether the job is complete; on CUDA, turns a completed end event into a result."""
        if job.done.is_set():
            return True
        if not self._cuda:
            return False
        try:
            if not job.end_event.query():
                return False
            seconds = job.start_event.elapsed_time(job.end_event) / 1000.0
            self._finish(job, ok=True, seconds=seconds)
        except Exception:
            logger.exception("%s job %d failed on the device", job.direction, job.job_id)
            self._finish(job, ok=False, seconds=0.0)
        return True

    # ---- completion ---------------------------------------------------------------------

    def get_finished(self) -> list[CopyResult]:
        """Results of jobs finished since the last call, in submission order. Never raises."""
        out: list[CopyResult] = []
        for job_id, job in list(self._inflight.items()):
            if not self._poll(job):
                continue
            del self._inflight[job_id]
            assert job.result is not None
            out.append(job.result)
            self._metrics.copy_jobs.labels(job.direction, "ok" if job.result.ok else "failed").inc()
            if job.result.ok:
                self._metrics.copy_bytes.labels(job.direction).inc(job.result.nbytes)
        return out

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs are complete (results still come from get_finished)."""
        for job_id in job_ids:
            job = self._inflight.get(job_id)
            if job is None or job.done.is_set():
                continue
            if self._cuda and job.end_event is not None:
                try:
                    job.end_event.synchronize()
                except Exception:
                    logger.exception("waiting for job %d failed", job_id)
                self._poll(job)
            else:
                job.done.wait()

    def close(self) -> None:
        """Finish queued work and drop the pool views (so the mapping can be unmapped).
        Results of finished jobs stay available to ``get_finished``."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None and self._queue is not None:
            self._queue.put(None)
            self._thread.join()
        for stream in self._streams.values():
            stream.synchronize()
        if self._memcpy is not None:
            self._memcpy.close()
        self._views = []

    def __enter__(self) -> BlockCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
