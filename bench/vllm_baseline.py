"""vLLM 0.33's own scheduler-side offloading, built on a CPU-only machine for baselines.

What is real: vLLM's ``OffloadingConnector`` in the SCHEDULER role, its
``OffloadingConnectorScheduler`` (lookup, load keys, store policy incl. the ``CHUNK_LEVEL``
gap of shared/spec/partial-tail.md, partial-tail stores from copy-on-write hand-offs) and its
``CPUOffloadingManager`` (LRU). What is not: the core scheduler, the GPU block pool and the
workers. ``VllmChatEngine`` plays them (see its docstring for exactly what it simulates).

The setup follows shared/spec/vllm-on-cpu.md (``VLLM_TARGET_DEVICE=cpu``, a stub model config,
hand-built KV-cache groups), like tests/vllm_harness.py, which bench code must not import.
vLLM is imported lazily: this module imports on a machine without vLLM, and
:func:`vllm_import_error` says why the baseline cannot run.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload.daemon.types import Geometry, GroupKind

SPEC_NAME = "BaselineCPUOffloadingSpec"


def mark_not_run(out: dict[str, Any]) -> bool:
    """True (and the reason in ``out``) when vLLM 0.33 is missing: a suite that compares
    against vLLM's own code never reports a ratio without it."""
    reason = vllm_import_error()
    if reason is None:
        return False
    out["reason"] = out["not_run"] = f"vLLM baseline not run: {reason}"
    return True


@functools.cache
def vllm_import_error() -> str | None:
    """None when vLLM 0.33 imports here, else why not (shown as the reason a suite did not run)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: F401
            OffloadingConnector,
        )
    except Exception as exc:  # any import failure means "no usable vLLM"
        return f"vLLM cannot be imported: {type(exc).__name__}: {exc}"
    version = getattr(vllm, "__version__", "?")
    if not version.startswith("0.33"):
        return f"the baselines pin vLLM 0.33 semantics, found vLLM {version}"
    return None


@functools.cache
def _spec_class() -> type:
    """vLLM's own ``CPUOffloadingManager`` behind a spec sized in chunks, not bytes.

    vLLM's ``CPUOffloadingSpec`` derives its chunk count from GPU tensor sizes, which a
    CPU-only scheduler does not have; giving the manager the daemon's slot count keeps the
    pool the same for both (one chunk or slot holds one group block of one key)."""
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    class BaselineCPUOffloadingSpec(OffloadingSpec):  # type: ignore[misc]
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self._manager = CPUOffloadingManager(
                num_chunks=int(self.extra_config["num_chunks"]),
                cache_policy=self.extra_config.get("eviction_policy", "lru"))

        def get_manager(self) -> Any:
            return self._manager

        def get_worker(self, kv_caches: Any) -> Any:
            raise NotImplementedError("scheduler-side baseline: no worker")

    return BaselineCPUOffloadingSpec


def __getattr__(name: str) -> Any:
    # vLLM's OffloadingSpecFactory does getattr(module, spec_name): build the class only then.
    if name == SPEC_NAME:
        return _spec_class()
    raise AttributeError(name)


class _StubModelConfig:
    """What the offloading config code reads from ``ModelConfig`` (which would need a model)."""

    model = "kvoffload-bench-stub"
    use_mla = False

    def __init__(self, max_model_len: int) -> None:
        import torch

        self.dtype = torch.float16
        self.max_model_len = max_model_len

    def get_total_num_kv_heads(self) -> int:
        return 1


def kv_cache_config(geometry: Geometry, num_blocks: int = 1 << 16, head_size: int = 8) -> Any:
    """vLLM KV-cache groups mirroring ``geometry`` (attention + Mamba align); tiny pages."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    specs: list[Any] = []
    for g in geometry.groups:
        if g.kind is GroupKind.FULL_ATTENTION:
            specs.append(FullAttentionSpec(block_size=g.tokens_per_block, num_kv_heads=1,
                                           head_size=head_size, dtype=torch.float16))
        elif g.kind is GroupKind.MAMBA:
            specs.append(MambaSpec(block_size=g.tokens_per_block, shapes=((4,),),
                                   dtypes=(torch.float16,),
                                   mamba_cache_mode="align" if g.mamba_align else "none"))
        else:
            raise ValueError(f"baseline supports attention and Mamba groups, not {g.kind}")
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s)
                                          for i, s in enumerate(specs)])


def build_connector(geometry: Geometry, num_chunks: int, *, offload_prompt_only: bool = True,
                    max_model_len: int = 1 << 20, extra: dict[str, Any] | None = None,
                    connector_cls: Any = None, head_size: int = 8) -> Any:
    """vLLM's SCHEDULER-role ``OffloadingConnector`` over its own CPU manager of ``num_chunks``.

    ``offload_prompt_only`` is vLLM 0.33's default (True): decode tokens are never stored.
    ``extra`` (a whole ``kv_connector_extra_config``) and ``connector_cls`` load another spec
    the same way, ours for instance, in front of the very same scheduler code."""
    reason = vllm_import_error()
    if reason is not None:
        raise RuntimeError(reason)
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    block = geometry.groups[0].tokens_per_block
    cache = CacheConfig(block_size=block, enable_prefix_caching=True,
                        prefix_match_unit=geometry.tokens_per_hash, mamba_cache_mode="align")
    transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config=extra or {
                                    "spec_name": SPEC_NAME,
                                    "spec_module_path": "kvoffload.bench.vllm_baseline",
                                    "num_chunks": num_chunks,
                                    "offload_prompt_only": offload_prompt_only})
    config = VllmConfig(cache_config=cache, kv_transfer_config=transfer)
    config.model_config = _StubModelConfig(max_model_len)  # type: ignore[assignment]
    cls = connector_cls or OffloadingConnector
    return cls(config, KVConnectorRole.SCHEDULER, kv_cache_config(geometry, head_size=head_size))


def end_step(connector: Any) -> Any:
    """Close a scheduler step with nothing scheduled (vLLM's ``build_connector_meta``)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    out = SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={}, total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[])
    return connector.build_connector_meta(out)


@functools.cache
def _block_hasher(tokens_per_hash: int) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(tokens_per_hash, sha256)


def make_request(token_ids: Sequence[int], request_id: str, tokens_per_hash: int,
                 max_tokens: int = 16, *, kv_transfer_params: dict[str, Any] | None = None,
                 cache_salt: str | None = None) -> Any:
    """A real vLLM ``Request`` hashed by vLLM's own block hasher."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    req = Request(request_id, list(token_ids), SamplingParams(max_tokens=max(1, max_tokens)),
                  None, cache_salt=cache_salt, block_hasher=_block_hasher(tokens_per_hash))
    req.kv_transfer_params = kv_transfer_params
    return req


def build_vllm_config(extra_config: Mapping[str, Any], block_size: int = 16,
                      prefix_match_unit: int | None = 4, *, enable_prefix_caching: bool = True,
                      mamba_cache_mode: str = "align", max_model_len: int = 8192) -> Any:
    """A ``VllmConfig`` whose KV transfer config loads the spec named in ``extra_config``."""
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig

    cache = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                        prefix_match_unit=prefix_match_unit,
                        mamba_cache_mode=mamba_cache_mode)  # type: ignore[arg-type]
    transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config=dict(extra_config))
    config = VllmConfig(cache_config=cache, kv_transfer_config=transfer)
    config.model_config = _StubModelConfig(max_model_len)  # type: ignore[assignment]
    return config


def store_keys(connector: Any, keys: Sequence[bytes]) -> None:
    """Put keys straight into vLLM's CPU manager as stored and ready (benchmark setup)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        _create_req_context,
    )

    manager = connector.connector_scheduler.manager
    ctx = _create_req_context(make_request([0], "setup", 1))
    out = manager.prepare_store(list(keys), ctx)
    assert out is not None, "the CPU manager has no room for the setup keys"
    manager.complete_store(list(keys), ctx)


# ------------------------------------------------------------------------------- chat driver


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
