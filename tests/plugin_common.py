"""Small helpers shared by the vLLM plugin tests (vLLM imported lazily)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from kvoffload.connector.client import DaemonClient  # noqa: E402
from kvoffload.daemon.base import Geometry, make_key  # noqa: E402
from kvoffload.daemon.control import protocol as p  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadKey


def plugin_config(control: str, **extra: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` loading our spec against the daemon at ``control``."""
    return {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.connector.vllm",
            "kvoffload_control": control, "kvoffload_timeout_ms": 2000,
            # Steps run back to back here (no model): wait for our own writes' replies, so
            # runs are deterministic on a loaded 2-core machine. Engines keep the default.
            "kvoffload_sync_ms": 2000,
            # Nor give up on another engine's store or a tier's find (test_pending_wait.py
            # sets its own bound): a loaded host must not turn an expected load into a compute.
            "kvoffload_pending_wait_ms": 60_000, **extra}


def connect(control: str, geometry: Geometry) -> DaemonClient:
    """A second client of the daemon, registered like the engine (same namespace)."""
    client = DaemonClient(control, timeout_ms=2000, name="test")
    for _ in range(500):  # a fresh socket refuses sends until it has connected
        try:
            client.register(geometry)
            return client
        except Exception:
            import time

            time.sleep(0.01)
    raise AssertionError("daemon did not accept a registration")


def store(client: DaemonClient, keys: Sequence[bytes], *, commit: bool = True, end_token: int = 0,
          block: int = 16) -> list[int]:
    """Store keys (whose bytes nobody reads) and return their slots; ``end_token`` marks
    where their states end (a tail when it is not a multiple of ``block``)."""
    grant = client.prepare_store([p.StoreItem(key=k, end_token=end_token,
                                              tail=end_token % block != 0) for k in keys])
    assert all(o == p.StoreOutcome.GRANTED for o in grant.outcomes), grant
    if commit:
        client.commit_store(keys)
    return grant.slots


def offload_key(block_hash: bytes, group: int) -> OffloadKey:
    """Our key of a block hash in a group, typed as the key vLLM's manager API takes (vLLM's
    ``OffloadKey`` is ``bytes`` under another name: no conversion at run time)."""
    return cast("OffloadKey", make_key(block_hash, group))


def keys_at(block_hashes: Sequence[bytes], hash_idx: int,
            groups: tuple[int, ...] = (0, 1)) -> list[OffloadKey]:
    return [offload_key(block_hashes[hash_idx], g) for g in groups]


def end_step(connector: Any) -> Any:
    """Close a scheduler step with nothing scheduled (vLLM's build_connector_meta)."""
    from kvoffload.bench.vllm_baseline import end_step as close_step

    return close_step(connector)


def wait_until(cond: Callable[[], bool], seconds: float = 15) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def hold_first(worker: Any, where: str) -> tuple[threading.Event, threading.Event]:
    """Hold the first store (``where`` = "copy": after the lock and pre-check, "submit":
    before the lock) or load ("load": before its bytes are copied) of ``worker``; returns
    (entered, release)."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        if not entered.is_set():
            entered.set()
            release.wait(30)

    if where == "submit":
        submit_store = worker.submit_store

        def held_submit(job_id: int, src: Any, dst: Any) -> bool:
            hold()
            return bool(submit_store(job_id, src, dst))

        worker.submit_store = held_submit
        return entered, release
    original = worker._copier_for

    def copier_for(pool: Any) -> Any:
        copier = original(pool)
        if getattr(copier, "_held", False):
            return copier
        name = "submit_load" if where == "load" else "submit_store"
        submit = getattr(copier, name)

        def held(job_id: int, items: Any) -> bool:
            hold()
            return bool(submit(job_id, items))

        setattr(copier, name, held)
        copier._held = True
        return copier

    worker._copier_for = copier_for
    return entered, release


def kv_matches(e: Any, req_id: str, prompt: list[int], upto: int = 28) -> bool:
    """Whether the KV ``e``'s model holds for ``req_id`` is exactly what the fake model
    computes for ``prompt[:upto]`` (attention rows and the recurrent state)."""
    from kvoffload.bench.vllm_engine import BLOCK, ROW, state_page, token_row

    attn, mamba = e.block_table(req_id)
    rows = all(bytes(e.pages["attn.0"][attn[t // BLOCK], ROW * (t % BLOCK):
                                       ROW * (t % BLOCK + 1)].numpy())
               == bytes(token_row(prompt, t).numpy()) for t in range(upto))
    return rows and bytes(e.pages["mamba.0"][mamba[(upto - 1) // BLOCK]].numpy()) == bytes(
        state_page(prompt[:upto]).numpy())


def run_held(e: Any, entered: threading.Event) -> threading.Thread:
    """Run ``e`` on a thread until its held job is reached (``hold_first``)."""
    runner = threading.Thread(target=e.run, daemon=True)
    runner.start()
    assert entered.wait(30), "the held job was never reached"
    return runner


def flood(other: DaemonClient, pool: Any, tag: str, slot_bytes: int) -> dict[int, bytes]:
    """Another writer stores every block it can get, with bytes of its own written into the
    mapped ``pool``; returns slot -> the bytes it wrote."""
    import hashlib

    written: dict[int, bytes] = {}
    for i in range(64):
        key = make_key(hashlib.sha256(f"{tag}-{i}".encode()).digest(), 0)
        grant = other.prepare_store([p.StoreItem(key=key, end_token=16)])
        if grant.outcomes != [p.StoreOutcome.GRANTED]:
            continue
        slot = grant.slots[0]
        data = hashlib.sha256(key).digest() * (slot_bytes // 32)
        pool[slot * slot_bytes:(slot + 1) * slot_bytes] = data
        other.commit_store([key])
        written[slot] = data
    return written
