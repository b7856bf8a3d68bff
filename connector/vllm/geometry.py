"""The daemon-side description of a vLLM engine (``Geometry``), from vLLM's public configs.

Two engines share blocks exactly when their geometries (and so their namespaces) are equal:
everything that changes the bytes behind a key goes into the namespace digest. Group kinds come
from the ``KVCacheConfig`` when ``KVOffloadConnector`` hands it over; with the stock connector
only the window sizes of ``OffloadingConfig`` are known, and the (common) Mamba is assumed for
a one-chunk window. Keys carry vLLM's group ids, listed in ``Geometry.group_ids``.
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec


def _group_spec(group: Any, kv_cache_config: Any, config: Any) -> GroupSpec:
    tokens = group.tokens_per_block
    nbytes = config.worker_kv_bytes_per_block
    if kv_cache_config is None:
        window = group.sliding_window_size_in_chunks
        if window is None:
            return GroupSpec(GroupKind.FULL_ATTENTION, tokens, nbytes)
        if window == 1:
            return GroupSpec(GroupKind.MAMBA, tokens, nbytes,
                             mamba_align=tokens > config.cache.tokens_per_hash)
        return GroupSpec(GroupKind.SLIDING_WINDOW, tokens, nbytes,
                         sliding_window_tokens=window * tokens * config.cache.blocks_per_chunk)
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
        get_kv_cache_spec_kind,
        iter_layer_specs,
    )

    kv_group = kv_cache_config.kv_cache_groups[group.group_id]
    spec = kv_group.kv_cache_spec
    kind = get_kv_cache_spec_kind(spec).value
    # vLLM's per-block bytes (what its own CPU tier sizes chunks by) covers every group's
    # pages, packed layouts included; the group's own padded pages only when it is unknown.
    nbytes = nbytes or (spec.page_size_bytes if isinstance(spec, UniformTypeKVCacheSpecs)
                        else spec.page_size_bytes * len(kv_group.layer_names))
    layer = next(iter(iter_layer_specs(spec)))
    if isinstance(layer, MambaSpec):
        return GroupSpec(GroupKind.MAMBA, tokens, nbytes,
                         mamba_align=layer.mamba_cache_mode == "align", spec_kind=kind)
    if isinstance(layer, ChunkedLocalAttentionSpec):
        return GroupSpec(GroupKind.SLIDING_WINDOW, tokens, nbytes,
                         sliding_window_tokens=layer.attention_chunk_size, spec_kind=kind)
    if isinstance(layer, SlidingWindowSpec):
        return GroupSpec(GroupKind.SLIDING_WINDOW, tokens, nbytes,
                         sliding_window_tokens=layer.sliding_window, spec_kind=kind)
    return GroupSpec(GroupKind.FULL_ATTENTION, tokens, nbytes, spec_kind=kind)


def build_geometry(config: Any, kv_cache_config: Any = None) -> Geometry:
    """``config`` is vLLM's ``OffloadingConfig``; equal engines get equal namespaces."""
    groups = tuple(_group_spec(g, kv_cache_config, config) for g in config.groups)
    ids = tuple(g.group_id for g in config.groups)
    par = config.parallel
    extra = str(config.extra_config.get("kvoffload_namespace", ""))
    # Everything that changes the bytes behind a key, beyond the group shapes themselves.
    identity = repr((config.model.name, config.model.dtype, par.world_size, par.tp_size,
                     par.pp_size, par.pcp_size, par.dcp_size, config.kv_cache_layout,
                     config.canonical_layout, config.replicated_layout,
                     config.cache.tokens_per_hash, [g.layer_names for g in config.groups],
                     groups, ids, extra))
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    name = (f"{config.model.name}|{config.model.dtype}|tp{par.tp_size}pp{par.pp_size}"
            f"{'|' + extra if extra else ''}|{digest}")
    if len(name) > 512:
        name = name[-512:]
    return Geometry(namespace=name, groups=groups, tokens_per_hash=config.cache.tokens_per_hash,
                    tp_world_size=max(1, par.world_size),
                    blocks_per_chunk=config.cache.blocks_per_chunk,
                    group_ids=() if ids == tuple(range(len(ids))) else ids)
