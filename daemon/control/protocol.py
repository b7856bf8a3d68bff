"""The control protocol: one msgspec Struct per message, used for the wire and for validation.

Transport: the daemon binds a ZMQ ROUTER; each client connects one DEALER and sends single-frame
msgpack messages. Every request carries ``rid`` (chosen by the client, echoed in the reply) and
gets exactly one reply: the matching ``...Reply`` struct or an ``Error``. Messages are a tagged
union on the ``op`` field so a decoder can validate any frame in one pass.

Keys are vLLM ``OffloadKey`` bytes (block hash + 4-byte big-endian group index), see
``kvoffload.daemon.base``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import msgspec
from kvoffload.daemon.base import Geometry, PackedHashes

PROTOCOL_VERSION = 1


class ErrorCode(enum.StrEnum):
    MALFORMED = "malformed"  # not msgpack, unknown op, wrong field types
    UNSUPPORTED_VERSION = "unsupported_version"
    NOT_REGISTERED = "not_registered"  # engine handle unknown to this daemon
    GEOMETRY_MISMATCH = "geometry_mismatch"  # namespace registered with another geometry
    BAD_REQUEST = "bad_request"  # well-formed but out of range / inconsistent
    TOO_LARGE = "too_large"  # message, batch or key count over a configured limit
    SHUTTING_DOWN = "shutting_down"
    FORBIDDEN = "forbidden"  # refused by a rule, not by its form (a Reset without consent)
    INTERNAL = "internal"


class StoreOutcome(enum.StrEnum):
    GRANTED = "granted"  # a slot was reserved: write it, then commit
    EXISTS = "exists"  # already stored (or being stored): nothing to write
    NO_SPACE = "no_space"  # every slot is pinned or pending: refused, nothing blocks
    QUOTA = "quota"  # this client holds its share of the pool already (docs/security.md)
    TOO_BIG = "too_big"  # the engine's block does not fit one pool slot
    NOT_WORTH = "not_worth"  # a tail whose load would cost more than recomputing its tokens


class _Msg(msgspec.Struct, tag_field="op", forbid_unknown_fields=False, kw_only=True):
    rid: int


# ----------------------------------------------------------------------------- requests


class Hello(_Msg, tag="hello"):
    version: int
    client: str = ""  # free text for logs: "vllm-scheduler pid 123"
    lease_ms: int | None = None  # ask for a lease length; the daemon may clamp it


class Register(_Msg, tag="register"):
    geometry: Geometry
    rank: int = 0
    # The engine's time model for cost-aware tails (0 = off): prefill throughput and
    # host-to-device copy bandwidth. Tails that cannot repay their load are neither stored nor
    # loaded. Bytes are the geometry's, all TP ranks together.
    prefill_tokens_per_s: float = 0.0
    copy_bytes_per_s: float = 0.0
    # An engine's manager that answers vLLM from the shared index (shared_index.py): the daemon
    # then holds freed slots for it (reclaim.py) and assigns it a reader record.
    reads_index: bool = False
    # Who is storing (vLLM's engine_id): ``Reset(scope="own")`` drops only its blocks.
    instance: str = ""
    # The engine's data-parallel rank (vLLM's data_parallel_index), or None when not told: a
    # daemon with ``engine_views_auto`` opens one per-engine event view per rank it is told.
    data_parallel_rank: int | None = None
    # Its workers hold its session file's lock (``readers_path``) while they copy into its
    # grants: revoked grants are then quarantined until the lock is free, not for a lease.
    writer_lock: bool = False
    # The same engine's earlier session (its ``readers_path``), released at once.
    supersedes: str = ""


class LookupQuery(msgspec.Struct, frozen=True, kw_only=True):
    """One request's lookup: the daemon returns its longest usable hit."""

    req_id: str
    block_hashes: list[bytes] = []
    num_tokens: int
    num_prompt_tokens: int
    local_tokens: int = 0
    # The same hashes packed end to end (``PackedHashes``): decodes in constant time. A query
    # carries either block_hashes or hash_blob + hash_bytes.
    hash_blob: bytes = b""
    hash_bytes: int = 0

    def hashes(self) -> Sequence[bytes]:
        return PackedHashes(self.hash_blob, self.hash_bytes) if self.hash_bytes else \
            self.block_hashes


class Lookup(_Msg, tag="lookup"):
    engine: int
    queries: list[LookupQuery]
    wait_ms: int = 0  # >0: park deferred answers on the pending keys' futures up to this long
    pin: bool = False  # pin every key of a hit until complete_load/release or lease expiry


class Probe(_Msg, tag="probe"):
    """Per-key status for callers that scan key by key (vLLM's manager.lookup)."""

    engine: int
    keys: list[bytes]


class StoreItem(msgspec.Struct, frozen=True, kw_only=True):
    """One key to store, with what routers need to describe it (events)."""

    key: bytes
    end_token: int  # absolute token position the key's state ends at
    tail: bool = False  # a partial tail (boundary inside a block) rather than a complete chunk
    token_ids: list[int] | None = None  # tokens the key covers (for self-describing events)
    block_hashes: list[bytes] | None = None  # fine hashes the key covers
    parent_hash: bytes | None = None
    lora_name: str | None = None


class PrepareStore(_Msg, tag="prepare_store"):
    engine: int
    items: list[StoreItem]


class CommitStore(_Msg, tag="commit_store"):
    """Close a prepared store: ``ok`` makes the keys readable, else their slots are freed."""

    engine: int
    keys: list[bytes]
    ok: bool = True


class PinLoad(_Msg, tag="pin_load"):
    engine: int
    keys: list[bytes]


class CompleteLoad(_Msg, tag="complete_load"):
    """Release pins taken by a lookup(pin=True) or pin_load once the bytes are copied."""

    engine: int
    keys: list[bytes]


class Touch(_Msg, tag="touch"):
    engine: int
    keys: list[bytes]


class Heartbeat(_Msg, tag="heartbeat"):
    pass


class Stats(_Msg, tag="stats"):
    pass


class Bye(_Msg, tag="bye"):
    """A clean goodbye: the daemon releases the client's pins and pending stores at once."""


class Reset(_Msg, tag="reset"):
    """Drop ready, unpinned blocks of one engine's namespace: all of them, or ("own") only those
    this client's engine instance stored."""

    engine: int
    scope: str = "namespace"
    # The daemon's operator credential (``operator_token_file``): a namespace reset without
    # the consent rule's other condition (docs/security.md).
    credential: str = ""


class SlotRef(msgspec.Struct, frozen=True, array_like=True):
    """A key in a slot at one writer generation, as the engine saw it in the shared index."""

    key: bytes
    slot: int
    gen: int


class StoreClaim(msgspec.Struct, frozen=True, kw_only=True):
    """Put a key into a slot of this engine's reservation (the bytes follow from its workers)."""

    item: StoreItem
    slot: int
    gen: int


class LookupReport(msgspec.Struct, frozen=True, kw_only=True):
    """What vLLM's scheduler decided for one request, for the daemon's lookup events."""

    req_id: str
    num_tokens: int
    num_prompt_tokens: int = 0
    local_tokens: int = 0
    hit_tokens: int | None = None  # None: deferred
    chunk_tokens: int = 0  # of hit_tokens, what complete chunks serve (the rest is a tail)
    tail_boundary: int | None = None
    hit_keys: list[bytes] = []
    pending_keys: list[bytes] = []
    miss_reason: str | None = None
    latency_us: int | None = None


class Step(_Msg, tag="step"):
    """Everything one scheduler step of an index reader writes, sent once, without waiting.

    Not handled in field order (``daemon/control/steps.py``): the daemon applies ``commits``,
    then ``aborts``, before the ``pins`` (a pin of the same or a later Step may name a store
    the engine committed here), then ``releases``, ``claims`` and ``unreserve``; then it
    records ``epoch`` (the shared-index position the step's decisions were read from), after
    the pins it protects, and reclaims what no reader can see any more; then ``reserve``,
    ``finds``, ``lookups`` and ``touches``. The reply goes out once all of it is applied.
    """

    engine: int
    epoch: int
    pins: list[SlotRef] = []
    releases: list[SlotRef] = []
    claims: list[StoreClaim] = []
    commits: list[SlotRef] = []
    aborts: list[SlotRef] = []
    unreserve: list[SlotRef] = []  # reserved slots handed back (key empty)
    reserve: int = 0  # ask for this many more reserved slots
    finds: list[bytes] = []  # keys missing from the pool: look in the lower tiers
    lookups: list[LookupReport] = []
    # READY keys vLLM offered to store again (a request reused them, from its GPU prefix
    # cache or a load): most recently used now, as vLLM's own manager records such reuse.
    touches: list[bytes] = []
    # time.monotonic() when the engine took the slots its claims name (its workers' specs
    # carry the same stamp): an earmarked slot is handed over within HANDOVER_S of it, or
    # never (daemon/store/earmarks.py). 0.0: the daemon's receipt.
    stamp: float = 0.0


Request = (
    Hello
    | Register
    | Lookup
    | Probe
    | PrepareStore
    | CommitStore
    | PinLoad
    | CompleteLoad
    | Touch
    | Heartbeat
    | Stats
    | Reset
    | Bye
    | Step
)

# ------------------------------------------------------------------------------- replies


class Welcome(_Msg, tag="welcome"):
    version: int
    daemon_id: str
    lease_ms: int
    pool_path: str
    pool_bytes: int
    max_keys_per_request: int


class Registered(_Msg, tag="registered"):
    engine: int
    slot_bytes: int
    rank_bytes: int
    num_slots: int
    pool_path: str
    daemon_id: str = ""
    index_path: str = ""  # the shared index engines read in place ("" without one)
    readers_path: str = ""
    reader_record: int = -1  # this client's record in readers_path
    epoch: int = 0  # the shared index's position at registration
    has_tiers: bool = False  # keys missing from the pool may be on disk / in Mooncake


class LookupAnswer(msgspec.Struct, frozen=True, kw_only=True):
    req_id: str
    hit_tokens: int | None  # None: deferred (a key is pending / being fetched)
    chunk_tokens: int = 0
    tail_boundary: int | None = None
    load_keys: list[bytes] = []
    slots: list[int] = []  # slot of each load key when pinned, else empty
    # Every key the lookup probed that answered HIT / HIT_PENDING or RETRY. A caller that
    # must answer key by key (vLLM's manager.lookup) answers MISS for every other key.
    hit_keys: list[bytes] = []
    pending_keys: list[bytes] = []
    miss_reason: str | None = None


class LookupReply(_Msg, tag="lookup_reply"):
    answers: list[LookupAnswer]


class ProbeReply(_Msg, tag="probe_reply"):
    statuses: list[int]  # KeyStatus values, one per key


class StoreGrant(_Msg, tag="store_grant"):
    outcomes: list[StoreOutcome]
    slots: list[int]  # -1 where not granted
    evicted: list[bytes]  # keys evicted to make room (routers learn of them by events too)


class LoadGrant(_Msg, tag="load_grant"):
    slots: list[int]  # -1 where the key is not ready (then nothing is pinned for it)


class StepReply(_Msg, tag="step_reply"):
    granted: list[tuple[int, int]] = []  # new reserved (slot, gen)
    lost: list[bytes] = []  # pins refused: the slot went to another writer (load must fail)
    exists: list[bytes] = []  # claims of keys stored meanwhile (slot stays reserved)
    refused: list[bytes] = []  # claims or commits that do not match a slot of ours
    found: list[bytes] = []  # finds a lower tier is promoting (they read PENDING now)
    not_found: list[bytes] = []
    no_space: bool = False  # the reservation could not be filled: the pool is all pinned
    epoch: int = 0
    # Earmarked slots granted earlier that are not ours any more (their block was used, or a
    # claim found its key stored): dropped from the reservation; a claim naming one is refused.
    withdrawn: list[int] = []


class Ack(_Msg, tag="ack"):
    count: int = 0


class StatsReply(_Msg, tag="stats_reply"):
    stats: dict[str, Any]


class Error(_Msg, tag="error"):
    code: ErrorCode
    message: str


Reply = (
    Welcome
    | Registered
    | LookupReply
    | ProbeReply
    | StoreGrant
    | LoadGrant
    | StepReply
    | Ack
    | StatsReply
    | Error
)

request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()


class ProtocolError(Exception):
    """A typed error answer from the daemon, raised on the client side."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
