"""Moves KV blocks between an engine's KV tensors and its page of the shared pool.

One job is a list of ``(group_idx, block_id, slot)`` items: a store copies block ``block_id``
of group ``group_idx`` into this rank's page of pool slot ``slot``; a load copies it back.
Slot layout (see ``layout.py``): rank ``r``'s page starts at ``r * rank_bytes`` inside the slot
(``rank_bytes = slot_bytes // tp_world_size``); the group's block is the concatenation of its
regions from the page start.

Both devices share the planning (plan.py): items are validated (a bad job copies nothing
and is reported ``ok=False``), grouped per KV group and per ``Segment`` (the regions one strided
view covers: usually every layer of the group), so a job is a handful of 3-D views, not one
copy per block and layer. Jobs run on three lanes, so an expedited load never waits behind
regular loads or stores, and loads never wait behind stores:

* CUDA: one stream per lane (the expedited one at high priority). Each job first makes its
  stream wait on the caller's current stream (a store must not read KV the compute stream has
  not finished writing; a load must not race earlier writes such as the zeroing of a fresh
  block): a stream-to-stream dependency, not a host sync. The copies are one
  ``cuMemcpyBatchAsync`` per job where the driver has it, else device gathers (cuda.py).
  Completion and timing come from a pair of CUDA events per job.
* CPU: KV tensors onto huge pages at construction (cpu.KVHugePages); one thread per lane,
  copying ~1 MiB memcpy pieces (numpy views; a memcpy that releases the GIL) that it and its
  helper threads pull from one shared list (cpu.CpuMemcpy), the helpers kept off its CPU
  (cpu.SpreadHint). Lanes can outlive a copier (``build_cpu_lanes``: a worker starts them at
  creation). Not ``Tensor.copy_`` (it forks and joins torch's OpenMP team, which stalls
  whenever another process holds a core) nor ``index_copy_`` (int8 rows element by element:
  2 GB/s against 20). ``cpu_async=False`` copies inside ``submit_*`` (simplest in tests).

Nothing raises out of ``submit_*`` or ``get_finished`` for a job: a job that cannot be copied
becomes ``CopyResult(ok=False)``. An impossible geometry raises ``GeometryError`` (one line) when
the copier is built, i.e. at registration, never inside a step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.ma  # noqa: F401  np.unique imports it lazily: ~10 ms that would land on a first job
import torch
from kvoffload.connector.metrics import get_metrics
from kvoffload.connector.transfer.base import (
    CopyResult,
    GeometryError,
    RefusedCopier,
    check_geometry,
)
from kvoffload.connector.transfer.cpu import (
    CpuLane,
    CpuMemcpy,
    KVHugePages,
    PriorityGate,
    default_cpu_threads,
)
from kvoffload.connector.transfer.cuda import CudaLauncher
from kvoffload.connector.transfer.layout import (
    KVLayout,
    group_bytes_per_block,
    items_for_groups,
    layout_from_canonical,
)
from kvoffload.connector.transfer.plan import SegmentViews, SegmentWork, plan_work, segment_views
from kvoffload.connector.transfer.pool_map import MappingTask, PoolMapping

__all__ = [
    "BlockCopier",
    "CpuLane",
    "CopyResult",
    "GeometryError",
    "KVLayout",
    "MappingTask",
    "PoolMapping",
    "RefusedCopier",
    "build_cpu_lanes",
    "check_geometry",
    "group_bytes_per_block",
    "items_for_groups",
    "layout_from_canonical",
]

logger = logging.getLogger("kvoffload.connector")

STORE = "store"
LOAD = "load"
EXPEDITED = "expedited"  # the lane of expedited loads (direction LOAD)
LANES = (STORE, LOAD, EXPEDITED)


def build_cpu_lanes(rank: int = 0, threads: int | None = None) -> dict[str, CpuLane]:
    """The CPU lanes (threads started now) that one or more successive copiers can share; the
    store and load lanes step aside while an expedited load is in flight (cpu.PriorityGate)."""
    n = threads or default_cpu_threads()
    gate = PriorityGate()
    return {lane: CpuLane(f"kvoffload-{lane}-r{rank}", n, gate, priority=lane == EXPEDITED)
            for lane in LANES}


@dataclass
class _Job:
    job_id: int
    direction: str  # STORE or LOAD
    lane: str
    work: list[SegmentWork]
    nbytes: int
    done: threading.Event = field(default_factory=threading.Event)
    result: CopyResult | None = None
    start_event: Any = None  # CUDA timing events
    end_event: Any = None


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
        cuda_backend: str = "auto",
        kv_huge_pages: bool = True,
        cpu_lanes: dict[str, CpuLane] | None = None,
    ) -> None:
        reason = check_geometry(layout, rank, tp_world_size, slot_bytes, mapping.size)
        if reason is not None:
            raise GeometryError(reason)
        dev = torch.device(device) if device is not None else layout.device
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if layout.device != dev:
            raise GeometryError(f"layout tensors are on {layout.device}, copier device is {dev}")
        self.device = dev
        self.layout = layout
        self.rank = rank
        self.slot_bytes = slot_bytes
        self.rank_bytes = slot_bytes // tp_world_size
        self.num_slots = mapping.size // slot_bytes
        self._mapping = mapping
        self._metrics = get_metrics(registry)
        start = rank * self.rank_bytes
        pages = mapping.slot_view(slot_bytes)[:, start : start + self.rank_bytes]
        self._cuda = dev.type == "cuda"
        self._views: SegmentViews = [[self._native(kv, pool) for kv, pool in segs]
                                     for segs in segment_views(layout, pages)]
        self._inflight: dict[int, _Job] = {}
        self._rejected: list[CopyResult] = []  # jobs that never got an in-flight entry
        self._streams: dict[str, Any] = {}
        self._lanes: dict[str, CpuLane] = {}
        self._own_lanes = False  # lanes handed in (a worker's) outlive this copier
        self._sync_memcpy: CpuMemcpy | None = None
        self._launcher: CudaLauncher | None = None
        # CPU KV tensors onto huge pages, in the background (cpu.KVHugePages: why).
        self.huge_pages = (KVHugePages.for_tensors(layout.tensors)
                           if kv_huge_pages and not self._cuda else None)
        if self._cuda:
            self._launcher = CudaLauncher(dev, cuda_backend)
            self._streams = {STORE: torch.cuda.Stream(dev), LOAD: torch.cuda.Stream(dev),
                             EXPEDITED: torch.cuda.Stream(dev, priority=-1)}
        else:
            if cpu_async and cpu_lanes is not None:
                self._lanes = cpu_lanes
            elif cpu_async:
                self._lanes, self._own_lanes = build_cpu_lanes(rank, cpu_threads), True
            else:
                self._sync_memcpy = CpuMemcpy(cpu_threads or default_cpu_threads())
        # Ids of load jobs to expedite, for a caller whose submit path cannot pass the flag
        # (the vLLM worker sets it to the set its submit_load fills).
        self.expedited_jobs: Container[int] = frozenset()
        self._closed = False

    def _native(self, kv: torch.Tensor, pool: torch.Tensor) -> tuple[Any, Any]:
        """CPU views as numpy arrays of the same memory: indexing a numpy array costs ~0.2 us
        against ~1.5 us for a tensor, which at 16-token pages is most of a block's copy time."""
        return (kv, pool) if self._cuda else (kv.numpy(), pool.numpy())

    @property
    def cuda_backend(self) -> str | None:
        return self._launcher.backend if self._launcher is not None else None

    # ---- submission ---------------------------------------------------------------------

    def submit_store(self, job_id: int, items: Iterable[Sequence[int]] | np.ndarray) -> bool:
        """Copy KV blocks into pool slots. Returns False if the job was rejected (it is still
        reported by ``get_finished``, with ok=False). Never raises for a job."""
        return self._submit(job_id, STORE, STORE, items)

    def submit_load(self, job_id: int, items: Iterable[Sequence[int]] | np.ndarray,
                    expedited: bool = False) -> bool:
        """Copy pool slots into KV blocks. Same contract as ``submit_store``; an expedited
        load (``expedited=True``, or its id in ``expedited_jobs``) runs on its own lane, never
        behind regular loads or stores."""
        fast = expedited or job_id in self.expedited_jobs
        return self._submit(job_id, LOAD, EXPEDITED if fast else LOAD, items)

    def _submit(self, job_id: int, direction: str, lane: str,
                items: Iterable[Sequence[int]] | np.ndarray) -> bool:
        if self._closed or job_id in self._inflight:
            # A caller bug (two results with one id could not be told apart), or a job after
            # shutdown: reported as failed, never raised into the engine's step.
            why = "the copier is closed" if self._closed else "its job id is already in flight"
            logger.error("rejecting %s job %d: %s", direction, job_id, why)
            self._rejected.append(CopyResult(job_id, False, 0, 0.0))
            return False
        job = _Job(job_id, direction, lane, [], 0)
        self._inflight[job_id] = job
        checked = self._check_items(items, direction)
        if isinstance(checked, str):
            logger.warning("rejecting %s job %d: %s", direction, job_id, checked)
            self._finish(job, ok=False, seconds=0.0)
            return False
        try:
            job.work = self._plan(checked, direction == STORE)
            job.nbytes = sum(w.nbytes for w in job.work)
        except Exception:
            logger.exception("planning %s job %d failed", direction, job_id)
            self._finish(job, ok=False, seconds=0.0)
            return False
        if self._cuda:
            self._launch_cuda(job)
        elif self._lanes:
            self._lanes[lane].put(self._run_cpu, job)
        else:
            assert self._sync_memcpy is not None
            self._run_cpu(job, self._sync_memcpy)
        return True

    def _check_items(self, items: Iterable[Sequence[int]] | np.ndarray, direction: str
                     ) -> np.ndarray | str:
        """Validate every item before any byte moves, so a bad job corrupts nothing. Vectorized
        (an ``(n, 3)`` array passes without a copy): it runs on the engine's step."""
        try:
            arr = np.asarray(items if isinstance(items, np.ndarray) else list(items),
                             dtype=np.int64)
        except (TypeError, ValueError, OverflowError) as exc:
            return f"items are not integer triples ({exc})"
        if arr.size == 0:
            return arr.reshape(0, 3)
        if arr.ndim != 2 or arr.shape[1] != 3:
            return f"items must be (group_idx, block_id, slot) triples, got shape {arr.shape}"
        bounds = np.array([len(self.layout.groups), self.layout.num_blocks, self.num_slots])
        if bool((arr < 0).any()) or bool((arr >= bounds).any()):
            col = int(np.flatnonzero(((arr < 0) | (arr >= bounds)).any(axis=0))[0])
            what = ("group index", "block id", "slot")[col]
            return f"{what} outside [0, {int(bounds[col])})"
        # Two items writing the same destination would make the result depend on copy order.
        # One sort serves the check and the plan: stores copy in slot order (the pool written
        # front to back), loads in (group, block) order.
        dest = arr[:, 2] if direction == STORE else arr[:, 0] * self.layout.num_blocks + arr[:, 1]
        order = np.argsort(dest, kind="stable")
        ordered = dest[order]
        if bool((ordered[1:] == ordered[:-1]).any()):
            return ("a slot appears twice in one store" if direction == STORE
                    else "a (group, block) appears twice in one load")
        return arr[order]

    def _plan(self, arr: np.ndarray, store: bool) -> list[SegmentWork]:
        # ``arr`` comes sorted from _check_items: slot order for stores, block order for loads.
        return plan_work(self._views, arr, by_slot=store, presorted=True)

    # ---- execution ----------------------------------------------------------------------

    def _launch_cuda(self, job: _Job) -> None:
        assert self._launcher is not None
        stream = self._streams[job.lane]
        try:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            job.start_event = torch.cuda.Event(enable_timing=True)
            job.end_event = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                job.start_event.record(stream)
                self._launcher.launch(job.work, job.direction == STORE, stream)
                job.end_event.record(stream)
        except Exception:
            logger.exception("enqueueing %s job %d failed", job.direction, job.job_id)
            self._finish(job, ok=False, seconds=0.0)
        # Views are only Python handles; the stream keeps no reference to them.
        job.work = []

    def _run_cpu(self, job: _Job, memcpy: CpuMemcpy) -> None:
        t0 = time.perf_counter()
        ok = True
        try:
            memcpy.copy(job.work, job.direction == STORE)
        except Exception:
            logger.exception("%s job %d failed", job.direction, job.job_id)
            ok = False
        job.work = []
        self._finish(job, ok=ok, seconds=time.perf_counter() - t0)

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
        out, self._rejected = self._rejected, []
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
        if self._own_lanes:
            for lane in self._lanes.values():
                lane.close()
        for job in self._inflight.values():  # shared lanes: wait for this copier's jobs
            if not self._cuda:
                job.done.wait()
        for stream in self._streams.values():
            stream.synchronize()
        if self._sync_memcpy is not None:
            self._sync_memcpy.close()
        self._views = []

    def __enter__(self) -> BlockCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
