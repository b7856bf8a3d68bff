"""The copy engine's base types: a job's result, the geometry check every copier (and the
vLLM worker, at creation) runs, and the stand-in for a copier that could not be built."""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import NamedTuple

import numpy as np
from kvoffload.connector.transfer.layout import KVLayout


class GeometryError(ValueError):
    """This engine's KV layout cannot use the pool's slots (a one-line reason)."""


class CopyResult(NamedTuple):
    job_id: int
    ok: bool
    nbytes: int  # bytes this rank moved (0 for a failed job)
    seconds: float


def check_geometry(layout: KVLayout, rank: int, tp_world_size: int, slot_bytes: int,
                   pool_bytes: int | None = None) -> str | None:
    """Why this layout cannot copy into ``slot_bytes`` slots, or None when it can."""
    if tp_world_size <= 0 or not 0 <= rank < tp_world_size:
        return f"rank {rank} is outside a world of {tp_world_size} ranks"
    if slot_bytes <= 0 or slot_bytes % tp_world_size:
        return (f"slot size {slot_bytes} B (--slot-bytes) is not a positive multiple of the "
                f"{tp_world_size} ranks sharing a slot")
    rank_bytes = slot_bytes // tp_world_size
    for g, need in enumerate(layout.bytes_per_block()):
        if need > rank_bytes:
            return (f"KV group {g} needs {need} B per block on rank {rank}, but a rank page is "
                    f"{rank_bytes} B ({slot_bytes} B slots over {tp_world_size} ranks; with "
                    f"uneven pipeline stages the slot must fit the largest stage)")
    if pool_bytes is not None and pool_bytes < slot_bytes:
        return f"the pool ({pool_bytes} B) is smaller than one {slot_bytes} B slot"
    return None


class RefusedCopier:
    """Stands in for a copier that could not be built (bad geometry, pool file missing): every
    job is reported failed by ``get_finished``; nothing raises into the engine's step."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.expedited_jobs: Container[int] = frozenset()
        self._results: list[CopyResult] = []

    def _refuse(self, job_id: int) -> bool:
        self._results.append(CopyResult(job_id, False, 0, 0.0))
        return False

    def submit_store(self, job_id: int, items: Iterable[Sequence[int]] | np.ndarray) -> bool:
        return self._refuse(job_id)

    def submit_load(self, job_id: int, items: Iterable[Sequence[int]],
                    expedited: bool = False) -> bool:
        return self._refuse(job_id)

    def get_finished(self) -> list[CopyResult]:
        out, self._results = self._results, []
        return out

    def wait(self, job_ids: Iterable[int]) -> None:
        return None

    def close(self) -> None:
        return None
