"""``MiniEngine``: a whole vLLM 0.33 engine loop on CPU, minus the model: the real core ``Scheduler`` (with
``hash_block_size``), vLLM's WORKER-role ``OffloadingConnector`` over CPU KV tensors, and a
fake forward pass that writes deterministic KV bytes.

The fake model follows vLLM's model-runner order (``gpu_model_runner.execute_model`` +
``KVConnectorModelRunnerMixin``): ``handle_preemptions`` (submits last step's deferred stores),
zero new blocks, apply the scheduler's copy-on-write block copies, "forward", start async
loads, ``wait_for_save``, ``get_finished``, worker metadata. What the forward writes:

* attention (group 0): for every computed token ``t``, bytes ``[32 * (t % 16), +32)`` of the
  page of block ``table[t // 16]`` become ``token_row(tokens, t)``;
* Mamba (group 1, align mode): the whole state page of ``table[(end - 1) // 16]`` becomes
  ``state_page(tokens[:end])`` once the step computed tokens up to ``end``.

So every byte a load restores can be predicted from the token ids alone. Those figures are
the default ``Shape``; another ``Shape`` (a preset's block size, hash unit and Mamba groups,
with a few bytes per token) writes ``token_rows`` (vectorised) and one state page per Mamba
group. A request added with a scripted ``reply`` samples that reply, up to a block edge per
step (vLLM's align-mode split replays them like a resumed request), so long replies cost a
few steps, not one per token.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
from kvoffload.bench.vllm_baseline import (  # noqa: E402
    StubModelConfig,
    build_vllm_config,
)
from kvoffload.bench.vllm_baseline import make_request as _make_request  # noqa: E402

BLOCK = 16
UNIT = 4
PAGE = 512  # bytes of one block of one layer (attention: 16 tokens x 32 bytes)
ROW = PAGE // BLOCK


def token_row(tokens: list[int], t: int) -> torch.Tensor:
    seed = hashlib.sha256(f"{t}:{tokens[t]}".encode()).digest()
    return torch.frombuffer(bytearray(seed), dtype=torch.int8).clone()


def state_page(prefix: list[int], page: int = PAGE, group: int = 0) -> torch.Tensor:
    text = repr(prefix) if group == 0 else f"{group}:{prefix!r}"
    digest = hashlib.sha256(text.encode()).digest()
    return torch.frombuffer(bytearray(digest * (page // 32)), dtype=torch.int8).clone()


_MIX = (0x5851F42D4C957F2D, 0x14057B7EF767814F, 0x2545F4914F6CDD1D)  # all < 2**63


def token_rows(tokens: list[int], start: int, end: int, row: int = ROW) -> torch.Tensor:
    """``(end - start, row)`` int8: token ``t``'s KV bytes. The default row is ``token_row``;
    other sizes (multiples of 8) mix token id and position in int64 arithmetic, vectorised."""
    if row == ROW:
        return torch.stack([token_row(tokens, t) for t in range(start, end)])
    pos = torch.arange(start, end, dtype=torch.int64)
    x = torch.tensor(tokens[start:end], dtype=torch.int64) * _MIX[0] + pos * _MIX[1] + 1
    x = x[:, None] * (torch.arange(1, row // 8 + 1, dtype=torch.int64) * _MIX[2])[None]
    for shift in (29, 32, 17):  # wrap-around products and shifts: every bit depends on both
        x = (x ^ (x >> shift)) * _MIX[shift % 3]
    return x.contiguous().view(torch.int8).reshape(end - start, row)


@dataclass(frozen=True)
class Shape:
    """The engine's token geometry: block size, hash unit, Mamba groups, KV bytes per token."""

    block: int = BLOCK
    unit: int = UNIT
    mamba_groups: int = 1
    row: int = ROW  # attention bytes per token; a page is block * row bytes in every group
    max_model_len: int = 8192

    @property
    def page(self) -> int:
        return self.block * self.row


class _EngineModelConfig(StubModelConfig):
    """What the core Scheduler also reads from ModelConfig."""

    uses_mrope = False
    is_encoder_decoder = False
    multimodal_config = None
    is_diffusion = False
    supports_multimodal_inputs = False
    return_sampling_mask = False
    skip_tokenizer_init = True
    runner_type = "generate"


def kv_pages(cfg: Any, page: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """KV memory for a ``KVCacheConfig``: one int8 buffer per KVCacheTensor; per layer a
    (num_blocks, page) view for the fake model, and vLLM's own view for register_kv_caches."""
    from vllm.v1.kv_cache_interface import create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    pages: dict[str, torch.Tensor] = {}
    views: dict[str, torch.Tensor] = {}
    for kt in cfg.kv_cache_tensors:
        buf = torch.zeros(kt.size, dtype=torch.int8)
        spec = next(g.kv_cache_spec for g in cfg.kv_cache_groups
                    if kt.layers[0] in g.layer_names)
        views.update(zip(kt.layers, create_kv_cache_views(
            buf, spec, cfg.num_blocks, KVCacheLayout.LBHNC, kt), strict=True))
        for i, layer in enumerate(kt.layers):
            pages[layer] = buf[i * kt.layer_stride:].as_strided(
                (cfg.num_blocks, page), (kt.block_stride, 1))
    return pages, views


class MiniEngine:
    """``real_worker=False`` completes every transfer job without moving bytes (for specs
    whose worker needs CUDA, e.g. vLLM's own CPUOffloadingSpec)."""

    def __init__(self, extra_config: Mapping[str, Any], *, num_blocks: int = 64,
                 real_worker: bool = True, connector: str = "OffloadingConnector",
                 connector_module: str | None = None, max_batched_tokens: int = 2048,
                 shape: Shape = Shape(), log_stats: bool = False) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheGroupSpec,
            MambaSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        self.shape = sh = shape
        vc = build_vllm_config(extra_config, sh.block, sh.unit, max_model_len=sh.max_model_len)
        vc.model_config = _EngineModelConfig(sh.max_model_len)
        vc.cache_config.kv_cache_layout = "LBHNC"
        vc.scheduler_config.max_num_batched_tokens = max_batched_tokens
        assert vc.kv_transfer_config is not None
        vc.kv_transfer_config.kv_connector = connector
        vc.kv_transfer_config.kv_connector_module_path = connector_module
        att = FullAttentionSpec(block_size=sh.block, num_kv_heads=1, head_size=sh.row // 4,
                                dtype=torch.float16)
        assert att.page_size_bytes == sh.page
        mamba = MambaSpec(block_size=sh.block, shapes=((sh.page // 2,),),
                          dtypes=(torch.float16,), page_size_padded=sh.page,
                          mamba_cache_mode="align")
        self.mamba_layers = [f"mamba.{i}" for i in range(sh.mamba_groups)]
        groups = [KVCacheGroupSpec(["attn.0"], att)] + [
            KVCacheGroupSpec([name], mamba) for name in self.mamba_layers]
        cfg = get_kv_cache_config_from_groups(vc, groups, num_blocks * len(groups) * sh.page)
        vc.cache_config.num_gpu_blocks = cfg.num_blocks
        self.num_blocks = cfg.num_blocks
        self.vllm_config = vc
        # log_stats: the scheduler's stats (connector metrics among them) ride each step's
        # outputs, as in a served engine; ``scheduler_stats`` keeps the step's (None when off).
        self.scheduler = Scheduler(vc, cfg, StructuredOutputManager(vc), block_size=sh.block,
                                   hash_block_size=sh.unit, log_stats=log_stats)
        self.scheduler_stats: Any = None
        self.pages, views = kv_pages(cfg, sh.page)
        self.worker: Any = None
        if real_worker:
            worker_cls: Any = OffloadingConnector
            if connector == "KVOffloadConnector":
                from kvoffload.connector.vllm import KVOffloadConnector

                worker_cls = KVOffloadConnector
            self.worker = worker_cls(vc, KVConnectorRole.WORKER, cfg)
            self.worker.register_kv_caches(views)
        self.steps = 0
        self.prefill_tokens: dict[str, int] = {}  # tokens the model computed per prompt
        self.on_loaded: Callable[[str], None] | None = None
        self.failed_loads: set[str] = set()  # requests vLLM was told had failed loads
        self._stores_due: list[int] = []
        self.replies: dict[str, list[int]] = {}  # scripted replies, sampled a block at a time
        self.token_per_step = False  # True: one reply token per step, as vLLM decodes
        self.first_start: dict[str, int] = {}  # tokens already computed at a request's 1st step
        self.scheduler_seconds = 0.0  # in schedule() and update_from_output(), all steps
        self.last_step_seconds = 0.0  # the same, the latest step alone

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add(self, token_ids: list[int], req_id: str, max_tokens: int = 4,
            reply: list[int] | None = None) -> Any:
        """``reply``: the tokens the fake model samples (``max_tokens`` becomes its length)."""
        if reply:
            self.replies[req_id] = list(reply)
            max_tokens = len(reply)
        req = _make_request(token_ids, req_id, self.shape.unit, max_tokens)
        self.scheduler.add_request(req)
        return req

    def scribble(self) -> None:
        """Overwrite every KV byte: afterwards only a load can restore a prefix."""
        gen = torch.Generator().manual_seed(1234)
        for page in self.pages.values():
            page.copy_(torch.randint(-128, 128, page.shape, dtype=torch.int8, generator=gen))

    def block_table(self, req_id: str) -> tuple[list[int], ...]:
        return self.scheduler.kv_cache_manager.get_block_ids(req_id)

    def _forward(self, out: Any) -> dict[str, list[int]]:
        for block in out.new_block_ids_to_zero or ():
            for page in self.pages.values():
                page[block].zero_()
        for src, dst in out.kv_cache_block_copies or ():
            for page in self.pages.values():
                page[dst].copy_(page[src])
        sampled: dict[str, list[int]] = {}
        sh = self.shape
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens
            start = end - n
            tokens = list(req.all_token_ids)
            self.first_start.setdefault(req_id, start)
            attn, *mambas = self.block_table(req_id)
            rows = token_rows(tokens, start, end, sh.row)
            for b in range(start // sh.block, (end - 1) // sh.block + 1):
                lo, hi = max(start, b * sh.block), min(end, (b + 1) * sh.block)
                self.pages["attn.0"][attn[b], sh.row * (lo - b * sh.block):
                                     sh.row * (hi - b * sh.block)] = rows[
                    lo - start:hi - start].reshape(-1)
            for g, (layer, mamba) in enumerate(zip(self.mamba_layers, mambas, strict=True)):
                state_block = mamba[(end - 1) // sh.block]
                assert state_block != 0, "the Mamba state block of the step is the null block"
                self.pages[layer][state_block].copy_(state_page(tokens[:end], sh.page, g))
            if start < req.num_prompt_tokens:
                self.prefill_tokens[req_id] = self.prefill_tokens.get(req_id, 0) + min(
                    end, req.num_prompt_tokens) - start
            sampled[req_id] = self._sample(req_id, req, end) if end >= req.num_tokens else []
        return sampled

    def _sample(self, req_id: str, req: Any, end: int) -> list[int]:
        script = self.replies.get(req_id)
        if script is None:
            return [1000 + end]
        done = len(req.output_token_ids)
        # Up to the next block edge: the next step computes them like a resumed prefill.
        take = 1 if self.token_per_step else max(
            1, (end // self.shape.block + 1) * self.shape.block - end)
        return script[done:done + take] or [1000 + end]

    def verify(self, req_id: str, tokens: list[int]) -> bool:
        """Whether the KV bytes of the request's computed tokens are what the model would have
        written: every attention row, and each Mamba group's state at the computed end."""
        sh = self.shape
        upto = self.scheduler.requests[req_id].num_computed_tokens
        if upto == 0:
            return True
        attn, *mambas = self.block_table(req_id)
        want = token_rows(tokens, 0, upto, sh.row)
        page = self.pages["attn.0"]
        for b in range(0, (upto - 1) // sh.block + 1):
            hi = min(upto, (b + 1) * sh.block)
            got = page[attn[b], :sh.row * (hi - b * sh.block)]
            if not torch.equal(got, want[b * sh.block:hi].reshape(-1)):
                return False
        if upto % sh.unit == 0:  # a state exists only at a hash boundary
            for g, (layer, mamba) in enumerate(zip(self.mamba_layers, mambas, strict=True)):
                block = mamba[(upto - 1) // sh.block]
                if block and not torch.equal(self.pages[layer][block],
                                             state_page(tokens[:upto], sh.page, g)):
                    return False
        return True

    def step(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        took = time.perf_counter() - t0
        meta: Any = out.kv_connector_metadata
        kv_out = KVConnectorOutput()
        if self.worker is not None:
            self.worker.handle_preemptions(meta)
            sampled = self._forward(out)
            self.worker.bind_connector_metadata(meta)
            self.worker.start_load_kv(None)
            self.worker.wait_for_save()
            # As vLLM's model runner does: completions and load failures together.
            results = self.worker.get_transfer_results(out.finished_req_ids)
            recving = results.finished_recving - results.failed_recving
            kv_out.finished_sending = results.finished_sending
            kv_out.finished_recving = results.finished_recving
            kv_out.failed_recving = results.failed_recving
            self.failed_loads |= results.failed_recving
            kv_out.kv_connector_worker_meta = self.worker.build_connector_worker_meta()
            self.worker.clear_connector_metadata()
            for req_id in recving or ():
                if self.on_loaded is not None:
                    self.on_loaded(req_id)
        else:
            # Same timing as vLLM's worker with synchronous copies: a store job is submitted
            # at the start of the next step and reported then; a load in its own step.
            sampled = self._forward(out)
            done = OffloadingWorkerMetadata()
            for job_id in (*meta.load_jobs, *self._stores_due):
                done.mark_completed(job_id)
            self._stores_due = list(meta.store_jobs)
            kv_out.finished_recving = {job.req_id for job in meta.load_jobs.values()}
            kv_out.kv_connector_worker_meta = done if done.completed_jobs else None
            for req_id in kv_out.finished_recving:
                if self.on_loaded is not None:
                    self.on_loaded(req_id)
        ids = list(out.num_scheduled_tokens)
        runner_out = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled[r] for r in ids], kv_connector_output=kv_out)
        t0 = time.perf_counter()
        outputs = self.scheduler.update_from_output(out, runner_out)
        took += time.perf_counter() - t0
        self.scheduler_stats = next((o.scheduler_stats for o in outputs.values()
                                     if o.scheduler_stats is not None), None)
        self.last_step_seconds = took
        self.scheduler_seconds += took
        self.steps += 1
        return out

    def busy(self) -> bool:
        return bool(self.scheduler.has_requests() or self.connector.has_pending_push_work())

    def run(self, max_steps: int = 200, until: Callable[[], bool] | None = None) -> None:
        done = until or (lambda: not self.busy())
        for _ in range(max_steps):
            if done():
                return
            self.step()
        raise AssertionError(f"engine still busy after {max_steps} steps")

    def shutdown(self) -> None:
        self.connector.shutdown()
        if self.worker is not None:
            self.worker.shutdown()


def plugin_engine(control: str, *, gpu_blocks: int = 64, shape: Shape = Shape(),
                  **extra: Any) -> MiniEngine:
    """An engine running our plugin (``KVOffloadConnector``) against the daemon at ``control``."""
    return MiniEngine({"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.connector.vllm",
                       "kvoffload_control": control, "kvoffload_copy_async": False,
                       "kvoffload_timeout_ms": 5000, **extra},
                      connector="KVOffloadConnector", connector_module="kvoffload.connector.vllm",
                      num_blocks=gpu_blocks, shape=shape)


def vllm_cpu_engine(host_bytes: int, *, gpu_blocks: int = 64, shape: Shape = Shape(),
                    **extra: Any) -> MiniEngine:
    """An engine running vLLM's own ``CPUOffloadingSpec`` with ``host_bytes`` of memory (its
    worker needs CUDA: transfers complete without moving bytes, decisions are vLLM's own)."""
    return MiniEngine({"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": host_bytes,
                       **extra}, real_worker=False, num_blocks=gpu_blocks, shape=shape)
