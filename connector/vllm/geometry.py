"""The daemon-side description of a vLLM engine (``Geometry``), from vLLM's public configs.

Two engines share blocks exactly when their geometries (and so their namespaces) are equal:
everything that changes the bytes behind a key goes into the namespace digest. vLLM's block
hash covers token ids (and LoRA, multimodal inputs, cache salt), not the model behind them, so
the digest adds the model identity (``model_identity``): quantization, revision, overrides and
vLLM's whole model-config hash, and how keys are made (the prefix-hash algorithm and NONE_HASH
seed). That needs the ``VllmConfig``, which only ``KVOffloadConnector`` hands over; so are
the group kinds (its ``KVCacheConfig``). With the stock connector the namespace has the model
name and KV dtype alone, and the (common) Mamba is assumed for a one-chunk window. Keys carry
vLLM's group ids, listed in ``Geometry.group_ids``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from typing import Any

from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec

log = logging.getLogger("kvoffload.connector.vllm")

# ModelConfig fields that change the KV bytes of equal token ids. vLLM's compute_hash covers all
# of them but hf_overrides (left out there: its effect is in hf_config, which it hashes); each
# is named as well so that a model config without compute_hash still keeps engines apart. The
# tokenizer is not: keys are token ids, and equal ids give equal KV whatever produced them.
_MODEL_FIELDS = ("model", "model_weights", "dtype", "quantization", "quantization_config",
                 "revision", "code_revision", "hf_overrides")
# CacheConfig fields that change the bytes of a block without changing its size (a size change
# already shows in the group specs), and the algorithm keys are hashed with.
_CACHE_FIELDS = ("cache_dtype", "kv_cache_dtype_skip_layers", "mamba_cache_dtype",
                 "mamba_ssm_cache_dtype", "prefix_caching_hash_algo")


def _stable(value: Any) -> str:
    """Text equal in every process for equal settings (a callable by its qualified name, not
    its address: an hf_overrides function is the same override in every engine)."""
    def name(obj: Any) -> str:
        if callable(obj):
            return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
        return str(obj)

    try:
        return json.dumps(value, sort_keys=True, default=name)
    except TypeError:  # keys json cannot sort (mixed types): still one text per value
        return repr(value)


def none_hash_seed(algo: str) -> str | None:
    """The seed vLLM will derive NONE_HASH from, or None when it draws one at random.

    vLLM's engine core calls ``init_none_hash`` after it built the scheduler (and so this
    spec): ``get_none_hash_seed()`` would still answer a default or an earlier engine's seed.
    So the seed is resolved by vLLM's own rule (``resolve_none_hash_seed``): ``PYTHONHASHSEED``,
    else a fixed seed for a cryptographic hash, else fresh random bytes (xxhash), which is the
    one case where two resolutions differ.
    """
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

    fn = get_hash_fn_by_name(algo)
    seed = resolve_none_hash_seed(fn)
    return seed if seed == resolve_none_hash_seed(fn) else None


def model_identity(vllm_config: Any) -> tuple[str, ...] | None:
    """What of ``vllm_config`` decides the bytes and the keys of equal tokens (None: unknown,
    the stock connector hands no ``VllmConfig`` over)."""
    if vllm_config is None:
        return None
    model, cache = vllm_config.model_config, vllm_config.cache_config
    compute = getattr(model, "compute_hash", None)  # absent on stub model configs (tests)
    parts = [f"model_config_hash={compute() if callable(compute) else None}"]
    parts += [f"{f}={_stable(getattr(model, f, None))}" for f in _MODEL_FIELDS]
    parts += [f"{f}={_stable(getattr(cache, f, None))}" for f in _CACHE_FIELDS]
    algo = str(getattr(cache, "prefix_caching_hash_algo", "sha256"))
    seed = none_hash_seed(algo)
    if seed is None:
        # Keys of this process match no other process's: a namespace of its own says so, and
        # keeps its non-cryptographic keys out of every other engine's namespace.
        log.info("kvoffload: prefix_caching_hash_algo %s with a random NONE_HASH seed "
                 "(PYTHONHASHSEED unset): block hashes differ in every process, so this "
                 "engine's offloaded blocks are never shared with another one", algo)
        seed = f"private-{uuid.uuid4().hex}"
    parts.append(f"none_hash_seed={seed}")
    return tuple(parts)


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


def build_geometry(config: Any, kv_cache_config: Any = None, vllm_config: Any = None
                   ) -> Geometry:
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
                     groups, ids, model_identity(vllm_config), extra))
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    name = (f"{config.model.name}|{config.model.dtype}|tp{par.tp_size}pp{par.pp_size}"
            f"{'|' + extra if extra else ''}|{digest}")
    if len(name) > 512:
        name = name[-512:]
    return Geometry(namespace=name, groups=groups, tokens_per_hash=config.cache.tokens_per_hash,
                    tp_world_size=max(1, par.world_size),
                    blocks_per_chunk=config.cache.blocks_per_chunk,
                    group_ids=() if ids == tuple(range(len(ids))) else ids)
