"""The sharing suite's TP=2 variant: engines whose tensor-parallel ranks are separate processes.

An engine here is vLLM 0.33's core ``Scheduler`` with our plugin (SCHEDULER role, one process,
as vLLM's engine core) and one process per TP rank running vLLM's WORKER-role connector with
that rank (``parallel_config.rank``) over its own CPU KV tensors. Each step the scheduler's
output and connector metadata go to every rank (pickled, as vLLM's multiprocess executor sends
them); every rank runs the fake forward for its rank, its transfers, and reports back; the
completions are counted per rank as vLLM's output aggregator does (a job is done when every
rank reported it).

Each rank writes KV bytes that depend on its rank (``rank_row``), so a rank that loaded
another rank's page, or a page another engine's rank never wrote, fails the check. Every load
is checked on every rank, in that rank's process; the bytes come from the pool, written by
whichever engine's rank processes stored them (round-robin routing: mostly the other engine).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import multiprocessing as mp
import os
from typing import Any

BLOCK, UNIT, PAGE = 16, 4, 512  # bench/vllm_engine.py's default shape
ROW = PAGE // BLOCK
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM imports (its device probe)
_PRELOAD = ["torch", "vllm.config", "vllm.v1.core.sched.scheduler",
            "vllm.v1.kv_cache_interface",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
            "kvoffload.connector.vllm", "kvoffload.bench.tp_ranks"]


def rank_row(tokens: list[int], t: int, rank: int) -> bytes:
    """Rank ``rank``'s KV bytes of token ``t`` (its heads differ from every other rank's)."""
    return hashlib.sha256(f"{rank}:{t}:{tokens[t]}".encode()).digest()


def rank_state(prefix: list[int], rank: int) -> bytes:
    return hashlib.sha256(f"{rank}:{prefix!r}".encode()).digest() * (PAGE // 32)


def _parts(extra: dict[str, Any], num_blocks: int, world: int, rank: int) -> tuple[Any, Any]:
    """The VllmConfig and KVCacheConfig of rank ``rank`` of a ``world``-rank engine; equal for
    the scheduler and every rank except ``parallel_config.rank``."""
    import torch
    from kvoffload.bench.vllm_baseline import build_vllm_config
    from kvoffload.bench.vllm_engine import _EngineModelConfig
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

    vc = build_vllm_config(extra, BLOCK, UNIT)
    # One KV head per rank: every rank holds its own page of a block.
    vc.model_config = _EngineModelConfig(8192, kv_heads=world)
    vc.cache_config.kv_cache_layout = "LBHNC"
    vc.scheduler_config.max_num_batched_tokens = 2048
    vc.kv_transfer_config.kv_connector = "KVOffloadConnector"
    vc.kv_transfer_config.kv_connector_module_path = "kvoffload.connector.vllm"
    par = vc.parallel_config
    par.tensor_parallel_size = par.world_size = world
    par.rank = rank
    att = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float16)
    mamba = MambaSpec(block_size=BLOCK, shapes=((PAGE // 2,),), dtypes=(torch.float16,),
                      page_size_padded=PAGE, mamba_cache_mode="align")
    groups = [KVCacheGroupSpec(["attn.0"], att), KVCacheGroupSpec(["mamba.0"], mamba)]
    cfg = get_kv_cache_config_from_groups(vc, groups, num_blocks * 2 * PAGE)
    vc.cache_config.num_gpu_blocks = cfg.num_blocks
    return vc, cfg


class _Rank:
    """One TP rank's worker connector and KV pages (runs in the rank's process)."""

    def __init__(self, rank: int, world: int, extra: dict[str, Any], num_blocks: int) -> None:
        from kvoffload.bench.vllm_engine import kv_pages
        from kvoffload.connector.vllm import KVOffloadConnector
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

        self.rank = rank
        vc, cfg = _parts(extra, num_blocks, world, rank)
        self.pages, views = kv_pages(cfg, PAGE)
        self.worker = KVOffloadConnector(vc, KVConnectorRole.WORKER, cfg)
        self.worker.register_kv_caches(views)

    def _bytes(self, data: bytes) -> Any:
        import torch

        return torch.frombuffer(bytearray(data), dtype=torch.int8)

    def step(self, zero: list[int], copies: list[tuple[int, int]],
             work: list[tuple[int, int, list[int], list[int], int]], meta: Any,
             finished: set[str]) -> tuple[Any, ...]:
        w = self.worker
        w.handle_preemptions(meta)
        for block in zero:
            for page in self.pages.values():
                page[block].zero_()
        for src, dst in copies:
            for page in self.pages.values():
                page[dst].copy_(page[src])
        for start, end, tokens, attn, state_block in work:  # the fake forward of this rank
            for t in range(start, end):
                self.pages["attn.0"][attn[t // BLOCK], ROW * (t % BLOCK):ROW * (t % BLOCK + 1)] \
                    = self._bytes(rank_row(tokens, t, self.rank))
            self.pages["mamba.0"][state_block].copy_(self._bytes(rank_state(tokens[:end],
                                                                            self.rank)))
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        w.wait_for_save()
        results = w.get_transfer_results(finished)
        worker_meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        return (set(results.finished_sending or ()), set(results.finished_recving or ()),
                set(results.failed_recving or ()), worker_meta)

    def check(self, attn: list[int], n: int, tokens: list[int]) -> bool:
        """Every KV row of the first ``n`` tokens holds this rank's bytes of those tokens."""
        return all(bytes(self.pages["attn.0"][attn[t // BLOCK], ROW * (t % BLOCK):
                                             ROW * (t % BLOCK + 1)].numpy())
                   == rank_row(tokens, t, self.rank) for t in range(n))


def rank_main(rank: int, world: int, extra: dict[str, Any], num_blocks: int, conn: Any) -> None:
    """A rank process: serve ("step" | "check" | "stop", args) until stopped."""
    from kvoffload.bench.quiet import quiet_loggers

    quiet_loggers()
    try:
        r = _Rank(rank, world, extra, num_blocks)
        conn.send(("ready", None))
        while True:
            cmd, args = conn.recv()
            if cmd == "stop":
                r.worker.shutdown()
                conn.send(("ok", None))
                return
            conn.send(("ok", r.step(*args) if cmd == "step" else r.check(*args)))
    except BaseException as exc:  # the parent raises it; a child traceback would be lost
        conn.send(("error", f"rank {rank}: {exc!r}"))


class TPEngine:
    """The scheduler of a ``world``-rank engine running our plugin, its ranks in processes.
    Same surface as ``MiniEngine`` where the sharing suite's router uses it."""

    def __init__(self, control: str, *, world: int = 2, gpu_blocks: int = 24,
                 **extra: Any) -> None:
        from kvoffload.bench.vllm_baseline import make_request
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self._make_request = make_request
        self.world = world
        self.extra = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.connector.vllm",
                      "kvoffload_control": control, "kvoffload_copy_async": False,
                      "kvoffload_timeout_ms": 5000, **extra}
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # vLLM imported once, every rank forked from it
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        for r in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(r, world, self.extra, gpu_blocks, child),
                               daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        vc, cfg = _parts(self.extra, gpu_blocks, world, 0)
        self.scheduler = Scheduler(vc, cfg, StructuredOutputManager(vc), block_size=BLOCK,
                                   hash_block_size=UNIT)
        self._gather(timeout=300)  # every rank built its worker and registered its KV caches
        self.prefill_tokens: dict[str, int] = {}
        self.on_loaded: Any = None
        self._done: collections.Counter[tuple[str, str]] = collections.Counter()
        self.steps = 0

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def _gather(self, timeout: float = 120) -> list[Any]:
        replies = []
        for conn in self._conns:
            if not conn.poll(timeout):
                raise RuntimeError(f"a rank process did not answer in {timeout:.0f} s")
            status, value = conn.recv()
            if status == "error":
                raise RuntimeError(value)
            replies.append(value)
        return replies

    def _all(self, cmd: str, *args: Any) -> list[Any]:
        for conn in self._conns:
            conn.send((cmd, args))
        return self._gather()

    def add(self, token_ids: list[int], req_id: str, max_tokens: int = 4) -> Any:
        req = self._make_request(token_ids, req_id, UNIT, max_tokens)
        self.scheduler.add_request(req)
        return req

    def block_table(self, req_id: str) -> tuple[list[int], ...]:
        return self.scheduler.kv_cache_manager.get_block_ids(req_id)

    def _finished_everywhere(self, kind: str, per_rank: list[set[str]]) -> set[str]:
        """Requests every rank has now reported (possibly over several steps)."""
        done = set()
        for ids in per_rank:
            for req_id in ids:
                self._done[(kind, req_id)] += 1
                if self._done[(kind, req_id)] == self.world:
                    del self._done[(kind, req_id)]
                    done.add(req_id)
        return done

    def step(self) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        work, sampled = [], {}
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens
            start = end - n
            tokens = list(req.all_token_ids)
            attn, mamba = self.block_table(req_id)
            work.append((start, end, tokens, list(attn), mamba[(end - 1) // BLOCK]))
            if start < req.num_prompt_tokens:
                self.prefill_tokens[req_id] = self.prefill_tokens.get(req_id, 0) + min(
                    end, req.num_prompt_tokens) - start
            sampled[req_id] = [1000 + len(tokens)] if end >= req.num_tokens else []
        replies = self._all("step", list(out.new_block_ids_to_zero or ()),
                            list(out.kv_cache_block_copies or ()), work,
                            out.kv_connector_metadata, set(out.finished_req_ids))
        worker_meta = None
        for *_, m in replies:  # vLLM's aggregator: per-job counts summed over the ranks
            worker_meta = m if worker_meta is None else (
                worker_meta if m is None else worker_meta.aggregate(m))
        kv_out = KVConnectorOutput()
        kv_out.finished_sending = self._finished_everywhere("send", [r[0] for r in replies])
        kv_out.finished_recving = self._finished_everywhere("recv", [r[1] for r in replies])
        kv_out.failed_recving = set().union(*(r[2] for r in replies))
        kv_out.kv_connector_worker_meta = worker_meta
        for req_id in kv_out.finished_recving - kv_out.failed_recving:
            if self.on_loaded is not None:
                self.on_loaded(req_id)
        ids = list(out.num_scheduled_tokens)
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled[r] for r in ids], kv_connector_output=kv_out))
        self.steps += 1
        return out

    def load_checker(self, prompts: dict[str, list[int]], out: dict[str, Any]) -> Any:
        """A load-done hook: every rank checks, in its own process, every KV row it now holds
        for the request against its rank's bytes of the prompt's tokens."""

        def check(req_id: str) -> None:
            out["loads"] += 1
            req = self.scheduler.requests[req_id]
            attn, _ = self.block_table(req_id)
            oks = self._all("check", list(attn), req.num_computed_tokens, prompts[req_id])
            out["rank_checks"] = out.get("rank_checks", 0) + len(oks)
            out["verify_failures"] += not all(oks)

        return check

    def busy(self) -> bool:
        return bool(self.scheduler.has_requests() or self.connector.has_pending_push_work())

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.busy():
                return
            self.step()
        raise AssertionError(f"engine still busy after {max_steps} steps")

    def shutdown(self) -> None:
        self.connector.shutdown()
        with contextlib.suppress(RuntimeError, OSError):  # a dead rank: terminated below
            self._all("stop")
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
