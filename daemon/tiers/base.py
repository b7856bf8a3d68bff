"""The interface of a tier below the pool (local disk now; a shared store later).

A tier holds copies of blocks that left the pool. The pool stays the only thing engines read:
a block found in a tier is *promoted* (copied back into a pool slot) before it can be loaded,
so tiers never deal with pins, leases or slot numbers. ``contains`` is answered from memory
(it runs inside a lookup, on the event loop); everything that touches storage is async.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from kvoffload.daemon.store.index import Namespace


@dataclass(slots=True)
class TierStats:
    """Counters every tier keeps (exported as metrics and in readiness details)."""

    used_bytes: int = 0
    capacity_bytes: int = 0
    blocks: int = 0
    writes: int = 0
    write_errors: int = 0
    writes_skipped: int = 0  # backlog full, already there, or larger than the tier
    reads: int = 0
    read_errors: int = 0
    corrupt: int = 0  # failed checksum / length / header checks: dropped
    evictions: int = 0


@dataclass(slots=True, frozen=True)
class BlockMeta:
    """What a tier keeps next to a block's bytes, so a promoted block is indexed and
    announced as it was before it left the pool."""

    end_token: int
    tail: bool
    record: Any = None  # events.hub.StoredRecord of its published BlockStored, if any


class Tier(abc.ABC):
    name: str = "tier"
    medium: str = "STORAGE"  # what KV events call blocks held here

    @abc.abstractmethod
    def contains(self, ns: Namespace, key: bytes) -> bool:
        """Whether a read of ``key`` can be tried now (from memory; never does I/O)."""

    @abc.abstractmethod
    async def read(self, ns: Namespace, key: bytes) -> bytes | None:
        """The block's bytes, or None when it is gone or failed its checks (then dropped)."""

    async def read_into(self, ns: Namespace, key: bytes,
                        buf: memoryview) -> BlockMeta | None:
        """Read straight into ``buf`` (a pool slot); None on any failure. Tiers that can
        avoid the intermediate copy override this."""
        data = await self.read(ns, key)
        if data is None or len(data) > len(buf):
            return None
        buf[:len(data)] = data
        return self.meta(ns, key) or BlockMeta(0, False)

    def meta(self, ns: Namespace, key: bytes) -> BlockMeta | None:
        return None

    @abc.abstractmethod
    def write(self, ns: Namespace, key: bytes, data: bytes, meta: BlockMeta) -> bool:
        """Take a copy of a block; the write itself happens in the background. False when
        the tier declines it (full backlog, already held, too large)."""

    @abc.abstractmethod
    def remove(self, ns: Namespace, key: bytes) -> bool:
        """Forget a block (its storage is reclaimed in the background)."""

    def touch(self, ns: Namespace, key: bytes) -> None:  # noqa: B027 - optional hook
        """Mark a held block as recently used."""

    def block_size(self, ns: Namespace, key: bytes) -> int | None:
        """Bytes of the held block, to check it fits a slot before promoting it."""
        return None

    @property
    def degraded(self) -> bool:
        """True while the tier cannot serve (storage errors, store unreachable): skipped."""
        return False

    @property
    @abc.abstractmethod
    def stats(self) -> TierStats: ...

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load what survived a restart; called before the daemon reports ready."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Finish or abandon background work; called at shutdown."""
