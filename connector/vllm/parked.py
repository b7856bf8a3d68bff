"""Store jobs parked until the daemon hands their earmarked slots over (``worker.py``).

An earmarked grant (a slot that still holds a READY block) may be written only once the shared
index shows the granted generation; until then it shows the one before. A store job with such
a slot is parked here, holding no lock and having copied nothing, and is tried again -- through
the worker's ordinary store path -- once no slot of it is waiting any more, or once its deadline
(``stamp + HANDOVER_WAIT_S``) has passed. ``take_due`` never blocks (vLLM's ``get_finished``,
on the step); ``take_waited`` polls for the jobs vLLM's ``wait`` needs (GPU blocks about to be
reused), bounded by their deadlines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np
from kvoffload.connector.vllm.load_spec import PoolInfo
from kvoffload.daemon.store.shared_index import HANDOVER_WAIT_S

POLL_FIRST_S = 1e-4  # the first sleep of take_waited's poll
POLL_MAX_S = 2e-3  # doubled up to this


class ParkedStore(NamedTuple):
    """What the worker's store path needs to try the job again."""

    job_id: int
    items: np.ndarray  # (group, block, slot) rows
    gens: np.ndarray  # the grants' generations, one per row
    pool: PoolInfo
    lock: str
    stamp: float  # time.monotonic() when the manager took the slots

    @property
    def deadline(self) -> float:
        return self.stamp + HANDOVER_WAIT_S


class ParkedStores:
    """``waiting(job)``: whether some placed slot of ``job`` is not handed over yet."""

    def __init__(self, waiting: Callable[[ParkedStore], bool]) -> None:
        self._waiting = waiting
        self._jobs: dict[int, ParkedStore] = {}  # in parking order

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def park(self, job: ParkedStore) -> None:
        self._jobs[job.job_id] = job

    def _due(self, job: ParkedStore, now: float) -> bool:
        return now >= job.deadline or not self._waiting(job)

    def take_due(self) -> list[ParkedStore]:
        """The parked jobs to try now (no slot waiting, or past the deadline), unparked."""
        if not self._jobs:
            return []
        now = time.monotonic()
        due = [job for job in self._jobs.values() if self._due(job, now)]
        for job in due:
            del self._jobs[job.job_id]
        return due

    def take_waited(self, job_ids: Iterable[int]) -> list[ParkedStore]:
        """Wait until each parked job among ``job_ids`` is due, then unpark and return them.

        Short sleeps, 0.1 ms doubling to 2 ms: a handover comes within milliseconds of the
        daemon handling the claim, and the wait never outlasts the jobs' deadlines."""
        pending = [self._jobs[j] for j in job_ids if j in self._jobs]
        due: list[ParkedStore] = []
        sleep = POLL_FIRST_S
        while pending:
            now = time.monotonic()
            still: list[ParkedStore] = []
            for job in pending:
                (due if self._due(job, now) else still).append(job)
            pending = still
            if pending:
                time.sleep(sleep)
                sleep = min(2 * sleep, POLL_MAX_S)
        for job in due:
            del self._jobs[job.job_id]
        return due

    def clear(self) -> None:
        self._jobs.clear()
