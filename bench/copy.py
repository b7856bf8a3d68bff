"""Block copy throughput through the shared pool vs a plain torch copy of the same bytes.

``python -m kvoffload.bench.copy [--full]`` prints one JSON object. (Run it as a module: run
as ``python bench/copy.py`` this file would shadow the standard library's ``copy``.)

What is measured, in one process run, interleaved rep by rep so drift hits both sides alike:

* ours: one store job (KV blocks -> pool slots) then one load job (slots -> other KV blocks),
  each waited for, through a real pre-faulted ``/dev/shm`` file mapped by ``PoolMapping`` and
  ``BlockCopier``. Block ids and slots are shuffled, as a long-running engine and pool would
  have them, so no two items coalesce; a second variant with consecutive ids/slots is reported
  as ``ratio_consecutive``.
* baseline: the same number of bytes copied twice (there and back) between two contiguous,
  pre-touched tensors with ``Tensor.copy_``: the memcpy floor (CPU), or pinned host <-> device
  ``cudaMemcpyAsync`` (CUDA).

``ratio`` = ours / baseline throughput (medians over the reps); the target is 0.8 on CPU and
0.9 on CUDA. Bytes are checked after the last rep, so a fast wrong copy cannot pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from kvoffload.connector.copier import BlockCopier, KVLayout, PoolMapping


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fill(t: torch.Tensor, gen_seed: int) -> None:
    """Pseudo-random bytes, cheaply: one random MiB tiled over the tensor."""
    flat = t.view(-1)
    gen = torch.Generator(device="cpu").manual_seed(gen_seed)
    chunk = torch.randint(-128, 128, (1 << 20,), dtype=torch.int8, generator=gen).to(t.device)
    for start in range(0, flat.numel(), chunk.numel()):
        n = min(chunk.numel(), flat.numel() - start)
        flat[start : start + n].copy_(chunk[:n])
        chunk = chunk.roll(4097)  # so that no two MiB of the tensor are equal


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def run_copy_bench(quick: bool = True, device: str | None = None) -> dict[str, Any]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    # Hybrid-like pages: every layer's page is MiB-scale because one page must hold a Mamba
    # state (spec/partial-tail.md: Qwen3.6-27B pages are about 3 MiB per layer). vLLM grows the
    # attention page until it fits the state, so the un-padded state fills most of the page.
    layers, page, items_per_job, reps = (4, 1 << 20, 48, 5) if quick else (8, 1 << 20, 64, 7)
    mamba_bytes = page - page // 16
    num_blocks = 2 * items_per_job + 8
    tensors = [torch.empty(num_blocks, page, dtype=torch.int8, device=dev) for _ in range(layers)]
    for i, t in enumerate(tensors):
        _fill(t, i)
    layout = KVLayout(
        tensors,
        [[(i, 0, page) for i in range(layers)], [(i, 0, mamba_bytes) for i in range(layers)]],
    )
    slot_bytes = layout.max_bytes_per_block()
    num_slots = items_per_job + 4

    gen = torch.Generator().manual_seed(1)
    perm_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    perm_slots = torch.randperm(num_slots, generator=gen).tolist()
    groups = [i % 2 for i in range(items_per_job)]
    shuffled = (
        [(g, perm_blocks[i], perm_slots[i]) for i, g in enumerate(groups)],
        [(g, perm_blocks[items_per_job + i], perm_slots[i]) for i, g in enumerate(groups)],
    )
    # Consecutive variant: group 0 then group 1, consecutive block ids and slots.
    half = items_per_job // 2
    order = [0] * half + [1] * (items_per_job - half)
    consecutive = (
        [(g, i, i) for i, g in enumerate(order)],
        [(g, items_per_job + i, i) for i, g in enumerate(order)],
    )
    job_bytes = sum(layout.groups[g].bytes_per_block for g in groups)

    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="kvoffload-bench-pool-", dir=folder)
    os.close(fd)
    os.truncate(path, num_slots * slot_bytes)
    # Baseline buffers: contiguous, pre-touched; pinned on CUDA (what cudaMemcpy is best at).
    pin = dev.type == "cuda"
    host = torch.zeros(job_bytes, dtype=torch.int8, pin_memory=pin)
    src = torch.empty(job_bytes, dtype=torch.int8, device=dev)
    back = torch.empty(job_bytes, dtype=torch.int8, device=dev)
    _fill(src, 99)
    back.zero_()

    def baseline() -> None:
        host.copy_(src, non_blocking=pin)
        back.copy_(host, non_blocking=pin)

    try:
        # populate=True pre-faults the pool as the daemon does: first touch of /dev/shm pages
        # is 10x slower than a copy and must not be measured.
        mapping = PoolMapping(path, num_slots * slot_bytes, populate=True)
        copier = BlockCopier(mapping, layout, 0, 1, slot_bytes, dev)
        job_id = 0

        def ours(items: tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]) -> None:
            nonlocal job_id
            store_id, load_id = job_id, job_id + 1
            job_id += 2
            copier.submit_store(store_id, items[0])
            copier.wait([store_id])
            copier.submit_load(load_id, items[1])
            copier.wait([load_id])
            results = copier.get_finished()
            if not all(r.ok for r in results) or len(results) != 2:
                raise RuntimeError(f"copy failed: {results}")

        times: dict[str, list[float]] = {"ours": [], "consecutive": [], "baseline": []}
        for rep in range(reps + 1):  # rep 0 warms caches, allocator and streams
            t_base = _timed(baseline, dev)
            t_cons = _timed(lambda: ours(consecutive), dev)
            # Shuffled last: the byte check below reads what its load wrote.
            t_ours = _timed(lambda: ours(shuffled), dev)
            if rep:
                times["baseline"].append(t_base)
                times["ours"].append(t_ours)
                times["consecutive"].append(t_cons)

        verified = all(
            all(
                torch.equal(
                    tensors[r.tensor_idx][b, r.offset : r.offset + r.nbytes],
                    tensors[r.tensor_idx][b2, r.offset : r.offset + r.nbytes],
                )
                for r in layout.groups[g].regions
            )
            for (g, b, _), (_, b2, _) in zip(*shuffled, strict=True)
        ) and torch.equal(src, back)
        pinned = mapping.pinned
        copier.close()
        mapping.close()
    finally:
        os.unlink(path)

    moved = 2 * job_bytes
    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: moved / v / 1e9 for k, v in med.items()}
    ratio = gbps["ours"] / gbps["baseline"]
    target = 0.9 if dev.type == "cuda" else 0.8
    return {
        "device": str(dev),
        "pinned": pinned,
        "quick": quick,
        "reps": reps,
        "items_per_job": items_per_job,
        "block_bytes": list(layout.bytes_per_block()),
        "bytes_per_rep": moved,
        "ours_gbps": round(gbps["ours"], 2),
        "consecutive_gbps": round(gbps["consecutive"], 2),
        "baseline_gbps": round(gbps["baseline"], 2),
        "ratio": round(ratio, 3),
        "ratio_consecutive": round(gbps["consecutive"] / gbps["baseline"], 3),
        "target": target,
        "meets": ratio >= target,
        "verified": verified,
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="kvoffload block copy benchmark")
    parser.add_argument("--full", action="store_true", help="larger run (default: quick)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    args = parser.parse_args()
    print(json.dumps(run_copy_bench(quick=not args.full, device=args.device), indent=2))


if __name__ == "__main__":
    main()
