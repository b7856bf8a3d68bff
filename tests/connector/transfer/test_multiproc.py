"""Several TP ranks in their own processes share one pool file: each rank's vLLM WORKER-role
OffloadingConnector (our spec loaded, its rank from vLLM's parallel config) stores its page of
every slot and loads it back; the parent checks every rank's page in the file itself."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_harness import vllm_import_error  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]

RANK_BYTES = 2048  # the attention block (2 layers x 1 KiB) is the larger group's block
SLOTS = 16
SENTINEL = 0x5A


# vLLM's import chain takes seconds per process on these 2 cores: a fork server (a fresh
# interpreter like spawn, never a fork of the pytest process and its threads) imports it once
# and forks every rank from there.
_PRELOAD = ["torch", "vllm.config", "vllm.v1.kv_cache_interface", "vllm.v1.kv_offload.base",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
            "kvoffload.connector.vllm", "tests.copier_rank_proc"]


def _context() -> Any:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


@pytest.fixture
def shared_pool() -> Iterator[dict[str, Any]]:
    from kvoffload.daemon.store.shared_index import SharedIndexWriter

    base = f"/dev/shm/kvoffload-mp-{uuid.uuid4().hex[:10]}"
    writer = SharedIndexWriter(base + ".index", SLOTS, "daemon-mp-test")
    yield {"base": base, "index_path": base + ".index", "daemon_id": "daemon-mp-test",
           "slots": SLOTS}
    writer.close()
    Path(base).unlink(missing_ok=True)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_in_processes_share_one_pool(shared_pool: dict[str, Any], world: int) -> None:
    from tests.copier_rank_proc import rank_main

    slot_bytes = world * RANK_BYTES
    size = SLOTS * slot_bytes
    with open(shared_pool["base"], "wb") as f:
        f.write(bytes([SENTINEL]) * size)
    pool = {**shared_pool, "path": shared_pool["base"], "bytes": size, "slot_bytes": slot_bytes}
    ctx = _context()
    barrier, out = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, pool, barrier, out), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        results = dict(out.get(timeout=120) for _ in range(world))
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    errors = {r: v for r, v in results.items() if isinstance(v, str)}
    assert not errors, errors
    data = Path(pool["path"]).read_bytes()
    for rank, res in results.items():
        assert res["stored"] == [(1, True)] and res["loaded"] == [(2, True)], res
        assert res["restored"], f"rank {rank} did not get its own bytes back"
        for slot, (n, digest) in res["pages"].items():
            page = data[slot * slot_bytes + rank * RANK_BYTES:][:RANK_BYTES]
            assert hashlib.sha256(page[:n]).hexdigest() == digest, (rank, slot)
            assert set(page[n:]) <= {SENTINEL}, (rank, slot)  # nothing past the block
    # Every rank wrote different KV: no page is a copy of another rank's.
    first = {s: results[0]["pages"][s][1] for s in results[0]["pages"]}
    assert all(results[r]["pages"][s][1] != first[s] for r in range(1, world) for s in first)
    assert os.path.getsize(pool["path"]) == size
