"""Wire schema: golden vectors from vLLM 0.33, legacy/unknown-key decoding, round trips."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvoffload.events.schema import (
    LOOKUP_SCHEMA_VERSION,
    MISS_REASONS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    LookupEventBatch,
    MalformedPayload,
    UnsupportedSchemaVersion,
    decode_batch,
    decode_lookup_batch,
    encode_batch,
    encode_lookup_batch,
    hash_to_int,
    to_json_dict,
)

from tests.events_helpers import lookup_event

# Payloads encoded by vLLM 0.33.0 itself (copied from the project's shared/vectors/kv_events).
VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "kv_events"
CASES: dict[str, Any] = json.loads((VECTORS / "cases.json").read_text())

STORED_ORDER = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
]


def _unhex(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"hex"}:
        return bytes.fromhex(v["hex"])
    if isinstance(v, list):
        return [_unhex(x) for x in v]
    if isinstance(v, dict):
        return {k: _unhex(x) for k, x in v.items()}
    return v


def _case_batch(name: str) -> EventBatch:
    ts, events, rank = _unhex(CASES[name]["decoded_generic"])
    typed = [msgspec.convert(e, KVEvent) for e in events]
    return EventBatch(ts=ts, events=typed, data_parallel_rank=rank)


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_vector_encodes_byte_for_byte(name: str) -> None:
    raw = (VECTORS / f"{name}.msgpack").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == CASES[name]["sha256"]
    assert encode_batch(_case_batch(name)) == raw


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_vector_decodes_to_same_values(name: str) -> None:
    raw = (VECTORS / f"{name}.msgpack").read_bytes()
    decoded = decode_batch(raw)
    assert decoded == _case_batch(name)
    # Generic view of our re-encoding equals the case's generic view (keys and order).
    generic = msgspec.msgpack.decode(encode_batch(decoded))
    assert generic == _unhex(CASES[name]["decoded_generic"])


def test_batch_is_three_elements_even_with_nil_rank() -> None:
    raw = encode_batch(EventBatch(ts=1.0, events=[]))
    assert msgspec.msgpack.decode(raw) == [1.0, [], None]
    assert raw[0] == 0x93  # fixarray of 3


def test_event_map_keys_follow_vllm_order_and_omit_defaults() -> None:
    full = BlockStored(
        block_hashes=[1],
        parent_block_hash=0,
        token_ids=[1, 2],
        block_size=2,
        lora_id=3,
        medium="CPU",
        lora_name="a",
        extra_keys=[("a",)],
        group_idx=0,
        kv_cache_spec_kind="mamba",
        kv_cache_spec_sliding_window=8,
        locality="LOCAL",
        ownership="tier2",
        session_id="s",
        lookahead_token_ids=[[3]],
    )
    keys = list(msgspec.msgpack.decode(encode_batch(EventBatch(0.0, [full])))[1][0])
    assert keys == STORED_ORDER
    minimal = BlockStored([1], None, [], 0, None, None, None)
    keys = list(msgspec.msgpack.decode(encode_batch(EventBatch(0.0, [minimal])))[1][0])
    assert keys == STORED_ORDER[:8]  # required ones stay even when nil
    removed = msgspec.msgpack.decode(encode_batch(EventBatch(0.0, [BlockRemoved([1], None)])))
    assert list(removed[1][0]) == ["type", "block_hashes", "medium"]


def test_legacy_array_events_decode() -> None:
    payload = msgspec.msgpack.encode(
        [
            5.0,
            [
                ["BlockStored", [1, b"\x02" * 32], None, [1, 2, 3, 4], 2, None, "GPU"],
                ["BlockStored", [9], 8, [5, 6], 2, None],  # pre-`medium` engines
                ["BlockRemoved", [1], "GPU"],
                ["AllBlocksCleared"],
            ],
            3,
        ]
    )
    got = decode_batch(payload)
    assert got.ts == 5.0 and got.data_parallel_rank == 3
    assert got.events == [
        BlockStored([1, b"\x02" * 32], None, [1, 2, 3, 4], 2, None, "GPU", None),
        BlockStored([9], 8, [5, 6], 2, None, None, None),
        BlockRemoved([1], "GPU"),
        AllBlocksCleared(),
    ]


def test_mixed_legacy_and_map_events_and_unknown_keys() -> None:
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {"type": "BlockRemoved", "block_hashes": [4], "medium": "CPU", "future": [1, 2]},
                ["BlockRemoved", [5], "GPU", 1, None, None, "extra-trailing"],
            ],
            None,
            "a fourth batch element from the future",
        ]
    )
    got = decode_batch(payload)
    assert got.events == [BlockRemoved([4], "CPU"), BlockRemoved([5], "GPU", group_idx=1)]


def test_unknown_key_on_fast_path() -> None:
    payload = msgspec.msgpack.encode([2.0, [{"type": "AllBlocksCleared", "reason": "reset"}], 0])
    assert decode_batch(payload) == EventBatch(2.0, [AllBlocksCleared()], 0)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # reserved msgpack byte
        msgspec.msgpack.encode({"ts": 1.0}),
        msgspec.msgpack.encode([1.0, [{"type": "LookupEvent"}], None]),  # unknown type
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}], None]),  # missing field
        msgspec.msgpack.encode([1.0, [["BlockStored", "not-a-list"]], None]),
        msgspec.msgpack.encode([1.0, [42], None]),
        msgspec.msgpack.encode(["x", [], None]),
    ],
)
def test_malformed_payloads_raise_typed_error(payload: bytes) -> None:
    with pytest.raises(MalformedPayload) as info:
        decode_batch(payload)
    assert isinstance(info.value, ValueError)


def test_hash_to_int_matches_vllm_convention() -> None:
    digest = hashlib.sha256(b"block").digest()
    assert hash_to_int(digest) == int.from_bytes(digest, "big") & ((1 << 64) - 1)
    assert hash_to_int(b"\x00" * 24 + b"\x00\x00\x00\x00\x00\x00\x01\x00") == 256


def test_to_json_dict() -> None:
    ev = BlockStored([5, b"\xab\x01"], b"\x00\xff", [1], 1, None, "CPU", None, extra_keys=[None])
    d = to_json_dict(ev)
    assert list(d) == STORED_ORDER
    assert d["block_hashes"] == [5, "ab01"] and d["parent_block_hash"] == "00ff"
    assert d["extra_keys"] == [None] and d["group_idx"] is None
    assert json.loads(json.dumps(d)) == d
    assert to_json_dict(AllBlocksCleared()) == {"type": "AllBlocksCleared"}


# -- property tests ----------------------------------------------------------------------------

hashes = st.one_of(st.integers(0, (1 << 64) - 1), st.binary(min_size=32, max_size=32))
opt_str = st.none() | st.sampled_from(["GPU", "CPU", "STORAGE", "x"])
opt_int = st.none() | st.integers(-5, 1 << 31)

stored_st = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, max_size=4),
    parent_block_hash=st.none() | hashes,
    token_ids=st.lists(st.integers(0, 1 << 20), max_size=32),
    block_size=st.integers(0, 1024),
    lora_id=opt_int,
    medium=opt_str,
    lora_name=st.none() | st.text(max_size=8),
    extra_keys=st.none()
    | st.lists(
        st.none() | st.tuples(st.text(max_size=4), st.integers(-(1 << 63), (1 << 64) - 1)),
        max_size=3,
    ),
    group_idx=opt_int,
    kv_cache_spec_kind=st.none() | st.sampled_from(["full_attention", "mamba"]),
    kv_cache_spec_sliding_window=opt_int,
    locality=st.none() | st.sampled_from(["LOCAL", "REMOTE"]),
    ownership=opt_str,
    session_id=st.none() | st.text(max_size=8),
    lookahead_token_ids=st.none() | st.lists(st.lists(st.integers(0, 99), max_size=3), max_size=2),
)
removed_st = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, max_size=4),
    medium=opt_str,
    group_idx=opt_int,
    locality=st.none() | st.just("REMOTE"),
    ownership=opt_str,
)
event_st = st.one_of(stored_st, removed_st, st.just(AllBlocksCleared()))
batch_st = st.builds(
    EventBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(event_st, max_size=5),
    data_parallel_rank=st.none() | st.integers(0, 64),
)


@settings(max_examples=150, deadline=None)
@given(batch_st)
def test_round_trip(batch: EventBatch) -> None:
    raw = encode_batch(batch)
    back = decode_batch(raw)
    assert back == batch
    assert encode_batch(back) == raw
    # Defaulted fields appear on the wire exactly when they differ from the default.
    for ev, generic in zip(batch.events, msgspec.msgpack.decode(raw)[1], strict=True):
        assert next(iter(generic)) == "type"
        for name, value in msgspec.structs.asdict(ev).items():
            default = type(ev).__struct_defaults__
            n_req = len(ev.__struct_fields__) - len(default)
            idx = ev.__struct_fields__.index(name)
            if idx >= n_req and value is None:
                assert name not in generic
            else:
                assert name in generic


@settings(max_examples=60, deadline=None)
@given(batch_st)
def test_legacy_form_of_any_batch_decodes_to_same(batch: EventBatch) -> None:
    legacy = [
        [type(e).__name__, *(getattr(e, f) for f in e.__struct_fields__)] for e in batch.events
    ]
    payload = msgspec.msgpack.encode([batch.ts, legacy, batch.data_parallel_rank])
    assert decode_batch(payload) == batch


# -- lookup events -----------------------------------------------------------------------------




def test_lookup_batch_round_trip_and_version_on_wire() -> None:
    batch = LookupEventBatch(
        ts=3.0,
        events=[
            lookup_event(),
            lookup_event(
                request_id="r2",
                hit_tokens=0,
                chunk_hit_tokens=0,
                tail_hit_tokens=0,
                tail_boundary=None,
                outcome="miss",
                miss_reason="evicted",
            ),
        ],
    )
    raw = encode_lookup_batch(batch)
    generic = msgspec.msgpack.decode(raw)
    assert list(generic) == ["schema_version", "ts", "events"]
    assert generic["schema_version"] == LOOKUP_SCHEMA_VERSION == 1
    assert generic["events"][0]["type"] == "LookupEvent"
    assert decode_lookup_batch(raw) == batch
    assert set(MISS_REASONS) >= {"not_stored", "evicted", "pending", "tail_not_stored"}


def test_lookup_rejects_other_versions_and_bad_payloads() -> None:
    good = msgspec.msgpack.decode(encode_lookup_batch(LookupEventBatch(ts=1.0, events=[lookup_event()])))
    for version, shape in ((2, good), (2, {"schema_version": 2, "whatever": []})):
        with pytest.raises(UnsupportedSchemaVersion) as info:
            decode_lookup_batch(msgspec.msgpack.encode({**shape, "schema_version": version}))
        assert info.value.version == 2
    with pytest.raises(MalformedPayload):
        decode_lookup_batch(b"\x93\x01\x02\x03")
    bad = dict(good, events=[dict(good["events"][0], outcome="maybe")])
    with pytest.raises(MalformedPayload):
        decode_lookup_batch(msgspec.msgpack.encode(bad))


def test_lookup_invariant_checked_on_both_ends() -> None:
    with pytest.raises(ValueError):
        lookup_event(hit_tokens=5)
    good = msgspec.msgpack.decode(encode_lookup_batch(LookupEventBatch(ts=1.0, events=[lookup_event()])))
    good["events"][0]["hit_tokens"] = 1
    with pytest.raises(MalformedPayload):
        decode_lookup_batch(msgspec.msgpack.encode(good))


def test_lookup_events_are_rejected_by_the_kv_stream_decoder() -> None:
    # Why they need their own endpoint: the router-facing decoder refuses the whole batch.
    raw = msgspec.msgpack.encode([1.0, [msgspec.to_builtins(lookup_event())], None])
    with pytest.raises(MalformedPayload):
        decode_batch(raw)
