"""How one engine's KV tensors map onto the per-rank page of a pool slot.

A pool slot holds one offload key (block hash + group) for every tensor-parallel rank of an
engine; rank ``r`` owns bytes ``[r * rank_bytes, (r + 1) * rank_bytes)`` of the slot. Inside
that page, the block of group ``g`` is the concatenation of the group's *regions*: contiguous
byte ranges of one canonical tensor's page for that block id, ordered by (tensor index, byte
offset). The order is fixed by the tensor structure alone, so every engine of the same geometry
lays out a block the same way and one engine's store can feed another engine's load.

We keep the rank-local page bytes (what vLLM calls the local page) rather than vLLM's canonical,
parallelism-free page: each rank writes and reads only its own page, so no cross-rank byte
mapping is needed and a copy is a plain memcpy per region. The price is that blocks are shared
only between engines with the same TP layout, which ``Geometry.namespace`` already encodes.

This module never imports vLLM: ``layout_from_canonical`` duck-types vLLM's
``CanonicalKVCaches`` (``.tensors[i].tensor``, ``.tensors[i].page_size_bytes``,
``.group_data_refs[g][j].tensor_idx``, ``.page_size_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Region:
    """One contiguous byte range of one KV tensor's page, and where it sits in the slot page."""

    tensor_idx: int
    offset: int  # byte offset inside the tensor's page (one row of the tensor)
    nbytes: int
    page_offset: int  # byte offset inside this group's block within the rank page


@dataclass(frozen=True)
class Segment:
    """Consecutive regions of one group that one 3-D strided view covers.

    ``count`` regions of ``nbytes`` each, all in one storage and ``step`` bytes apart at every
    block (equal block strides), back to back in the slot page from ``page_offset``. vLLM's
    layer-compact layouts put every layer's page in one buffer at a fixed distance, so one
    segment usually spans every layer of a group: a job then costs one copy call per block (or
    per run of blocks) instead of one per layer, which is what keeps small pages at memcpy speed.
    """

    tensor_idx: int  # the first region's tensor
    offset: int  # the first region's offset in that tensor's page
    nbytes: int
    count: int
    step: int  # storage distance between consecutive regions (bytes); 0 when count == 1
    page_offset: int

    @property
    def total_bytes(self) -> int:
        return self.nbytes * self.count


@dataclass(frozen=True)
class GroupLayout:
    """The regions that make up one block of one KV-cache group, in slot order."""

    regions: tuple[Region, ...]

    @property
    def bytes_per_block(self) -> int:
        return sum(r.nbytes for r in self.regions)


def _merge_ranges(ranges: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Sort (tensor_idx, offset, nbytes) ranges, drop duplicates and merge overlaps.

    Several vLLM layers can reference the same bytes (aliased views, a packed block that every
    group points at); copying them once is both correct and cheaper. Adjacent ranges of one
    tensor merge into one region, so one copy covers them.
    """
    out: list[tuple[int, int, int]] = []
    for t_idx, off, n in sorted(set(ranges)):
        if n <= 0:
            continue
        if out and out[-1][0] == t_idx and off <= out[-1][1] + out[-1][2]:
            p_t, p_off, p_n = out[-1]
            out[-1] = (p_t, p_off, max(p_off + p_n, off + n) - p_off)
        else:
            out.append((t_idx, off, n))
    return out


def _group_layout(ranges: Sequence[tuple[int, int, int]]) -> GroupLayout:
    regions: list[Region] = []
    page_offset = 0
    for t_idx, off, n in _merge_ranges(ranges):
        regions.append(Region(t_idx, off, n, page_offset))
        page_offset += n
    return GroupLayout(tuple(regions))


class KVLayout:
    """An engine's KV tensors, independent of vLLM's classes.

    ``tensors``: one int8 tensor per canonical tensor, shape ``(num_blocks, page_bytes)``,
    contiguous inside a row (rows may be strided, as in vLLM's packed or aliased views).
    ``group_ranges[g]``: the ``(tensor_idx, offset, nbytes)`` byte ranges that form one block of
    group ``g``; they are sorted and merged into ``groups[g].regions``.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        group_ranges: Sequence[Sequence[tuple[int, int, int]]],
    ) -> None:
        if not tensors:
            raise ValueError("KVLayout needs at least one tensor")
        num_blocks = int(tensors[0].shape[0]) if tensors[0].dim() == 2 else -1
        device = tensors[0].device
        for i, t in enumerate(tensors):
            if t.dtype != torch.int8 or t.dim() != 2:
                raise ValueError(
                    f"tensor {i}: expected a 2-D int8 tensor, got {t.dtype} {t.dim()}-D"
                )
            if t.shape[1] > 1 and t.stride(1) != 1:
                raise ValueError(f"tensor {i}: a page row must be contiguous")
            if int(t.shape[0]) != num_blocks:
                raise ValueError(f"tensor {i}: {t.shape[0]} blocks, tensor 0 has {num_blocks}")
            if t.device != device:
                raise ValueError(f"tensor {i} is on {t.device}, tensor 0 on {device}")
        self.tensors: tuple[torch.Tensor, ...] = tuple(tensors)
        self.num_blocks = num_blocks
        self.device = device
        groups: list[GroupLayout] = []
        for g, ranges in enumerate(group_ranges):
            for t_idx, off, n in ranges:
                if not 0 <= t_idx < len(self.tensors):
                    raise ValueError(f"group {g}: tensor index {t_idx} out of range")
                if off < 0 or n < 0 or off + n > self.tensors[t_idx].shape[1]:
                    raise ValueError(f"group {g}: range {off}+{n} outside tensor {t_idx}'s page")
            groups.append(_group_layout(ranges))
        self.groups: tuple[GroupLayout, ...] = tuple(groups)
        self.segments: tuple[tuple[Segment, ...], ...] = tuple(
            _fuse(self.tensors, g.regions) for g in self.groups
        )

    def segment_view(self, seg: Segment) -> torch.Tensor:
        """``(num_blocks, count, nbytes)`` view of the KV bytes one segment covers (no copy)."""
        t = self.tensors[seg.tensor_idx]
        return t.as_strided(
            (self.num_blocks, seg.count, seg.nbytes),
            (t.stride(0), max(seg.step, 1), 1),
            t.storage_offset() + seg.offset,
        )

    @classmethod
    def from_group_tensors(cls, groups: Sequence[Sequence[torch.Tensor]]) -> KVLayout:
        """Build from plain per-group lists of (num_blocks, page) tensors (whole pages).

        A tensor listed in several groups (hybrid models alias attention and Mamba pages) is
        kept once, matched by identity.
        """
        tensors: list[torch.Tensor] = []
        index: dict[int, int] = {}
        group_ranges: list[list[tuple[int, int, int]]] = []
        for group in groups:
            ranges = []
            for t in group:
                if id(t) not in index:
                    index[id(t)] = len(tensors)
                    tensors.append(t)
                ranges.append((index[id(t)], 0, int(t.shape[1])))
            group_ranges.append(ranges)
        return cls(tensors, group_ranges)

    def bytes_per_block(self) -> tuple[int, ...]:
        """Per-group bytes of one block on this rank (``GroupSpec.bytes_per_block``)."""
        return tuple(g.bytes_per_block for g in self.groups)

    def max_bytes_per_block(self) -> int:
        return max(self.bytes_per_block(), default=0)

    def to(self, device: torch.device | str) -> KVLayout:
        """The same layout over copies of the tensors on another device (tests, benchmarks)."""
        ranges = [[(r.tensor_idx, r.offset, r.nbytes) for r in g.regions] for g in self.groups]
        return KVLayout([t.to(device) for t in self.tensors], ranges)


def _fuse(tensors: Sequence[torch.Tensor], regions: Sequence[Region]) -> tuple[Segment, ...]:
    """Greedily merge consecutive regions that one strided view can cover (see ``Segment``)."""

    def where(r: Region) -> tuple[int, int, int]:
        t = tensors[r.tensor_idx]
        return t.untyped_storage().data_ptr(), int(t.storage_offset()) + r.offset, int(t.stride(0))

    out: list[Segment] = []
    last: tuple[int, int, int] | None = None  # storage, start, row stride of the last region
    for r in regions:
        here = where(r)
        if out and last is not None:
            seg = out[-1]
            step = here[1] - last[1]
            fits = (
                here[0] == last[0]
                and here[2] == last[2]
                and r.nbytes == seg.nbytes
                and step >= seg.nbytes  # disjoint at every block: a load may write them all
                and (seg.count == 1 or step == seg.step)
            )
            if fits:
                out[-1] = Segment(seg.tensor_idx, seg.offset, seg.nbytes, seg.count + 1, step,
                                  seg.page_offset)
                last = here
                continue
        out.append(Segment(r.tensor_idx, r.offset, r.nbytes, 1, 0, r.page_offset))
        last = here
    return tuple(out)


def _canonical_ranges(kv_caches: Any) -> list[list[tuple[int, int, int]]]:
    """Per group, the (tensor_idx, 0, unpadded page bytes) of every data reference.

    Only the un-padded prefix of a page holds data (vLLM pads Mamba pages up to the attention
    page size); the padding is neither stored nor loaded.
    """
    return [
        [(int(ref.tensor_idx), 0, int(ref.page_size_bytes)) for ref in refs]
        for refs in kv_caches.group_data_refs
    ]


def _as_block_rows(tensor: torch.Tensor, page_size_bytes: int) -> torch.Tensor:
    """View a canonical tensor as int8 ``(num_blocks, page_size_bytes)`` without copying."""
    t = tensor if tensor.dtype == torch.int8 else tensor.view(torch.int8)
    if t.dim() != 2 or t.shape[1] != page_size_bytes:
        t = t.view(-1, page_size_bytes)
    return t


def layout_from_canonical(kv_caches: Any) -> KVLayout:
    """Build a KVLayout from vLLM's ``CanonicalKVCaches`` (duck-typed, no vLLM import)."""
    tensors = [
        _as_block_rows(entry.tensor, int(entry.page_size_bytes)) for entry in kv_caches.tensors
    ]
    return KVLayout(tensors, _canonical_ranges(kv_caches))


def group_bytes_per_block(kv_caches: Any) -> list[int]:
    """Per-group bytes of one block on ONE rank, from vLLM's ``CanonicalKVCaches``.

    This is the value the plugin registers as ``GroupSpec.bytes_per_block``; it equals
    ``layout_from_canonical(kv_caches).bytes_per_block()`` without touching the tensors.
    """
    return [sum(n for _, _, n in _merge_ranges(r)) for r in _canonical_ranges(kv_caches)]


def items_for_groups(
    block_ids: Sequence[int] | np.ndarray, group_sizes: Sequence[int] | None,
    slots: Sequence[int] | np.ndarray,
) -> np.ndarray:
    """Pair vLLM's grouped block ids (``GPULoadStoreSpec.block_ids``/``group_sizes``) with slots:
    an ``(n, 3)`` int64 array of ``(group_idx, block_id, slot)`` rows, in the spec's order.

    ``block_ids`` lists group 0's blocks, then group 1's, ...; with one block per chunk the
    i-th block belongs to the i-th key, whose pool slot is ``slots[i]``. ``group_sizes=None``
    is one group. Built with numpy: a job has hundreds of items and this runs on the step.
    """
    blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    where = np.asarray(slots, dtype=np.int64).reshape(-1)
    sizes = np.asarray([len(blocks)] if group_sizes is None else group_sizes, dtype=np.int64)
    if (sizes < 0).any() or int(sizes.sum()) != len(blocks) or len(where) != len(blocks):
        raise ValueError("block_ids, group_sizes and slots disagree in length")
    groups = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    return np.stack([groups, blocks, where], axis=1)


def block_run_arrays(blocks: np.ndarray, slots: np.ndarray, by_slot: bool = False,
                     ordered: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``block_runs`` as three int64 arrays (first blocks, first slots, lengths). ``ordered``:
    the items are in that order already (a plan's are), so no sort."""
    if ordered:
        b, s = blocks, slots
    else:
        order = np.argsort(slots if by_slot else blocks, kind="stable")
        b, s = blocks[order], slots[order]
    starts = np.flatnonzero(np.concatenate(([True], (np.diff(b) != 1) | (np.diff(s) != 1))))
    return b[starts], s[starts], np.diff(np.append(starts, len(b)))


def block_runs(blocks: np.ndarray, slots: np.ndarray, by_slot: bool = False
               ) -> list[tuple[int, int, int]]:
    """Split items into maximal (first_block, first_slot, count) runs: consecutive block ids
    mapped to consecutive slots, which one strided view pair can cover. Runs come in block
    order, or in slot order with ``by_slot`` (the same runs: both sides are consecutive)."""
    if len(blocks) == 0:
        return []
    b0, s0, n = block_run_arrays(blocks, slots, by_slot)
    return list(zip(b0.tolist(), s0.tolist(), n.tolist(), strict=True))
