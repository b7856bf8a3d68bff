"""Base types shared by the daemon, the client and the plugin: keys, statuses, geometry.

Keys follow vLLM's ``OffloadKey``: the block hash followed by the KV-cache group index as
4 bytes big-endian unsigned. Keeping the exact byte form means a key that vLLM's scheduler
builds can be sent to the daemon unchanged.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import overload

import msgspec

GROUP_BYTES = 4


def make_key(block_hash: bytes, group_idx: int) -> bytes:
    """Pack a block hash and a group index into an offload key (vLLM's layout)."""
    return block_hash + group_idx.to_bytes(GROUP_BYTES, "big", signed=False)


def key_hash(key: bytes) -> bytes:
    """The block hash part of an offload key."""
    return key[:-GROUP_BYTES]


def key_group(key: bytes) -> int:
    """The group index part of an offload key."""
    return int.from_bytes(key[-GROUP_BYTES:], "big", signed=False)


class PackedHashes(Sequence[bytes]):
    """Block hashes packed end to end in one bytes object, all ``width`` bytes long.

    A 32k-token prompt has thousands of hashes; as one blob they cross the wire and decode in
    constant time, and a lookup slices out only the few it probes.
    """

    __slots__ = ("blob", "width", "_n")

    def __init__(self, blob: bytes, width: int) -> None:
        if width <= 0 or len(blob) % width:
            raise ValueError(f"{len(blob)} bytes are not a whole number of {width}-byte hashes")
        self.blob, self.width, self._n = blob, width, len(blob) // width

    @classmethod
    def pack(cls, hashes: Sequence[bytes]) -> PackedHashes:
        width = len(hashes[0]) if hashes else 32
        if any(len(h) != width for h in hashes):
            raise ValueError("hashes of different lengths cannot be packed")
        return cls(b"".join(hashes), width)

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...
    def __getitem__(self, i: int | slice) -> bytes | list[bytes]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        w = self.width
        return self.blob[i * w:(i + 1) * w]


class KeyStatus(enum.IntEnum):
    """Per-key lookup answer, with vLLM's ``LookupResult`` meanings."""

    MISS = 0
    HIT = 1
    HIT_PENDING = 2  # exists, still being written: counts, but defers the request
    RETRY = 3  # not known yet (a slower tier is being asked): defers, scan goes on


class GroupKind(enum.StrEnum):
    """KV-cache group kinds, named as vLLM's ``kv_cache_spec_kind`` values."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"


class GroupSpec(msgspec.Struct, frozen=True):
    """One KV-cache group of an engine, as the engine registers it."""

    kind: GroupKind
    tokens_per_block: int
    bytes_per_block: int  # bytes of one block of this group on ONE tensor-parallel rank
    sliding_window_tokens: int | None = None  # only for sliding-window groups
    mamba_align: bool = True  # Mamba in vLLM's "align" cache mode (copy-on-write snapshots)
    # vLLM's own kv_cache_spec_kind of the group ("mla_attention", "chunked_local_attention",
    # ...), published as is in events; "" when unknown (then ``kind``'s value is published).
    spec_kind: str = ""


class Geometry(msgspec.Struct, frozen=True):
    """Everything that decides whether two engines can share blocks.

    ``namespace`` names the model and anything else that changes KV bytes (revision, dtype,
    quantization, TP layout); blocks never cross namespaces, even on equal hashes.
    """

    namespace: str
    groups: tuple[GroupSpec, ...]
    tokens_per_hash: int
    tp_world_size: int = 1
    blocks_per_chunk: int = 1
    # vLLM's KV-cache group id of each group, in the same order (vLLM keys carry the id, which
    # need not be 0..n-1 when some groups are not offloaded). Empty: the ids are 0..n-1.
    group_ids: tuple[int, ...] = ()

    def group_id(self, pos: int) -> int:
        """The group id that keys of the ``pos``-th group carry."""
        return self.group_ids[pos] if self.group_ids else pos

    def group_pos(self, key: bytes) -> int:
        """Which of ``groups`` a key belongs to; ValueError for a group id we do not have."""
        gid = key_group(key)
        if not self.group_ids:
            if gid >= len(self.groups):
                raise ValueError(f"group {gid} of {len(self.groups)}")
            return gid
        return self.group_ids.index(gid)

    def tokens_per_chunk(self, group_idx: int) -> int:
        return self.groups[group_idx].tokens_per_block * self.blocks_per_chunk

    def hashes_per_chunk(self, group_idx: int) -> int:
        return self.tokens_per_chunk(group_idx) // self.tokens_per_hash

    def rank_bytes(self) -> int:
        """Bytes one rank writes for the largest group block: one rank page of a slot."""
        return max(g.bytes_per_block for g in self.groups) * self.blocks_per_chunk

    def slot_bytes(self) -> int:
        """Bytes of one pool slot for this engine: every rank's page of one key."""
        return self.rank_bytes() * self.tp_world_size
