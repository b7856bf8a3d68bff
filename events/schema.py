"""Wire schema of KV events, byte-compatible with vLLM 0.33 (see shared/spec/kv-events.md).

Two independent schemas live here:

* the **KV-event stream** (`EventBatch` of `BlockStored` / `BlockRemoved` / `AllBlocksCleared`)
  that routers and indexers (llm-d, Dynamo, vLLM's own subscriber) already decode. Struct
  options and field order mirror vLLM 0.33 exactly, because consumers decode by position and
  key order and our golden vectors pin the bytes.
* our own **lookup events** (`LookupEventBatch` of `LookupEvent`), versioned by
  `schema_version`. They must never be published on the KV stream: an unknown event type makes
  every known router reject the whole batch.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

__all__ = [
    "LOOKUP_SCHEMA_VERSION",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "MISS_REASONS",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "KVEvent",
    "LookupEvent",
    "LookupEventBatch",
    "LookupOutcome",
    "MalformedPayload",
    "UnsupportedSchemaVersion",
    "decode_batch",
    "decode_lookup_batch",
    "encode_batch",
    "encode_batch_positional",
    "encode_lookup_batch",
    "hash_to_int",
    "to_json_dict",
]

MEDIUM_GPU: Final = "GPU"
MEDIUM_CPU: Final = "CPU"
MEDIUM_STORAGE: Final = "STORAGE"

# vLLM publishes either the last 8 digest bytes as an unsigned int (its default) or the raw
# digest as msgpack bin; both must round-trip unchanged (we republish, never re-derive).
BlockHash = int | bytes


class MalformedPayload(ValueError):
    """A payload that is not a valid batch of this schema (bad msgpack, wrong shape or types)."""


class UnsupportedSchemaVersion(MalformedPayload):
    """A lookup-event batch whose `schema_version` this code does not understand."""

    def __init__(self, version: object) -> None:
        super().__init__(f"unsupported lookup-event schema_version {version!r}")
        self.version = version


def hash_to_int(b: bytes) -> int:
    """vLLM's int form of a block hash: the digest's last 8 bytes, read big-endian."""
    return int.from_bytes(b[-8:], "big")


# ---------------------------------------------------------------------------------------------
# KV-event stream (vLLM 0.33 layout)
# ---------------------------------------------------------------------------------------------


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the stream's events: a map whose first key is `type` = the class name."""


class BlockStored(KVCacheEvent):
    # Required fields (always on the wire, possibly nil), in vLLM's declaration order.
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated upstream; kept for positional/legacy consumers
    medium: str | None
    lora_name: str | None
    # Defaulted fields: omitted on the wire when equal to the default.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """`[ts, events, data_parallel_rank]`: always 3 elements, even with a nil rank."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# Pre-June-2026 (before vLLM PR #42892) events were positional arrays, tag first. Twins for
# decoding (trailing fields get defaults because older engines sent shorter arrays) and for
# the llm-d profile's encoding: llm-d-kv-cache (v0.8.1) still reads events by position and
# fails a whole batch whose events are maps. (msgspec writes every field of an array_like
# struct, trailing defaults included; position readers ignore the tail.)
class _LegacyBlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                         tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _LegacyBlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                          tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _LegacyAllBlocksCleared(msgspec.Struct, array_like=True, gc=False,
                              tag="AllBlocksCleared"):
    pass


_LegacyEvent = _LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared
_LEGACY_TO_CANONICAL: Final[dict[type, type]] = {
    _LegacyBlockStored: BlockStored,
    _LegacyBlockRemoved: BlockRemoved,
    _LegacyAllBlocksCleared: AllBlocksCleared,
}


_CANONICAL_TO_LEGACY: Final[dict[type, type]] = {v: k for k, v in _LEGACY_TO_CANONICAL.items()}


class _PositionalBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_LegacyEvent]
    data_parallel_rank: int | None = None


class _LooseBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_encoder: Final = msgspec.msgpack.Encoder()
_batch_decoder: Final = msgspec.msgpack.Decoder(EventBatch)
_loose_decoder: Final = msgspec.msgpack.Decoder(_LooseBatch)


def encode_batch(batch: EventBatch) -> bytes:
    """msgpack bytes of `batch`, identical to what vLLM 0.33's structs produce."""
    return _encoder.encode(batch)


def encode_batch_positional(batch: EventBatch) -> bytes:
    """The batch with every event as a positional array `[type, field...]` (pre-#42892).

    Field positions are vLLM's declaration order (BlockStored: 1 block_hashes ... 6 medium ...
    9 group_idx, 10 kv_cache_spec_kind, 11 kv_cache_spec_sliding_window, 12 locality,
    13 ownership), so a reader that indexes positions and ignores the rest (llm-d) decodes it.
    """
    events = [_CANONICAL_TO_LEGACY[type(ev)](*(getattr(ev, f) for f in ev.__struct_fields__))
              for ev in batch.events]
    return _encoder.encode(_PositionalBatch(ts=batch.ts, events=events,
                                            data_parallel_rank=batch.data_parallel_rank))


def _from_legacy(raw: list[Any]) -> KVEvent:
    legacy = msgspec.convert(raw, _LegacyEvent)
    cls = _LEGACY_TO_CANONICAL[type(legacy)]
    return cls(**msgspec.structs.asdict(legacy))


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload frame; accepts map-form and legacy array-form events.

    Unknown extra keys (or extra trailing array elements) are ignored, as every known consumer
    does. Anything else wrong raises `MalformedPayload`.
    """
    try:
        return _batch_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        first_error: Exception = exc
    # Slow path, only for legacy producers: per event, maps convert to the canonical structs
    # and arrays to the legacy twins (msgspec cannot mix both layouts in one union).
    try:
        loose = _loose_decoder.decode(payload)
        events: list[KVEvent] = []
        for raw in loose.events:
            if isinstance(raw, list):
                events.append(_from_legacy(raw))
            else:
                events.append(msgspec.convert(raw, KVEvent))
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
        raise MalformedPayload(f"not a KV-event batch: {first_error}") from exc
    return EventBatch(ts=loose.ts, events=events, data_parallel_rank=loose.data_parallel_rank)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def to_json_dict(event: KVEvent) -> dict[str, Any]:
    """`{"type": ..., <every field by its vLLM name>}` for JSON output.

    Hashes stay JSON ints when they are ints on the wire and become lowercase hex strings when
    they are bytes. All fields are present (defaults included) so line-oriented tools see a
    stable shape.
    """
    out: dict[str, Any] = {"type": type(event).__name__}
    for name in event.__struct_fields__:
        out[name] = _jsonable(getattr(event, name))
    return out


# ---------------------------------------------------------------------------------------------
# Lookup events (ours; separate endpoint; versioned)
# ---------------------------------------------------------------------------------------------

LOOKUP_SCHEMA_VERSION: Final = 1

LookupOutcome = Literal["hit", "partial", "miss", "deferred"]

# Known `miss_reason` values (open set: consumers must tolerate new strings without a version
# bump). not_stored: first missing key was never stored; evicted: it was stored, then evicted;
# group_missing: the block exists for some KV groups but not all; pending: a store is still in
# flight (outcome "deferred"); namespace_unknown: no engine registered under this namespace;
# tail_not_stored: full chunks hit but no partial tail was stored at a usable boundary.
MISS_REASONS: Final = (
    "not_stored",
    "evicted",
    "group_missing",
    "pending",
    "namespace_unknown",
    "tail_not_stored",
)


class LookupEvent(msgspec.Struct, kw_only=True, gc=False, tag=True):
    """One answered lookup. Token counts are absolute numbers of prompt tokens.

    `local_tokens` were already in the engine's own prefix cache; `hit_tokens` are the tokens
    beyond those that the daemon can load, split into complete chunks (`chunk_hit_tokens`) and a
    partial tail (`tail_hit_tokens`, ending at token position `tail_boundary`, None without a
    tail hit). `outcome`: "hit" = everything loadable was found, "partial" = some, "miss" =
    none, "deferred" = the engine will ask again (a store is still pending).
    """

    request_id: str
    namespace: str
    prompt_tokens: int
    local_tokens: int
    hit_tokens: int
    chunk_hit_tokens: int
    tail_hit_tokens: int
    tail_boundary: int | None
    outcome: LookupOutcome
    miss_reason: str | None = None
    # Microseconds from the lookup message's arrival to this answer (waits on futures
    # included). Added in schema v1 as an optional field: older readers ignore it.
    latency_us: int | None = None
    # Per KV-cache group, in the engine's group order: "hit" (a key of this group was found
    # ready), "pending" (one is still being written) or "miss" (none of its probed keys was
    # stored). Optional (schema v1): tells which group made a hybrid request miss.
    group_outcomes: list[str] | None = None

    def __post_init__(self) -> None:
        # Runs on decode too, so a producer bug is caught on both ends.
        if self.hit_tokens != self.chunk_hit_tokens + self.tail_hit_tokens:
            raise ValueError("hit_tokens must equal chunk_hit_tokens + tail_hit_tokens")


class LookupEventBatch(msgspec.Struct, kw_only=True, gc=False):
    """A map `{schema_version, ts, events}`; `schema_version` is always on the wire."""

    schema_version: int = LOOKUP_SCHEMA_VERSION
    ts: float
    events: list[LookupEvent]


class _VersionProbe(msgspec.Struct):
    schema_version: Any = None


_lookup_decoder: Final = msgspec.msgpack.Decoder(LookupEventBatch)
_probe_decoder: Final = msgspec.msgpack.Decoder(_VersionProbe)


def encode_lookup_batch(batch: LookupEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_lookup_batch(payload: bytes) -> LookupEventBatch:
    """Decode a lookup-event batch; raises `UnsupportedSchemaVersion` for other versions."""
    try:
        batch = _lookup_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        # A newer schema may fail validation: report the version, not the symptom.
        try:
            version = _probe_decoder.decode(payload).schema_version
        except (msgspec.DecodeError, msgspec.ValidationError):
            version = LOOKUP_SCHEMA_VERSION
        if version != LOOKUP_SCHEMA_VERSION:
            raise UnsupportedSchemaVersion(version) from exc
        raise MalformedPayload(f"not a lookup-event batch: {exc}") from exc
    if batch.schema_version != LOOKUP_SCHEMA_VERSION:
        raise UnsupportedSchemaVersion(batch.schema_version)
    return batch
