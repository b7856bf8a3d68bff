"""The CPU copy executor: a job's views as memcpy pieces over a few threads (see
``CpuMemcpy``), and transparent huge pages for the KV tensors (``KVHugePages``). Used by
``BlockCopier``'s CPU lanes; CUDA jobs go through cuda.py."""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from kvoffload.connector.transfer.plan import SegmentWork, Unit, copy_units, pieces

logger = logging.getLogger("kvoffload.connector")

_CHUNK_BYTES = 1 << 20  # CPU work unit: big enough to amortize ~1 us of Python per piece


class CpuMemcpy:
    """Runs a job as ~1 MiB memcpy pieces (``np.copyto``: a memcpy that releases the GIL) on
    the calling thread and ``threads - 1`` persistent helper threads.

    The job is cut into units of about ``_CHUNK_BYTES`` (a run of blocks, or some layers of one
    block) that every thread pulls from one shared iterator, so a helper that starts late (or
    never gets a core) costs nothing but its share: the caller copies what is left and waits
    only for helpers that took a unit. Two threads matter even on two cores: a 16-token
    shuffled store reaches ~0.75x of one contiguous memcpy from one thread and ~1.0x from two
    (measured in C on this machine), since more misses are in flight. Plain memcpy pieces never
    wait on torch's OpenMP team: with load ~4 on 2 cores, per-row ``copy_`` reached 0.06-0.6
    of a contiguous copy, memcpy pieces 0.7-1.8 of it.

    Helpers are kept off the caller's current CPU (``SpreadHint``): measured here, a helper woken
    by a copying thread was queued on that thread's CPU in about half the jobs and ran only
    once the caller had copied everything (16-token jobs 1.3-1.5x slower).
    """

    def __init__(self, threads: int, name: str = "kvoffload-memcpy",
                 yield_to: PriorityGate | None = None) -> None:
        self.threads = max(1, threads)
        self.yield_to = yield_to  # between units, step aside while it holds expedited work
        self._helpers = [_Helper(f"{name}_{i}") for i in range(self.threads - 1)]
        self._spread = SpreadHint([h.tid for h in self._helpers])

    def copy(self, work: list[SegmentWork], store: bool) -> None:
        items = sum(len(w.blocks) for w in work)
        small = items < 2 and all(w.nbytes <= _CHUNK_BYTES for w in work)
        if not self._helpers or small:
            _copy_units(work, iter(copy_units(work, _CHUNK_BYTES)), store, self.yield_to)
            return
        self._spread.apply()
        # The helpers are woken first: their wake-up (0.1-0.2 ms here: an idle vCPU of this
        # guest halts at once) overlaps the cutting into units (~0.1 ms with cold caches, as
        # after a model step), which they wait for.
        run = _Run(work, store, self.yield_to)
        for helper in self._helpers:
            helper.queue.put(run)
        units: list[Unit] = []
        try:
            try:
                units = copy_units(work, _CHUNK_BYTES)
            finally:
                run.publish(units)  # empty if cutting failed: the helpers return at once
            _copy_units(work, run.units, store, self.yield_to)
        finally:
            # Every piece must have stopped before the job is reported, even a failed one.
            run.close()
        if run.errors:
            raise run.errors[0]

    def close(self) -> None:
        for helper in self._helpers:
            helper.close()


class _Run:
    """One job shared by the caller and its helpers: the units' iterator, and who is copying."""

    def __init__(self, work: list[SegmentWork], store: bool,
                 gate: PriorityGate | None = None) -> None:
        self.work = work
        self.units: Iterator[Unit] = iter(())  # next() on it is atomic under the GIL
        self.ready = threading.Event()  # set once ``units`` holds the job's units
        self.store = store
        self.gate = gate
        self.errors: list[BaseException] = []
        self.copying = _Count()  # helpers inside the run

    def publish(self, units: list[Unit]) -> None:
        self.units = iter(units)
        self.ready.set()

    def join(self) -> bool:
        """A helper's entry: False once the caller has taken every unit and closed the run."""
        return self.copying.enter()

    def leave(self) -> None:
        self.copying.leave()

    def close(self) -> None:
        """The caller's exit: no helper joins after this; waits for those copying."""
        self.copying.wait_zero(close=True)


class _Helper:
    """A persistent copy thread; started when the executor is built, never inside a job."""

    def __init__(self, name: str) -> None:
        self.queue: queue.SimpleQueue[_Run | None] = queue.SimpleQueue()
        started = threading.Event()
        self.tid = 0
        self._thread = threading.Thread(target=self._loop, args=(started,), name=name,
                                        daemon=True)
        self._thread.start()
        started.wait()

    def _loop(self, started: threading.Event) -> None:
        self.tid = threading.get_native_id()
        started.set()
        while (run := self.queue.get()) is not None:
            if not run.join():
                continue  # woken after the caller had finished: nothing left to copy
            try:
                run.ready.wait()
                _copy_units(run.work, run.units, run.store, run.gate)
            except BaseException as exc:  # handed to the caller, which fails the job
                run.errors.append(exc)
            finally:
                run.leave()

    def close(self) -> None:
        self.queue.put(None)
        self._thread.join()


class SpreadHint:
    """Keeps helper threads off the CPU the calling thread runs on (a scheduling hint; the copy
    benchmark's memcpy floor uses it too, so both sides get the same placement).

    Linux tends to queue a thread woken by a running thread on that thread's CPU and, on these
    VMs, left it there while the other core idled (a helper that just ran is "cache hot" to the
    load balancer). Restricting the helpers' affinity to the caller's allowed CPUs minus its
    current one makes the wake-up land elsewhere. It is re-applied only when the caller moved
    (one ``sched_getcpu`` per job otherwise); with one allowed CPU, or where the calls are
    missing, it does nothing. Never an error: a refused call turns the hint off, logged once.
    """

    def __init__(self, tids: list[int]) -> None:
        self._tids = [t for t in tids if t]
        self._last: int | None = None
        self._getcpu: Any = None
        if self._tids and hasattr(os, "sched_setaffinity"):
            try:
                self._getcpu = ctypes.CDLL(None).sched_getcpu
            except (OSError, AttributeError):
                self._getcpu = None

    def apply(self) -> None:
        if self._getcpu is None:
            return
        cpu = int(self._getcpu())
        if cpu == self._last or cpu < 0:
            return
        self._last = cpu
        try:
            allowed = os.sched_getaffinity(0)
            others = allowed - {cpu}
            if not others:
                return
            for tid in self._tids:
                os.sched_setaffinity(tid, others)
        except OSError as exc:
            logger.debug("copy threads keep their CPU affinity: %s", exc)
            self._getcpu = None


class _Count:
    """A count under a condition: ``enter`` (refused once closed), ``leave``, and waiting
    until it is back to zero."""

    def __init__(self) -> None:
        self.value = 0  # read without the lock where a stale read is harmless
        self._closed = False
        self._cond = threading.Condition()

    def enter(self) -> bool:
        with self._cond:
            if self._closed:
                return False
            self.value += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self.value -= 1
            if not self.value:
                self._cond.notify_all()

    def wait_zero(self, close: bool = False) -> None:
        with self._cond:
            self._closed = self._closed or close
            while self.value:
                self._cond.wait()


class PriorityGate(_Count):
    """Expedited jobs in flight, counted from their submission: while any is, the other lanes'
    copy threads stop between two units (each at most ~1 MiB, tens of microseconds) and give
    it the cores (a stale read of the count costs one unit). Measured before it: a 2 MiB
    expedited load behind a 32 MiB store took as long as a regular one (1.17 ms p50, 0.24 ms
    idle), the store's two threads on both cores."""


def _copy_units(work: list[SegmentWork], units: Iterable[Unit], store: bool,
                gate: PriorityGate | None = None) -> None:
    """The units' copies, with as little Python per unit as possible: a 16-token block is a
    ~6 us memcpy on this memory, and every microsecond of Python here holds the GIL that the
    other copy threads need to start theirs (a generator over ``unit_views`` cost 15-20 % of
    the throughput at 16-token shuffled stores)."""
    copyto = np.copyto
    kvs = [w.kv for w in work]
    pools = [w.pool for w in work]
    counts = [int(w.kv.shape[1]) for w in work]
    # A unit is at most _CHUNK_BYTES unless one region alone is larger: those get split.
    wide = [int(w.kv.shape[2]) > _CHUNK_BYTES for w in work]
    for i, b0, s0, n, j0, j1 in units:
        if gate is not None and gate.value:
            gate.wait_zero()
        if n == 1:
            if j0 == 0 and j1 == counts[i]:
                kv, pool = kvs[i][b0], pools[i][s0]
            else:
                kv, pool = kvs[i][b0, j0:j1], pools[i][s0, j0:j1]
        else:
            kv, pool = kvs[i][b0 : b0 + n], pools[i][s0 : s0 + n]
        dst, src = (pool, kv) if store else (kv, pool)
        if not wide[i]:
            copyto(dst, src)
        else:
            for d, s in pieces(dst, src, _CHUNK_BYTES):
                copyto(d, s)


class CpuLane:
    """One thread running one lane's jobs in submission order, with its own helpers.

    A lane outlives the copiers that use it: a worker builds its lanes when it is created, so
    the threads are running before the first step and survive a daemon restart's new copier
    (starting them inside a first job cost ~1 ms of it). With ``gate``, either the lane holds
    it from each job's submission to its end (``priority``: the expedited lane) or its threads
    step aside while someone does."""

    def __init__(self, name: str, threads: int, gate: PriorityGate | None = None,
                 priority: bool = False) -> None:
        self.memcpy = CpuMemcpy(threads, name, yield_to=None if priority else gate)
        self._gate = gate if priority else None
        self._queue: queue.SimpleQueue[tuple[Any, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, run: Any, job: Any) -> None:
        """Run ``run(job, memcpy)`` on this lane's thread after the jobs before it."""
        if self._gate is not None:
            self._gate.enter()  # now, in the submitter: the other lanes yield from here on
        self._queue.put((run, job))

    def _loop(self) -> None:
        while (entry := self._queue.get()) is not None:
            run, job = entry
            try:
                run(job, self.memcpy)
            finally:
                if self._gate is not None:
                    self._gate.leave()

    def close(self) -> None:
        """Finish the queued jobs, then stop the threads."""
        self._queue.put(None)
        self._thread.join()
        self.memcpy.close()


def default_cpu_threads() -> int:
    """Copy threads per lane: the CPUs this process may use (its affinity, which a container's
    cpuset or vLLM's thread binding narrows), at most torch's thread count and 8."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), allowed, 8))


_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1+: collapse already-faulted pages into huge pages, now
_HUGE = 2 << 20
_COLLAPSE_STEP = 32 << 20


class KVHugePages:
    """Backs the CPU KV tensors with 2 MiB transparent huge pages, on a background thread.

    Why: a block of small pages is a few scattered 16 KiB rows per layer; on 4 KiB pages each
    row is four TLB misses and four prefetch restarts, and the copy reaches ~0.65x of one
    contiguous memcpy whatever issues it (measured: numpy, torch ``index_select``, two
    threads). On huge pages the same rows copy at 0.85-0.95x. The pool side cannot have them
    (it is shmem; ``shmem_enabled`` is ``never`` on these machines) but its slot pages are
    contiguous, so they need them less. Anonymous memory gets THP on request when
    ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``.

    ``MADV_HUGEPAGE`` marks the tensors' memory (rounded inward to 2 MiB: never a neighbour's
    pages) and ``MADV_COLLAPSE`` converts what is already faulted in (~0.4 GB/s here, so it runs
    off the caller's thread; copies are correct during and after it: contents are kept). Best
    effort: an old kernel or THP ``never`` leaves 4 KiB pages and logs one debug line. Advising
    the same memory again (a new copier after a daemon restart) costs microseconds.
    """

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self.ranges = ranges
        self.collapsed_bytes = 0
        self.seconds: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvoffload-kv-thp", daemon=True)
        self._thread.start()

    @classmethod
    def for_tensors(cls, tensors: Iterable[torch.Tensor]) -> KVHugePages | None:
        """The task advising these CPU tensors' storages (None: nothing 2 MiB-sized)."""
        spans: dict[int, int] = {}
        for t in tensors:
            if t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            spans[st.data_ptr()] = max(spans.get(st.data_ptr(), 0), st.nbytes())
        ranges = [(lo, hi) for start, n in sorted(spans.items())
                  if (hi := (start + n) & ~(_HUGE - 1)) > (lo := (start + _HUGE - 1) & ~(_HUGE - 1))]
        if not ranges:
            return None
        return cls(ranges)

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            for lo, hi in self.ranges:
                if libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
                    logger.debug("MADV_HUGEPAGE refused (errno %d)", ctypes.get_errno())
                    continue
                # By 32 MiB, then by 2 MiB where a piece fails: a range not faulted in yet is
                # refused (EINVAL) but its pages will come huge when first touched.
                for a in range(lo, hi, _COLLAPSE_STEP):
                    b = min(a + _COLLAPSE_STEP, hi)
                    if libc.madvise(a, b - a, _MADV_COLLAPSE) == 0:
                        self.collapsed_bytes += b - a
                        continue
                    for c in range(a, b, _HUGE):
                        if libc.madvise(c, _HUGE, _MADV_COLLAPSE) == 0:
                            self.collapsed_bytes += _HUGE
        except (OSError, AttributeError) as exc:
            logger.debug("no huge pages for the KV tensors: %s", exc)
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()
            logger.info("kvoffload: KV tensors on huge pages: %d MiB collapsed in %.2f s",
                        self.collapsed_bytes >> 20, self.seconds)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)
