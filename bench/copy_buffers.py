"""Shared pieces of the copy benchmarks (bench/suites/copy.py, bench/copy_checks.py): KV layouts in
vLLM's layer-compact form, pseudo-random fills, cold-cache timing, device selection."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import torch
from kvoffload.connector.transfer.engine import KVLayout


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fill(t: torch.Tensor, seed: int) -> None:
    """Pseudo-random bytes, cheaply: one random MiB tiled over the tensor (rolled each time)."""
    flat = t.view(-1)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    chunk = torch.randint(-128, 128, (1 << 20,), dtype=torch.int8, generator=gen).to(t.device)
    for start in range(0, flat.numel(), chunk.numel()):
        n = min(chunk.numel(), flat.numel() - start)
        flat[start : start + n].copy_(chunk[:n])
        chunk = chunk.roll(4097)


SCRATCH: list[np.ndarray] = []


def evict_caches() -> None:
    """Read and write 64 MiB through the caches (untimed) so the next timed copy starts cold,
    as in an engine: otherwise whichever side ran the same copy just before reads from L3. In
    1 MiB pieces: one large memcpy would use non-temporal stores, which bypass the caches."""
    if not SCRATCH:
        SCRATCH.extend(np.ones(64 << 20, dtype=np.int8) for _ in range(2))
    src, dst = SCRATCH
    for start in range(0, len(src), 1 << 20):
        np.copyto(dst[start : start + (1 << 20)], src[start : start + (1 << 20)])


def timed(fn: Callable[[], None], device: torch.device) -> float:
    evict_caches()
    sync_device(device)
    t0 = time.perf_counter()
    fn()
    sync_device(device)
    return time.perf_counter() - t0


def kv_layout(layers: int, num_blocks: int, page: int, dev: torch.device, spare: int = 0
            ) -> tuple[KVLayout, torch.Tensor]:
    """vLLM's layer-compact layout: one buffer, layer l's pages at l * num_blocks * page; and
    ``spare`` more bytes of the same allocation (same pages, huge or not) for the floor."""
    flat = torch.empty(layers * num_blocks * page + spare, dtype=torch.int8, device=dev)
    buf = flat[: layers * num_blocks * page].view(layers, num_blocks, page)
    fill(buf, page)
    return (KVLayout([buf[i] for i in range(layers)], [[(i, 0, page) for i in range(layers)]]),
            flat[layers * num_blocks * page :])


def pick_device(device: str | None) -> torch.device:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def pool_folder(need_bytes: int = 4 << 30) -> str | None:
    """Where the benchmarks put their pool files: ``$KVOFFLOAD_BENCH_DIR``, else /dev/shm when
    it has room (a container's default 64 MiB /dev/shm would turn the pre-fault into a SIGBUS
    on first copy), else the temp folder."""
    if os.environ.get("KVOFFLOAD_BENCH_DIR"):
        return os.environ["KVOFFLOAD_BENCH_DIR"]
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if st.f_bavail * st.f_frsize >= need_bytes else None
