"""Worker side of the plugin: vLLM's ``OffloadingWorker`` over our ``BlockCopier``.

Workers never talk to the daemon. Every job's ``PoolSlotsSpec`` (built by the scheduler-side
manager) says which pool slots to use and which pool they are in; the worker maps that pool
once (pinned with cudaHostRegister where CUDA exists) and copies this rank's page of each slot.
A restarted daemon has a new ``daemon_id``, and the next job maps its pool afresh.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvoffload.connector.copier import (
    BlockCopier,
    CopyResult,
    items_for_groups,
    layout_from_canonical,
)
from kvoffload.connector.pool_map import PoolMapping
from vllm.v1.kv_offload.base import (  # type: ignore[import-untyped]
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

log = logging.getLogger("kvoffload.connector.vllm")


@dataclass(frozen=True)
class PoolInfo:
    """The daemon's pool as this engine is registered with it."""

    daemon_id: str
    pool_path: str
    pool_bytes: int
    slot_bytes: int  # one pool slot: every rank's page of one key
    rank_bytes: int


class PoolSlotsSpec(LoadStoreSpec):  # type: ignore[misc]
    """Where the blocks of one transfer job live in the daemon's pool (small, picklable).

    ``slots[i]`` belongs to the i-th key of the job; vLLM lists keys in the same order as the
    GPU blocks of the job's ``GPULoadStoreSpec`` (group by group, one block per key). A slot of
    -1 means "copy nothing for this block": a store the daemon refused or could not be asked.
    """

    def __init__(self, slots: list[int], pool: PoolInfo | None) -> None:
        self.slots = slots
        self.pool = pool

    def __repr__(self) -> str:
        return f"PoolSlotsSpec(slots={self.slots})"


class DaemonOffloadingWorker(OffloadingWorker):  # type: ignore[misc]
    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        rank: int,
        tp_world_size: int,
        *,
        cpu_async: bool = True,
    ) -> None:
        self.layout = layout_from_canonical(kv_caches)
        self.rank = rank
        self.tp_world_size = tp_world_size
        self.cpu_async = cpu_async
        self._pool: PoolInfo | None = None
        self._mapping: PoolMapping | None = None
        self._copier: BlockCopier | None = None
        self._done: list[TransferResult] = []  # jobs with nothing to copy, and drained jobs

    def _copier_for(self, pool: PoolInfo) -> BlockCopier:
        if self._copier is not None and self._pool == pool:
            return self._copier
        self._close_copier()
        log.info("kvoffload worker rank %d: mapping pool %s (daemon %s)", self.rank,
                 pool.pool_path, pool.daemon_id)
        self._mapping = PoolMapping(pool.pool_path, pool.pool_bytes)
        self._copier = BlockCopier(self._mapping, self.layout, self.rank, self.tp_world_size,
                                   pool.slot_bytes, self.layout.device,
                                   cpu_async=self.cpu_async)
        self._pool = pool
        return self._copier

    def _close_copier(self) -> None:
        """Finish every job of the old pool before unmapping it (results are kept)."""
        if self._copier is None:
            return
        self._copier.close()  # finishes queued and in-flight copies
        self._done.extend(self._result(r) for r in self._copier.get_finished())
        self._copier = None
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

    @staticmethod
    def _result(r: CopyResult) -> TransferResult:
        if not r.ok:
            log.error("kvoffload copy job %d failed", r.job_id)
        return TransferResult(job_id=r.job_id, success=r.ok, transfer_size=r.nbytes,
                              transfer_time=r.seconds)

    def _submit(self, job_id: int, gpu: GPULoadStoreSpec, pool_spec: LoadStoreSpec,
                store: bool) -> bool:
        assert isinstance(pool_spec, PoolSlotsSpec), f"not our spec: {pool_spec!r}"
        items = [it for it in items_for_groups(gpu.block_ids, gpu.group_sizes, pool_spec.slots)
                 if it[2] >= 0]
        if not items or pool_spec.pool is None:
            self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=0,
                                             transfer_time=0.0))
            return True
        copier = self._copier_for(pool_spec.pool)
        # A job the copier rejects (a slot or block id out of range: a bug, never a daemon
        # fault) is still reported by get_finished, as failed; vLLM then stops loudly rather
        # than run on wrong KV. Submission itself always succeeded.
        if store:
            copier.submit_store(job_id, items)
        else:
            copier.submit_load(job_id, items)
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        # Loads have their own copy stream in BlockCopier: an expedited load never queues
        # behind a store.
        return self._submit(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        out, self._done = self._done, []
        if self._copier is not None:
            out.extend(self._result(r) for r in self._copier.get_finished())
        return out

    def wait(self, job_ids: set[int]) -> None:
        if self._copier is not None:
            self._copier.wait(job_ids)

    def shutdown(self) -> None:
        self._close_copier()

