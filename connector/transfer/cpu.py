"""The CPU copy executor: a job's views as memcpy pieces over a few threads (see
``CpuMemcpy``), and transparent huge pages for the KV tensors (``KVHugePages``). Used by
``BlockCopier``'s CPU lanes; CUDA jobs go through copy_cuda.py."""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from kvoffload.connector.transfer.plan import SegmentWork, Unit, copy_units, pieces

logger = logging.getLogger("kvoffload.connector")

_CHUNK_BYTES = 1 << 20  # CPU work unit: big enough to amortize ~1 us of Python per piece


class CpuMemcpy:
    """Runs a job as ~1 MiB memcpy pieces (``np.copyto``: a memcpy that releases the GIL) over
    ``threads`` threads: the caller and ``threads - 1`` helpers.

    The job is cut into units of about ``_CHUNK_BYTES`` (a run of blocks, or some layers of one
    block) dealt round-robin; each thread makes its own views and copies them, so the Python
    cost of a view (about 1 us) overlaps the other threads' copies. Two threads matter even on
    two cores: scattered 16 KiB rows reach ~15 GB/s from one thread and ~20 from two here (more
    misses in flight), against ~22 for one contiguous memcpy. Plain memcpy pieces never wait on
    torch's OpenMP team: with load ~4 on 2 cores, per-row ``copy_`` reached 0.06-0.6 of a
    contiguous copy, memcpy pieces 0.7-1.8 of it.
    """

    def __init__(self, threads: int, name: str = "kvoffload-memcpy") -> None:
        self.threads = max(1, threads)
        self._pool = (ThreadPoolExecutor(self.threads - 1, thread_name_prefix=name)
                      if self.threads > 1 else None)
        for _ in range(self.threads - 1):  # start the helpers now, not inside a first job
            assert self._pool is not None
            self._pool.submit(time.sleep, 0.001)

    def copy(self, work: list[SegmentWork], store: bool) -> None:
        units = copy_units(work, _CHUNK_BYTES)
        if self._pool is None or len(units) < 2:
            _copy_units(work, units, store)
            return
        futures = [self._pool.submit(_copy_units, work, units[i :: self.threads], store)
                   for i in range(1, self.threads)]
        try:
            _copy_units(work, units[:: self.threads], store)
        finally:
            # Every piece must have stopped before the job is reported, even a failed one.
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _copy_units(work: list[SegmentWork], units: list[Unit], store: bool) -> None:
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
    """One thread running one lane's jobs in submission order."""

    def __init__(self, name: str, threads: int, run: Any) -> None:
        self.memcpy = CpuMemcpy(threads, name)
        self._run = run
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, job: Any) -> None:
        self._queue.put(job)

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            self._run(job, self.memcpy)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.memcpy.close()


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
