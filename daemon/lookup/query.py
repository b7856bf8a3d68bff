"""The lookup's data and key helpers: query, outcome, per-group constants, chunk and tail keys.

Split from ``lookup.py`` so the algorithm module stays readable; import these names from
``kvoffload.daemon.lookup.plan`` as before (it re-exports them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvoffload.daemon.base import Geometry, GroupKind, KeyStatus, make_key

Probe = Callable[[bytes], KeyStatus]

_HIT = KeyStatus.HIT
_MISS = KeyStatus.MISS
_PENDING = KeyStatus.HIT_PENDING


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class LookupQuery:
    block_hashes: Sequence[bytes]  # the request's fine hashes, one per tokens_per_hash tokens
    num_tokens: int  # request tokens (vLLM's req.num_tokens)
    num_prompt_tokens: int
    local_tokens: int  # tokens already computed locally (GPU prefix cache)


@dataclass(slots=True)
class LookupOutcome:
    # Tokens beyond local_tokens that can be loaded; None = deferred (a key pending or retried).
    hit_tokens: int | None
    # Part of the hit found by the complete-chunk scan (vLLM's "complete hit").
    chunk_tokens: int
    # Absolute boundary of a partial-tail hit, else None.
    tail_boundary: int | None
    # Keys a load of this hit reads, in vLLM's prepare_load order.
    load_keys: list[bytes] = field(default_factory=list)
    # Keys answered HIT_PENDING / RETRY that made the answer a deferral.
    deferred_keys: list[bytes] = field(default_factory=list)
    probes: int = 0

    @property
    def deferred(self) -> bool:
        return self.hit_tokens is None


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """Per-group constants of a geometry, computed once."""

    index: int
    suffix: bytes  # the 4-byte group part of this group's keys
    tokens_per_block: int
    tokens_per_chunk: int
    hashes_per_chunk: int
    # None for full attention; vLLM treats Mamba as a window of one chunk.
    window_chunks: int | None
    # Sliding-window attention only: the window in tokens (widens the first suffix run).
    sliding_window_tokens: int
    is_mamba: bool
    # Mamba in align mode: its state at a boundary is a copy-on-write snapshot.
    cow: bool


class _Scratch:
    """Mutable per-call state, one allocation per lookup."""

    __slots__ = ("probes", "deferred", "hit_end")

    def __init__(self, num_groups: int) -> None:
        self.probes = 0
        self.deferred: list[bytes] = []
        # Per full-attention group: end chunk index of its confirmed prefix hits
        # (vLLM's lookup_hit_end_chunk_idx); decides which bridge keys need a probe.
        self.hit_end = [0] * num_groups


def _unique(keys: list[bytes]) -> list[bytes]:
    """Keys in first-seen order without repeats (a key may be probed in two passes)."""
    return list(dict.fromkeys(keys))


def _tail_ok(geometry: Geometry) -> bool:
    groups = geometry.groups
    tph = geometry.tokens_per_hash
    return (
        geometry.blocks_per_chunk == 1
        and len({g.tokens_per_block for g in groups}) == 1
        and any(
            g.kind is GroupKind.MAMBA and g.mamba_align and g.tokens_per_block > tph for g in groups
        )
        # Every group is full attention or a copy-on-write recurrent group, so one
        # boundary names every group's source.
        and all(
            g.kind is GroupKind.FULL_ATTENTION or (g.kind is GroupKind.MAMBA and g.mamba_align)
            for g in groups
        )
    )


def chunk_keys(geometry: Geometry, block_hashes: Sequence[bytes], group_idx: int) -> list[bytes]:
    """Keys of every complete chunk of a group: the last fine hash inside each chunk."""
    step = geometry.hashes_per_chunk(group_idx)
    suffix = make_key(b"", geometry.group_id(group_idx))
    return [block_hashes[pos] + suffix for pos in range(step - 1, len(block_hashes), step)]


def tail_key(
    geometry: Geometry, block_hashes: Sequence[bytes], group_idx: int, boundary: int
) -> bytes:
    """Key of a group's state at token ``boundary`` (a multiple of tokens_per_hash)."""
    tph = geometry.tokens_per_hash
    if boundary <= 0 or boundary % tph:
        raise ValueError(f"boundary {boundary} is not a positive multiple of {tph}")
    return make_key(block_hashes[boundary // tph - 1], geometry.group_id(group_idx))
