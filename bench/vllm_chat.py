"""vLLM's scheduler-side connector driven one request at a time: the what-if's vLLM side.

``VllmChatEngine`` stands in for vLLM's core scheduler, block pool and workers around the real
``OffloadingConnector`` (SCHEDULER role) built by ``bench/vllm_baseline.py``; the suites that
run vLLM's whole engine loop use ``bench/vllm_engine.py`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload.bench.vllm_baseline import build_connector, make_request
from kvoffload.daemon.base import Geometry, GroupKind


@dataclass
class VllmTurn:
    """What vLLM's scheduler decided for one request."""

    hit_tokens: int
    chunk_tokens: int  # the complete-chunk part of the hit
    tail_boundary: int | None
    lookups: int  # manager.lookup calls (all in-process: no round trips)
    loaded_keys: list[bytes] = field(default_factory=list)
    stored_keys: list[bytes] = field(default_factory=list)
    evicted: int = 0


class VllmChatEngine:
    """Drives vLLM's real scheduler-side connector through a request's life, one at a time.

    Simulated here, in place of vLLM's core scheduler, block pool and workers:
    * no GPU prefix cache: every request starts with 0 local tokens (the GPU cache was
      evicted by other traffic), the same for every variant of the benchmark;
    * block ids are fresh integers, never reused (no re-allocation flushes); a load's blocks
      follow vLLM's allocation rule (Mamba: null blocks below its last state block);
    * transfers complete at once, reported back through ``update_connector_output``;
    * prefill runs as vLLM's align-mode chunking would: up to the prompt's tail checkpoint
      ``round_down(n - 1, tokens_per_hash)``, then the rest; decode one block per step;
    * the core scheduler's copy-on-write hand-offs (``boundary_state_offloads``): the Mamba
      state at every block edge computed (so Mamba chunks are offered where our engine stores
      them too), and the prompt's tail checkpoint when it lies inside a block. vLLM 0.33's
      ``OffloadingConnector`` has no ``register_finished_partial_tail``: no turn-end tail.
    """

    def __init__(self, geometry: Geometry, num_chunks: int, *,
                 offload_prompt_only: bool = True) -> None:
        self.geometry = geometry
        self.block = geometry.groups[0].tokens_per_block
        self.tph = geometry.tokens_per_hash
        self.mamba = [i for i, g in enumerate(geometry.groups) if g.kind is GroupKind.MAMBA]
        self.connector = build_connector(geometry, num_chunks,
                                         offload_prompt_only=offload_prompt_only)
        self.scheduler = self.connector.connector_scheduler
        self._next_block = 1
        self._turns = 0
        self._instrument()

    def _instrument(self) -> None:
        """Count the manager calls vLLM's scheduler makes (instance attributes shadow methods)."""
        mgr = self.scheduler.manager
        self.lookups = 0
        self.loaded: list[bytes] = []
        self.stored: list[bytes] = []
        self.evicted = 0
        self._complete: list[int] = []
        lookup, prepare_load = mgr.lookup, mgr.prepare_load
        prepare_store = mgr.prepare_store
        complete_chunks = self.scheduler._lookup_complete_chunks

        def counted_lookup(key: bytes, ctx: Any) -> Any:
            self.lookups += 1
            return lookup(key, ctx)

        def recorded_load(keys: Any, ctx: Any) -> Any:
            self.loaded.extend(keys)
            return prepare_load(keys, ctx)

        def recorded_store(keys: Any, ctx: Any) -> Any:
            out = prepare_store(keys, ctx)
            if out is not None:
                self.stored.extend(out.keys_to_store)
                self.evicted += len(out.evicted_keys)
            return out

        def recorded_complete(*args: Any, **kwargs: Any) -> Any:
            hit = complete_chunks(*args, **kwargs)
            self._complete.append(hit or 0)
            return hit

        mgr.lookup, mgr.prepare_load, mgr.prepare_store = (counted_lookup, recorded_load,
                                                            recorded_store)
        self.scheduler._lookup_complete_chunks = recorded_complete

    # -- plumbing -----------------------------------------------------------------------

    def _blocks(self, n: int) -> list[int]:
        first = self._next_block
        self._next_block += n
        return list(range(first, first + n))

    def _step(self, *, new: Any = None, cached: Any = None, scheduled: dict[str, int] | None = None,
              finished: set[str] | None = None,
              handoffs: dict[str, list[tuple[int, int, int]]] | None = None) -> None:
        """One scheduler step: build the connector metadata, then complete every job."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.core.sched.output import (
            CachedRequestData,
            KVConnectorBlockState,
            SchedulerOutput,
        )
        from vllm.v1.outputs import KVConnectorOutput

        scheduled = scheduled or {}
        state = None
        if handoffs:
            state = KVConnectorBlockState(req_ids=set(handoffs), resolve_block_ids=lambda r: (),
                                          boundary_state_offloads=handoffs)
        out = SchedulerOutput(
            scheduled_new_reqs=[new] if new is not None else [],
            scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
            num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=finished or set(), free_encoder_mm_hashes=[],
            kv_connector_block_state=state)
        meta = self.connector.build_connector_meta(out)
        jobs = [*meta.load_jobs, *meta.store_jobs]
        if jobs:
            done = OffloadingWorkerMetadata()
            for job in jobs:
                done.mark_completed(job)
            self.connector.update_connector_output(KVConnectorOutput(
                finished_recving={j.req_id for j in meta.load_jobs.values()},
                kv_connector_worker_meta=done))

    def _mamba_handoffs(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """CoW hand-offs of every block-edge state in (start, end] for each Mamba group."""
        b = self.block
        edges = range((start // b + 1) * b, end + 1, b)
        return [(g, blk, edge) for edge in edges for g, blk in zip(
            self.mamba, self._blocks(len(self.mamba)), strict=True)]

    # -- one request --------------------------------------------------------------------

    def run_turn(self, prompt: Sequence[int], reply: Sequence[int]) -> VllmTurn:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock
        from vllm.v1.core.sched.output import NewRequestData
        from vllm.v1.request import RequestStatus

        self._turns += 1
        rid = f"turn-{self._turns}"
        b, n = self.block, len(prompt)
        req = make_request(prompt, rid, self.tph, max_tokens=len(reply))
        self.lookups, self.loaded, self.stored, self.evicted = 0, [], [], 0
        self._complete.clear()
        conn = self.connector
        conn.on_new_request(req)
        hit, _ = conn.get_num_new_matched_tokens(req, 0)
        hit = hit or 0  # None (deferred) cannot happen: every store completed already
        boundary = self.scheduler._req_status[rid].partial_tail_boundary if hit else None
        chunk = self._complete[-1] if self._complete else 0
        lookups = self.lookups
        ngroups = len(self.geometry.groups)
        table: list[list[int]] = [[] for _ in range(ngroups)]
        if hit:
            null = KVCacheBlock(block_id=0, is_null=True)
            nblocks = -(-hit // b)
            groups: list[list[Any]] = []
            for gi in range(ngroups):
                skipped = (hit - 1) // b if gi in self.mamba else 0
                ids = [0] * skipped + self._blocks(nblocks - skipped)
                table[gi] = ids
                groups.append([null if i == 0 else KVCacheBlock(block_id=i) for i in ids])
            conn.update_state_after_alloc(req, KVCacheBlocks(tuple(groups)), hit)
            self._step()  # the load job runs while the request waits for its KV
        # Prefill: the whole prompt's blocks are allocated in the first step.
        total_blocks = -(-n // b)
        for gi in range(ngroups):
            table[gi] += self._blocks(total_blocks - len(table[gi]))
        req.num_computed_tokens = hit
        tail = (n - 1) // self.tph * self.tph
        cuts = [tail, n] if hit < tail < n and tail % b else [n]
        pending: list[tuple[int, int, int]] = []
        first = True
        for cut in cuts:
            start = req.num_computed_tokens
            if first:
                new = NewRequestData.from_request(req, tuple(list(t) for t in table))
                self._step(new=new, scheduled={rid: cut - start},
                           handoffs={rid: pending} if pending else None)
                first = False
            else:
                handoff = pending + [(g, blk, start) for g, blk in zip(
                    self.mamba, self._blocks(len(self.mamba)), strict=True)]
                self._step(cached=self._cached(rid, req, None), scheduled={rid: cut - start},
                           handoffs={rid: handoff})
            req.num_computed_tokens = cut
            pending = self._mamba_handoffs(start, cut)
        # Decode: the reply's tokens, one block of them per step; the last is never computed.
        req.append_output_token_ids(list(reply))
        end = n + len(reply) - 1
        while req.num_computed_tokens < end:
            start = req.num_computed_tokens
            stop = min(end, (start // b + 1) * b)
            need = -(-stop // b) - len(table[0])
            new_ids = tuple(self._blocks(need) for _ in range(ngroups)) if need > 0 else None
            if new_ids:
                for gi in range(ngroups):
                    table[gi] += new_ids[gi]
            self._step(cached=self._cached(rid, req, new_ids), scheduled={rid: stop - start},
                       handoffs={rid: pending} if pending else None)
            req.num_computed_tokens = stop
            pending = self._mamba_handoffs(start, stop)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        conn.request_finished_all_groups(req, tuple(table))
        self._step(finished={rid}, handoffs={rid: pending} if pending else None)
        assert rid not in self.scheduler._req_status, "a transfer job never completed"
        return VllmTurn(hit, chunk if hit else 0, boundary, lookups, list(self.loaded),
                        list(self.stored), self.evicted)

    @staticmethod
    def _cached(rid: str, req: Any, new_ids: tuple[list[int], ...] | None) -> Any:
        from vllm.v1.core.sched.output import CachedRequestData

        return CachedRequestData(
            req_ids=[rid], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
            new_block_ids=[new_ids], num_computed_tokens=[req.num_computed_tokens],
            num_output_tokens=[len(req.output_token_ids)])
