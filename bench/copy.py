"""Block copy throughput through the shared pool vs a memcpy floor measured in the same run.

``kvoffload bench --suite copy`` or ``python -m kvoffload.bench.copy [--full] [--device D]``
(run it as a module: as ``python bench/copy.py`` this file would shadow the standard library's
``copy``) prints one JSON object.

Geometry: a llama-8B-like engine at TP4, 1 KiB of KV per token per layer, ``layers`` layers in
vLLM's layer-compact layout (one buffer, each layer's ``(num_blocks, page)`` pages at a fixed
distance: what ``CanonicalKVCaches`` hands the worker for ``LBHNC``). Pages of 16, 64 and 256
tokens (16, 64, 256 KiB per layer) and 1 MiB pages (hybrid models, whose pages grow to hold a
Mamba state). Per page size, two slot patterns: ``contiguous`` (consecutive block ids into
consecutive slots) and ``shuffled`` (random block ids and slots, as a long-running engine and
pool have them: no two items coalesce). Per pattern, a store job (KV -> pool slots) and a load
job (slots -> other KV blocks), each waited for, through a real pre-faulted ``/dev/shm`` file.

Floor: the same number of bytes copied in one contiguous piece between the same kinds of memory
a job touches: a torch tensor and the pre-faulted pool mapping, the faster of torch ``copy_`` (2
OpenMP threads) and two threads of ``np.copyto`` over halves (CPU); pinned host <-> device
``copy_`` (CUDA).
Everything is interleaved rep by rep so drift hits both sides alike; medians are reported.
Each job is larger than the last-level cache (32 MiB here), so neither side copies from cache.

``ratio`` is the worst ours / floor over every (page, pattern, direction); the target is 0.8 on
CPU and 0.9 on CUDA. On CPU, ``native gather`` copies the shuffled store's scattered rows with one
native torch op on one thread (no Python per block): what the access pattern itself allows on this memory,
which is what limits small pages (4 KiB pages, rows spread over the layers' buffers). Bytes are checked after the last rep, so a fast wrong copy cannot pass.
vLLM's own CPU offloading worker is the other baseline where it can run: it refuses to build
without CUDA, and its copies are compiled vLLM ops (not in the pure-Python install).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from kvoffload.connector.copier import BlockCopier, KVLayout, PoolMapping

PAGES = {"16 tokens": 16 << 10, "64 tokens": 64 << 10, "256 tokens": 256 << 10,
         "1 MiB": 1 << 20}
VLLM_NOT_RUN = ("vLLM 0.33's CPU offloading worker refuses to build without CUDA "
                "(CPUOffloadingSpec.get_worker) and copies with compiled vllm._C ops")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fill(t: torch.Tensor, seed: int) -> None:
    """Pseudo-random bytes, cheaply: one random MiB tiled over the tensor (rolled each time)."""
    flat = t.view(-1)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    chunk = torch.randint(-128, 128, (1 << 20,), dtype=torch.int8, generator=gen).to(t.device)
    for start in range(0, flat.numel(), chunk.numel()):
        n = min(chunk.numel(), flat.numel() - start)
        flat[start : start + n].copy_(chunk[:n])
        chunk = chunk.roll(4097)


_SCRATCH: list[np.ndarray] = []


def _evict_caches() -> None:
    """Stream 64 MiB through the caches (untimed) so the next timed copy starts cold, as in
    an engine: otherwise whichever side ran the same copy just before reads from L3."""
    if not _SCRATCH:
        _SCRATCH.extend(np.ones(32 << 20, dtype=np.int8) for _ in range(2))
    np.copyto(_SCRATCH[1], _SCRATCH[0])


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    _evict_caches()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _layout(layers: int, num_blocks: int, page: int, dev: torch.device) -> KVLayout:
    """vLLM's layer-compact layout: one buffer, layer l's pages at l * num_blocks * page."""
    buf = torch.empty(layers, num_blocks, page, dtype=torch.int8, device=dev)
    _fill(buf, page)
    return KVLayout([buf[i] for i in range(layers)], [[(i, 0, page) for i in range(layers)]])


def _jobs(items: int, num_blocks: int, shuffled: bool, seed: int
          ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """(store items, load items): the load reads the stored slots into other blocks."""
    if not shuffled:
        return ([(0, i, i) for i in range(items)], [(0, items + i, i) for i in range(items)])
    gen = np.random.default_rng(seed)
    blocks = gen.permutation(num_blocks)[: 2 * items].tolist()
    slots = gen.permutation(items + 8)[:items].tolist()
    return ([(0, b, s) for b, s in zip(blocks[:items], slots, strict=True)],
            [(0, b, s) for b, s in zip(blocks[items:], slots, strict=True)])


def _one_page(name: str, page: int, layers: int, job_bytes: int, reps: int,
              dev: torch.device, backend: str = "auto", pin: bool | None = None
              ) -> dict[str, Any]:
    block = layers * page
    items = max(2, job_bytes // block)
    num_blocks = 2 * items + 8
    layout = _layout(layers, num_blocks, page, dev)
    nbytes = items * block
    cuda = dev.type == "cuda"
    # CUDA floor: pinned host <-> device. CPU floor: a torch tensor (4 KiB pages, as the KV
    # cache) <-> the pool mapping itself; never numpy arrays, which get transparent huge
    # pages and copy ~30 % faster than either side of a real job can.
    host = torch.ones(nbytes, dtype=torch.int8, pin_memory=cuda)
    other = torch.zeros(nbytes, dtype=torch.int8, device=dev) if cuda else host
    floor_pool: list[torch.Tensor] = []

    def floor_torch_store() -> None:
        (host if cuda else floor_pool[0]).copy_(other, non_blocking=cuda)

    def floor_torch_load() -> None:
        (other if cuda else host).copy_(host if cuda else floor_pool[0], non_blocking=cuda)

    helper = ThreadPoolExecutor(1)

    def memcpy2(dst: np.ndarray, src: np.ndarray) -> None:
        """Two threads, two halves: memcpy as our CPU copier does it, without OpenMP (whose
        team stalls whenever another process holds a core: torch copy_ swings 12-37 GB/s)."""
        half = len(dst) // 2
        future = helper.submit(np.copyto, dst[half:], src[half:])
        np.copyto(dst[:half], src[:half])
        future.result()

    def floor_numpy_store() -> None:
        memcpy2(floor_pool[0].numpy(), host.numpy())

    def floor_numpy_load() -> None:
        memcpy2(host.numpy(), floor_pool[0].numpy())

    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="kvoffload-bench-pool-", dir=folder)
    os.close(fd)
    num_slots = items + 8
    os.truncate(path, num_slots * block)
    times: dict[str, list[float]] = {}
    try:
        # Pre-faulted as the daemon and the worker's MappingTask leave it.
        mapping = PoolMapping(path, num_slots * block, populate=True, pin=pin)
        copier = BlockCopier(mapping, layout, 0, 1, block, dev, cuda_backend=backend)
        floor_pool.append(mapping.tensor[:nbytes])
        patterns = {p: _jobs(items, num_blocks, p == "shuffled", page)
                    for p in ("contiguous", "shuffled")}
        job_id = 0

        def job(store: bool, job_items: list[tuple[int, int, int]]) -> Callable[[], None]:
            def run() -> None:
                nonlocal job_id
                job_id += 1
                if store:
                    copier.submit_store(job_id, job_items)
                else:
                    copier.submit_load(job_id, job_items)
                copier.wait([job_id])
                results = copier.get_finished()
                if len(results) != 1 or not results[0].ok:
                    raise RuntimeError(f"copy failed: {results}")
            return run

        runs: dict[str, Callable[[], None]] = {"floor store": floor_torch_store,
                                               "floor load": floor_torch_load}
        if not cuda:
            runs["floor numpy store"] = floor_numpy_store
            runs["floor numpy load"] = floor_numpy_load
            # What the access pattern alone allows: the shuffled store's scattered rows
            # gathered by one native torch op (index_select, OpenMP), no Python per block.
            kv3 = layout.segment_view(layout.segments[0][0])
            picked = torch.tensor([b for _, b, _ in patterns["shuffled"][0]])
            gathered = host[:nbytes].view(items, layers, page)

            def native_gather() -> None:
                threads = torch.get_num_threads()
                torch.set_num_threads(1)  # one thread: no OpenMP team to stall on
                try:
                    torch.index_select(kv3, 0, picked, out=gathered)
                finally:
                    torch.set_num_threads(threads)

            runs["native gather"] = native_gather
        for p, (st, ld) in patterns.items():
            runs[f"{p} store"] = job(True, st)
            runs[f"{p} load"] = job(False, ld)
        for rep in range(reps + 1):  # rep 0 warms caches, allocator and streams
            for key, fn in runs.items():
                t = _timed(fn, dev)
                if rep:
                    times.setdefault(key, []).append(t)
        verified = all(
            torch.equal(layout.tensors[i][b], layout.tensors[i][b2])
            for (_, b, _), (_, b2, _) in zip(*patterns["shuffled"], strict=True)
            for i in range(layers)
        )
        backend = copier.cuda_backend
        pinned = mapping.pinned
        floor_pool.clear()
        helper.shutdown()
        copier.close()
        mapping.close()
    finally:
        os.unlink(path)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    floor = {d: max(gbps[f"floor {d}"], gbps.get(f"floor numpy {d}", 0.0))
             for d in ("store", "load")}
    rows = {f"{p} {d}": round(gbps[f"{p} {d}"] / floor[d], 3)
            for p in ("contiguous", "shuffled") for d in ("store", "load")}
    worst = min(rows.values())
    if "native gather" in gbps:
        rows["native gather, 1 thread (access pattern)"] = round(gbps["native gather"] / floor["store"], 3)
    return {"page": name, "page_bytes": page, "layers": layers, "items_per_job": items,
            "job_bytes": nbytes, "gbps": {k: round(v, 2) for k, v in gbps.items()},
            "ratios": rows, "worst": worst, "verified": verified,
            "pinned": pinned, "cuda_backend": backend}


def _device(device: str | None) -> torch.device:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def run_copy_bench(quick: bool = True, device: str | None = None,
                   progress: Callable[[str], None] | None = None, *, backend: str = "auto",
                   pin: bool | None = None) -> dict[str, Any]:
    """``backend`` (CUDA: auto, batch, index, rows) and ``pin`` (None: pinned where CUDA is)
    pick the GPU variants scripts/gpu_check.sh compares."""
    dev = _device(device)
    layers, job_bytes, reps = (8, 48 << 20, 5) if quick else (16, 96 << 20, 9)
    results = []
    for name, page in PAGES.items():
        if progress is not None:
            progress(f"pages of {name}")
        results.append(_one_page(name, page, layers, job_bytes, reps, dev, backend, pin))
    worst = min(r["worst"] for r in results)
    target = 0.9 if dev.type == "cuda" else 0.8
    return {
        "device": str(dev),
        "quick": quick,
        "reps": reps,
        "pages": results,
        "ratio": round(worst, 3),
        "target": target,
        "meets": worst >= target and all(r["verified"] for r in results),
        "verified": all(r["verified"] for r in results),
        "vllm_handler": {"not_run": VLLM_NOT_RUN} if dev.type != "cuda" else {
            "not_run": "not wired: needs vLLM's compiled ops on the GPU box"},
        "torch_threads": torch.get_num_threads(),
    }


def run_expedited_latency(device: str | None = None, quick: bool = True) -> dict[str, Any]:
    """Latency of a one-block load submitted while a large store is in flight: regular and
    expedited, against the same load on an idle copier. On CUDA the store is a real 1-2 GiB
    device-to-pinned-host copy; the loads must not wait for it (own streams)."""
    dev = _device(device)
    layers, page = 8, 256 << 10
    block = layers * page
    big = (64 if quick else 256) if dev.type == "cuda" else 16  # blocks in the long store
    num_blocks = big + 16
    layout = _layout(layers, num_blocks, page, dev)
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="kvoffload-bench-exp-", dir=folder)
    os.close(fd)
    os.truncate(path, (big + 8) * block)
    samples: dict[str, list[float]] = {}
    try:
        mapping = PoolMapping(path, (big + 8) * block, populate=True)
        copier = BlockCopier(mapping, layout, 0, 1, block, dev)
        store_items = [(0, i, i) for i in range(big)]
        job = 0
        for rep in range(11 if quick else 31):
            for case in ("idle", "behind store: regular", "behind store: expedited"):
                job += 2
                busy = case != "idle"
                if busy:
                    copier.submit_store(job, store_items)
                t0 = time.perf_counter()
                copier.submit_load(job + 1, [(0, big + 1 + rep % 8, big + rep % 8)],
                                   expedited=case.endswith("expedited"))
                copier.wait([job + 1])
                t = time.perf_counter() - t0
                copier.wait([job])
                if not all(r.ok for r in copier.get_finished()):
                    raise RuntimeError("copy failed")
                if rep:
                    samples.setdefault(case, []).append(t)
        copier.close()
        mapping.close()
    finally:
        os.unlink(path)
    p50 = {k: round(statistics.median(v) * 1e3, 3) for k, v in samples.items()}
    return {"device": str(dev), "store_bytes": big * block, "load_bytes": block,
            "p50_ms": p50, "samples": len(next(iter(samples.values())))}


def _rank_proc(rank: int, world: int, path: str, size: int, slot_bytes: int, device: str,
               out: Any) -> None:
    """One rank of ``run_two_process_check``: maps (and pins) the shared pool itself, stores its
    page of every slot, waits for the others through the file, loads it all back."""
    try:
        dev = _device(device)
        slots = size // slot_bytes
        page = slot_bytes // world // 2
        gen = torch.Generator().manual_seed(rank)
        kv = torch.randint(-128, 128, (2, 2 * slots, page), dtype=torch.int8, generator=gen)
        kv = kv.to(dev)
        layout = KVLayout([kv[0], kv[1]], [[(0, 0, page), (1, 0, page)]])
        with PoolMapping(path, size) as mapping:
            with BlockCopier(mapping, layout, rank, world, slot_bytes, dev) as copier:
                copier.submit_store(1, [(0, s, s) for s in range(slots)])
                copier.wait([1])
                stored = copier.get_finished()
                before = kv[:, :slots].clone()
                kv.zero_()
                copier.submit_load(2, [(0, slots + s, s) for s in range(slots)])
                copier.wait([2])
                loaded = copier.get_finished()
                _sync(dev)
                ok = bool(torch.equal(kv[:, slots:], before))
            out.put((rank, {"pinned": mapping.pinned, "ok": ok and all(
                r.ok for r in stored + loaded), "backend": copier.cuda_backend,
                "digest": int(before.to(torch.int64).sum())}))
    except BaseException as exc:
        out.put((rank, {"error": repr(exc)}))


def run_two_process_check(device: str | None = None, world: int = 2) -> dict[str, Any]:
    """``world`` processes share one pool file (each registers it with CUDA itself): every
    rank stores its page of every slot and loads it back; the parent checks the file holds
    every rank's bytes in its own page."""
    import multiprocessing as mp

    dev = _device(device)
    slot_bytes, slots = world * 2 * (256 << 10), 64
    size = slot_bytes * slots
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="kvoffload-bench-2p-", dir=folder)
    os.close(fd)
    os.truncate(path, size)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_proc, args=(r, world, path, size, slot_bytes, str(dev),
                                                  out)) for r in range(world)]
    try:
        for proc in procs:
            proc.start()
        results = dict(out.get(timeout=300) for _ in procs)
        for proc in procs:
            proc.join(60)
        pool = np.fromfile(path, dtype=np.int8).reshape(slots, world, -1)
        # Each rank's pages hold its own bytes: their sums match what each rank stored.
        sums = {r: int(pool[:, r].sum(dtype=np.int64)) for r in range(world)}
    finally:
        os.unlink(path)
    ok = all(res.get("ok") for res in results.values()) and all(
        sums[r] == results[r].get("digest") for r in range(world))
    return {"device": str(dev), "world": world, "ranks": results, "meets": ok}


def main() -> None:
    parser = argparse.ArgumentParser(description="kvoffload block copy benchmark")
    parser.add_argument("--full", action="store_true", help="larger run (default: quick)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--backend", default="auto", choices=["auto", "batch", "index", "rows"],
                        help="CUDA copy path (default: the best available)")
    parser.add_argument("--pageable", action="store_true", help="do not pin the pool (CUDA)")
    parser.add_argument("--expedited", action="store_true",
                        help="expedited-load latency with and without a long store in flight")
    parser.add_argument("--processes", type=int, default=0,
                        help="N processes storing and loading their rank pages of one pool")
    args = parser.parse_args()
    if args.processes:
        out = run_two_process_check(device=args.device, world=args.processes)
    elif args.expedited:
        out = run_expedited_latency(device=args.device, quick=not args.full)
    else:
        out = run_copy_bench(quick=not args.full, device=args.device, backend=args.backend,
                             pin=False if args.pageable else None)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
