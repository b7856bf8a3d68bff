"""Checks of a ``Register``: an engine's geometry, and the bounds on what it may make the
daemon keep (namespaces; slots when its block would size the pool).

Split from ``service.py`` (which re-exports these names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.daemon.base import Geometry, GroupKind
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.control.errors import RequestError
from kvoffload.daemon.control.errors import bad_request as _bad
from kvoffload.daemon.lookup import plan as lk

if TYPE_CHECKING:
    from kvoffload.daemon.store.index import BlockIndex

# Namespaces are never forgotten while the daemon runs: bound what clients can make it keep.
MAX_NAMESPACES = 4096
# Without --slot-bytes the first engine sizes the pool's slots: refuse a block size that would
# make a useless pool: ~120 B of bookkeeping per slot (index, policy, shared index) past 2M
# slots, or fewer slots than one long request stores.
MAX_SLOTS = 1 << 21
MIN_SLOTS = 16



def validate_geometry(g: Geometry, rank: int) -> None:
    if not g.namespace or len(g.namespace) > 512:
        raise _bad("namespace must be 1..512 characters")
    if not 1 <= len(g.groups) <= 64:
        raise _bad("an engine has 1..64 KV-cache groups")
    if g.group_ids and (len(g.group_ids) != len(g.groups) or len(set(g.group_ids)) != len(g.groups)
                        or not all(0 <= i < 1 << 32 for i in g.group_ids)):
        raise _bad("group_ids must name each group once, as 4-byte unsigned ids")
    if g.tokens_per_hash <= 0 or g.blocks_per_chunk <= 0:
        raise _bad("tokens_per_hash and blocks_per_chunk must be positive")
    if not 1 <= g.tp_world_size <= 1024 or not 0 <= rank < g.tp_world_size:
        raise _bad(f"rank {rank} is not in a tensor-parallel world of {g.tp_world_size}")
    for i, grp in enumerate(g.groups):
        if grp.tokens_per_block <= 0 or grp.tokens_per_block % g.tokens_per_hash:
            raise _bad(f"group {i}: tokens_per_block {grp.tokens_per_block} is not a positive "
                       f"multiple of tokens_per_hash {g.tokens_per_hash}")
        if grp.bytes_per_block <= 0:
            raise _bad(f"group {i}: bytes_per_block must be positive")
        if grp.kind == GroupKind.SLIDING_WINDOW and not grp.sliding_window_tokens:
            raise _bad(f"group {i}: a sliding-window group needs sliding_window_tokens")
    try:
        lk.plan_for(g)  # the lookup's own consistency rules (e.g. Mamba chunk sizes agree)
    except ValueError as exc:
        raise _bad(str(exc)) from None


def size_pool(index: BlockIndex, g: Geometry, slot_bytes: int) -> None:
    """The first Register of a pool without ``--slot-bytes``: this engine's block sizes the
    slots (``slot_bytes`` when set), and the shared index is published."""
    pool = index.pool
    want = g.slot_bytes()
    low = -(-pool.pool_bytes // MAX_SLOTS)
    if not low <= want <= pool.pool_bytes // MIN_SLOTS:
        raise RequestError(
            p.ErrorCode.GEOMETRY_MISMATCH,
            f"this engine's block ({want} bytes) would size the pool's slots, and a "
            f"slot must be {low}..{pool.pool_bytes // MIN_SLOTS} bytes for a pool of "
            f"{pool.pool_bytes} bytes ({MIN_SLOTS}..{MAX_SLOTS} slots); set "
            "--slot-bytes (or pool_bytes) for the engines of this node")
    try:
        index.configure(slot_bytes or want)
    except OSError as exc:  # PrivateFileError too: a planted or foreign index file
        raise RequestError(p.ErrorCode.INTERNAL, f"cannot publish the shared index: "
                           f"{exc}") from None
