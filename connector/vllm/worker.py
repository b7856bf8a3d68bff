"""Worker side of the plugin: vLLM's ``OffloadingWorker`` over our ``BlockCopier``.

Workers never talk to the daemon. Every job's ``PoolSlotsSpec`` (built by the scheduler-side
manager) says which pool slots to use, at which writer generation, and which pool they are in;
the worker maps that pool once (pinned with cudaHostRegister where CUDA exists) and copies this
rank's page of each slot. A restarted daemon has a new ``daemon_id``, and the next job maps its
pool afresh.

A load is used only if it provably read the block the manager saw: before and after the copy,
every slot's ident word (generation and key tag) in the daemon's shared index must still be the
one in the spec (a slot handed to another writer, or an index a newer daemon superseded, fails
it). A store is written only under its session's writers' lock (``connector/writer_lock.py``),
taken before the generation pre-check and dropped once the copy is complete, so the daemon can
never hand a slot we may still write to another writer; after the copy the generations are
checked again, and a store revoked meanwhile is counted (the daemon refuses its commit). A failed load is
never reported as a success with bytes it did not have: under ``KVOffloadConnector`` the job
completes and its request goes to vLLM's load-failure path (recompute, or fail the request, per
``kv_load_failure_policy``); under vLLM's stock connector, which cannot take load failures, the
job is reported failed and vLLM stops the engine rather than run on wrong KV.

An earmarked store slot (granted while it still holds a READY block, ``daemon/store/
earmarks.py``) shows the generation one below the grant's until the daemon hands it over (no
reader can load the old block any more). Such a store job is parked (``parked.py``): no lock,
no copy, ``submit_store`` returns at once. It is tried again through the path above when no
slot of it is waiting any more (``get_finished``, every step; ``wait``, which vLLM calls for
GPU blocks about to be reused, polls for it), or once ``stamp + HANDOVER_WAIT_S`` has passed:
then its slots still one below fail the pre-check and are not written. Giving up is safe: the
daemon hands over no later than ``stamp + HANDOVER_S``, earlier than our deadline, and burns
the grant otherwise (its generation skips the granted one), so such a slot is never written
by anyone for this grant and its commit is refused.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from kvoffload.connector.index_view import IndexGone, SlotGenerations
from kvoffload.connector.transfer.cpu import KVHugePages
from kvoffload.connector.transfer.engine import (
    BlockCopier,
    CopyResult,
    CpuLane,
    GeometryError,
    MappingTask,
    RefusedCopier,
    build_cpu_lanes,
    check_geometry,
    items_for_groups,
    layout_from_canonical,
)
from kvoffload.connector.transfer.pool_map import PoolMapping
from kvoffload.connector.vllm.load_spec import PoolInfo, PoolSlotsSpec
from kvoffload.connector.vllm.parked import ParkedStore, ParkedStores
from kvoffload.connector.writer_lock import WriterLocks
from kvoffload.daemon.store.shared_index import HANDOVER_WAIT_S
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

log = logging.getLogger("kvoffload.connector.vllm")


class DaemonOffloadingWorker(OffloadingWorker):
    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        rank: int,
        tp_world_size: int,
        *,
        cpu_async: bool = True,
        reports_load_errors: bool = False,
        pool_path: str | None = None,
        slot_bytes: int | None = None,
    ) -> None:
        # True under KVOffloadConnector, which hands failed requests to vLLM's load-failure
        # path; vLLM's stock connector can only be told that a job failed.
        self.reports_load_errors = reports_load_errors
        self.failed_requests: set[str] = set()
        self._gens: SlotGenerations | None = None
        self._gens_path = ""
        # Load jobs to verify once copied: job -> (request, expedited, slots, idents).
        self._verify: dict[int, tuple[str | None, bool, np.ndarray, np.ndarray]] = {}
        # Store jobs in flight: job -> (lock path, slots, generations).
        self._stores: dict[int, tuple[str, np.ndarray, np.ndarray]] = {}
        self.locks = WriterLocks()
        self.stores_revoked = 0  # store jobs whose slots were revoked during the copy
        # Store jobs waiting for an earmarked slot's handover (parked.py).
        self._parked = ParkedStores(self._still_waiting)
        self.stores_parked = 0  # store jobs parked at submission
        self.stores_handover_timeouts = 0  # store jobs with slots not handed over in time
        self.layout = layout_from_canonical(kv_caches)
        self.rank = rank
        self.tp_world_size = tp_world_size
        self.cpu_async = cpu_async
        self._pool: PoolInfo | None = None
        self._mapping: PoolMapping | None = None
        self._copier: BlockCopier | RefusedCopier | None = None
        self._done: list[TransferResult] = []  # jobs with nothing to copy, and drained jobs
        self._expedited: set[int] = set()  # load jobs the copier runs on its expedited lane
        # Refuse at registration, in one line, a geometry no slot can hold (when known now).
        reason = check_geometry(self.layout, rank, tp_world_size, slot_bytes) if slot_bytes else None
        if reason is not None:
            raise GeometryError(f"kvoffload worker rank {rank}: {reason}")
        # Map, pre-fault and pin the pool now, off the step path, when its path is known
        # (kvoffload_pool_path); otherwise the first job maps it (and waits for it).
        self._task: MappingTask | None = (
            MappingTask(pool_path, label=f" worker rank {rank}", device=self.layout.device)
            if pool_path else None)
        # CPU KV tensors onto huge pages now, in the background too (transfer/cpu.py KVHugePages).
        cpu = self.layout.device.type == "cpu"
        self._huge_pages = KVHugePages.for_tensors(self.layout.tensors) if cpu else None
        # The copy threads start now too, and serve every copier this worker builds (a
        # restarted daemon's pool gets a new copier, not new threads).
        self._lanes: dict[str, CpuLane] | None = (
            build_cpu_lanes(rank) if cpu and cpu_async else None)

    def _copier_for(self, pool: PoolInfo) -> BlockCopier | RefusedCopier:
        """The copier for ``pool``; never raises (a pool it cannot use fails every job)."""
        if self._copier is not None and self._pool == pool:
            return self._copier
        # A restarted daemon that reopened the same file (device, inode) keeps the mapping.
        task = self._task
        keep = task is not None and task.serves(pool.pool_path, pool.pool_bytes)
        if keep and self._copier is not None:
            self._copier.close()  # finishes queued and in-flight copies; results are kept
            self._done.extend(self._result(r) for r in self._copier.get_finished())
            self._copier = None
        self._close_copier()  # unmaps the old pool, if it is another file
        if not keep:
            if task is not None:
                task.close()
            log.info("kvoffload worker rank %d: mapping pool %s (daemon %s)", self.rank,
                     pool.pool_path, pool.daemon_id)
            task = self._task = MappingTask(pool.pool_path, pool.pool_bytes,
                                            label=f" worker rank {self.rank}",
                                            device=self.layout.device)
        assert task is not None
        try:
            self._mapping = task.wait_ready()  # at once when mapped at creation
            self._copier = BlockCopier(self._mapping, self.layout, self.rank, self.tp_world_size,
                                       pool.slot_bytes, self.layout.device,
                                       cpu_async=self.cpu_async, kv_huge_pages=False,
                                       cpu_lanes=self._lanes)
            self._copier.expedited_jobs = self._expedited
        except (OSError, ValueError, RuntimeError) as exc:  # GeometryError is a ValueError
            log.error("kvoffload worker rank %d: cannot copy with pool %s; its jobs fail: %s",
                      self.rank, pool.pool_path, exc)
            self._copier = RefusedCopier(str(exc))
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

    def _generations(self, pool: PoolInfo) -> SlotGenerations | None:
        if not pool.index_path:
            return None
        if self._gens is None or self._gens_path != pool.index_path or \
                self._gens.daemon_id != pool.daemon_id:  # same path, a restarted daemon
            if self._gens is not None:
                self._gens.close()
            try:
                self._gens = SlotGenerations(pool.index_path, pool.daemon_id)
            except (IndexGone, OSError) as exc:
                log.error("kvoffload worker rank %d: cannot map the daemon's index: %s",
                          self.rank, exc)
                self._gens = None
            self._gens_path = pool.index_path
        return self._gens

    def _intact(self, pool: PoolInfo | None, slots: np.ndarray, gens: np.ndarray) -> bool:
        view = self._generations(pool) if pool is not None else None
        return view is not None and bool(view.intact_mask(slots, gens).all())

    def _store_done(self, job_id: int) -> None:
        """A store job is complete: check its slots are still ours, then drop the lock."""
        held = self._stores.pop(job_id, None)
        if held is None:
            return
        path, slots, gens = held
        view = self._generations(self._pool) if self._pool is not None else None
        if view is None or not view.intact_mask(slots, gens, key_bound=False).all():
            # Revoked mid-copy: the slots stay quarantined until we drop the lock below, and
            # the daemon refuses this store's commit (its generation moved).
            self.stores_revoked += 1
            log.warning("kvoffload store job %d: its slots were revoked during the copy; "
                        "the daemon will refuse its commit", job_id)
        self.locks.release(path)

    def _result(self, r: CopyResult) -> TransferResult:
        ok = r.ok
        self._store_done(r.job_id)
        check = self._verify.pop(r.job_id, None)
        if check is not None and ok:
            ok = self._intact(self._pool, check[2], check[3])  # after the copy: nobody wrote
            if not ok:
                log.error("kvoffload load job %d: a slot went to another writer during the "
                          "copy", r.job_id)
        if not r.ok:
            log.error("kvoffload copy job %d failed", r.job_id)
        if check is not None and not ok:
            return self._failed_load(r.job_id, check[0], check[1], r.nbytes, r.seconds)
        return TransferResult(job_id=r.job_id, success=ok, transfer_size=r.nbytes,
                              transfer_time=r.seconds)

    def _failed_load(self, job_id: int, req_id: str | None, expedited: bool, nbytes: int = 0,
                     seconds: float = 0.0) -> TransferResult:
        """A load that did not get its bytes: to vLLM's load-failure path, never a success."""
        if self.reports_load_errors and req_id is not None and not expedited:
            self.failed_requests.add(req_id)  # KVOffloadConnector reports it failed_recving
            return TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                  transfer_time=seconds)
        return TransferResult(job_id=job_id, success=False, transfer_size=nbytes,
                              transfer_time=seconds)

    def take_failed_requests(self) -> set[str]:
        out, self.failed_requests = self.failed_requests, set()
        return out

    def _submit(self, job_id: int, gpu: GPULoadStoreSpec, pool_spec: LoadStoreSpec,
                store: bool, expedited: bool = False) -> bool:
        assert isinstance(pool_spec, PoolSlotsSpec), f"not our spec: {pool_spec!r}"
        pool = pool_spec.pool
        try:
            # (group, block, slot) rows in the spec's order; gens[i] is row i's generation.
            items = items_for_groups(gpu.block_ids, gpu.group_sizes, pool_spec.slots)
            gens = np.asarray(pool_spec.gens, dtype=np.uint64).reshape(-1)
            if len(gens) != len(items):
                raise ValueError("slots and gens disagree in length")
        except ValueError as exc:  # blocks and slots disagree: a bug, reported, never raised
            log.error("kvoffload job %d: %s", job_id, exc)
            self._done.append(TransferResult(job_id=job_id, success=False) if store else
                              self._failed_load(job_id, pool_spec.req_id, expedited))
            return True
        if store:
            self._store(job_id, items, gens, pool, pool_spec.lock, pool_spec.stamp)
            return True
        placed = items[:, 2] >= 0
        if pool is None or not placed.all() or not self._intact(pool, items[:, 2], gens):
            # A key without a slot, or a slot already handed on: its bytes are not there.
            log.error("kvoffload load job %d (request %s): blocks no longer in the pool",
                      job_id, pool_spec.req_id)
            self._done.append(self._failed_load(job_id, pool_spec.req_id, expedited))
            return True
        copier = self._copier_for(pool)
        self._verify[job_id] = (pool_spec.req_id, expedited, items[:, 2], gens)
        # A job the copier rejects (a slot or block id out of range: a bug, never a daemon
        # fault) is still reported by get_finished, as failed. Submission always succeeds.
        copier.submit_load(job_id, items)
        return True

    def _store(self, job_id: int, items: np.ndarray, gens: np.ndarray, pool: PoolInfo | None,
               lock: str, stamp: float, *, parked: bool = False) -> None:
        """Copy the rows whose grant is still ours, or park the job while one of its earmarked
        slots is not handed over yet (until its deadline)."""
        placed = items[:, 2] >= 0
        view = self._generations(pool) if pool is not None else None
        if stamp > 0 and view is not None and pool is not None:
            waiting = placed & view.waiting_mask(items[:, 2], gens)
            if waiting.any():
                if time.monotonic() < stamp + HANDOVER_WAIT_S:
                    self._parked.park(ParkedStore(job_id, items, gens, pool, lock, stamp))
                    if not parked:
                        self.stores_parked += 1
                    return
                # Never handed over now (see the docstring): the pre-check drops them.
                self.stores_handover_timeouts += 1
                log.warning("kvoffload store job %d: %d earmarked slots were not handed over "
                            "in time; not written (the daemon refuses their commit)", job_id,
                            int(waiting.sum()))
        # The lock first, then the check: once the daemon revoked these grants (a new
        # generation, then its lock test), either its test fails or we read the new
        # generation here. A slot lost meanwhile is not written (its commit is refused).
        # A spec without a lock comes from a caller without a daemon session (benches and
        # tests that drive the worker directly): nothing can revoke its slots.
        locked = view is not None and (not lock or self.locks.acquire(lock))
        if locked and view is not None:
            keep = placed & view.intact_mask(items[:, 2], gens, key_bound=False)
            items, gens = items[keep], gens[keep]
        if not locked or pool is None or not len(items):
            if locked:
                self.locks.release(lock)
            self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=0,
                                             transfer_time=0.0))
            return
        self._stores[job_id] = (lock, items[:, 2].copy(), gens)
        self._copier_for(pool).submit_store(job_id, items)

    def _still_waiting(self, job: ParkedStore) -> bool:
        view = self._generations(job.pool)
        placed = job.items[:, 2] >= 0
        return view is not None and bool((placed & view.waiting_mask(job.items[:, 2],
                                                                     job.gens)).any())

    def _retry(self, jobs: list[ParkedStore]) -> None:
        for j in jobs:  # each through the whole store path (it parks again if still early)
            self._store(j.job_id, j.items, j.gens, j.pool, j.lock, j.stamp, parked=True)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        # Loads have their own copy stream in BlockCopier: an expedited load never queues
        # behind a store.
        if expedited:
            self._expedited.add(job_id)  # BlockCopier runs it on its own lane
        try:
            return self._submit(job_id, dst_spec, src_spec, store=False, expedited=expedited)
        finally:
            self._expedited.discard(job_id)

    def get_finished(self) -> list[TransferResult]:
        self._retry(self._parked.take_due())  # never blocks: a handover is not waited for
        out, self._done = self._done, []
        if self._copier is not None:
            out.extend(self._result(r) for r in self._copier.get_finished())
        return out

    def wait(self, job_ids: set[int]) -> None:
        # vLLM reuses these jobs' GPU blocks next: a parked one is waited for (its deadline
        # at most) and then copied or given up before the copier's wait.
        self._retry(self._parked.take_waited(job_ids))
        if self._copier is not None:
            self._copier.wait(job_ids)

    def shutdown(self) -> None:
        self._parked.clear()  # they hold no lock and wrote nothing
        self._close_copier()
        self.locks.close()
        for lane in (self._lanes or {}).values():
            lane.close()
        self._lanes = None
        if self._task is not None:
            self._task.close()  # unmaps a pool mapped at creation but never used
            self._task = None
        if self._gens is not None:
            self._gens.close()
            self._gens = None

