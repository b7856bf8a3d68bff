"""``PoolSlotsSpec``: where one transfer job's blocks live in the daemon's pool.

Built by the scheduler-side manager, shipped by vLLM inside the connector metadata to every
worker process unchanged, so it is small and picklable. ``slots[i]`` and ``gens[i]`` belong to
the job's i-th key; vLLM lists keys in the order of the job's GPU blocks (group by group, one
block per key). A slot of -1 means "nothing to copy for this block" (a store the plugin could
not place). ``gens`` are, for a load, the slots' ident words as the manager read them
(generation and key tag, ``shared_index.ident``), for a store the reservation's generations: a
worker that finds a slot handed to another writer fails the load instead of using the bytes, and
writes nothing into a store slot that is no longer ours. ``lock`` (stores) is the session file
whose lock the worker holds while it copies (``connector/writer_lock.py``).

vLLM pickles the connector metadata once per step for its workers, and every worker unpickles
it: both classes pickle as one constructor call over a tuple (no attribute names, no
``__dict__`` rebuilt): a third fewer bytes than default instance pickling, and faster both ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import LoadStoreSpec


@dataclass(frozen=True)
class PoolInfo:
    """The daemon's pool as this engine is registered with it."""

    daemon_id: str
    pool_path: str
    pool_bytes: int
    slot_bytes: int  # one pool slot: every rank's page of one key
    rank_bytes: int
    index_path: str = ""  # the shared index whose generations prove a load intact

    def __reduce__(self) -> tuple[type[PoolInfo], tuple[str, str, int, int, int, str]]:
        return PoolInfo, (self.daemon_id, self.pool_path, self.pool_bytes, self.slot_bytes,
                          self.rank_bytes, self.index_path)


class PoolSlotsSpec(LoadStoreSpec):
    def __init__(self, slots: list[int], pool: PoolInfo | None, gens: list[int] | None = None,
                 req_id: str | None = None, lock: str = "", stamp: float = 0.0) -> None:
        self.slots = slots
        self.pool = pool
        self.gens = gens if gens is not None else [0] * len(slots)
        self.req_id = req_id  # loads: the request a failed copy is reported for
        self.lock = lock  # stores: the writers' lock of the session that holds the grants
        # stores: time.monotonic() when the manager took the slots, the stamp its claims carry:
        # an earmarked slot not handed over yet is waited for until stamp + HANDOVER_WAIT_S
        # (0.0: never waited for, read as revoked).
        self.stamp = stamp

    def __reduce__(self) -> tuple[type[PoolSlotsSpec], tuple[Any, ...]]:
        return PoolSlotsSpec, (self.slots, self.pool, self.gens, self.req_id, self.lock,
                               self.stamp)

    def __repr__(self) -> str:
        return f"PoolSlotsSpec(slots={self.slots}, gens={self.gens})"
