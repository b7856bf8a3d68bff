"""The publisher's replay side: the bounded buffer of sent batches and vLLM's replay protocol.

The buffer is bounded in **events and bytes** (and optionally batches), not batches alone: a
late router needs the events, and one event per batch would otherwise shrink what a buffer of
N batches covers.

It is two parallel deques (payload bytes, event counts) rather than one deque of tuples: the
sender appends to both straight from its hot loop, nothing per batch is GC-tracked (bytes and
small ints are not; tuples are, and 128 Ki of them made every full collection scan them), and
a trim is a pop from each. Seqs are not stored: every seq the sender consumes is kept, so the
buffer always holds the contiguous range ending just before the publisher's next seq.

Replay (see shared/spec/kv-events.md): a DEALER sends `["", seq(8 bytes)]` to the ROUTER; the
reply is every buffered batch from that seq on as `[topic, seq, payload]`, then the end marker
`["", END_SEQ, ""]`. A large replay yields to the loop every `REPLAY_CHUNK` messages.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import zmq
import zmq.asyncio

__all__ = ["END_SEQ", "REPLAY_CHUNK", "SEQ", "ReplayBuffer", "open_replay_router", "request_seq",
           "send_replay"]

SEQ: Final = struct.Struct(">Q")
END_SEQ: Final = b"\xff" * 8  # replay end marker; never a real seq
REPLAY_CHUNK: Final = 256


class ReplayBuffer:
    """The newest sent batches, within an event, a byte and an optional batch bound.

    The sender appends to `payloads` and `counts` itself and then calls `added` once per
    drained chunk with the totals, so the per-batch cost is two deque appends.
    """

    __slots__ = ("counts", "events", "max_batches", "max_bytes", "max_events", "nbytes",
                 "payloads")

    def __init__(self, max_events: int, max_bytes: int, max_batches: int | None) -> None:
        self.payloads: deque[bytes] = deque()
        self.counts: deque[int] = deque()
        self.max_events = max(1, max_events)
        self.max_bytes = max(1, max_bytes)
        self.max_batches = max_batches
        self.events = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.payloads)

    def added(self, n_events: int, n_bytes: int) -> None:
        """Account for batches just appended; trims when a bound is exceeded."""
        self.events += n_events
        self.nbytes += n_bytes
        if self.events > self.max_events or self.nbytes > self.max_bytes \
                or self.max_batches is not None:
            self.trim()

    def trim(self) -> None:
        """Drop the oldest batches beyond the bounds.

        The newest batch always stays (unless a batch bound of 0 says keep nothing), so one
        oversized batch is still replayable."""
        payloads, counts = self.payloads, self.counts
        pop_payload, pop_count = payloads.popleft, counts.popleft
        events, nbytes = self.events, self.nbytes
        max_events, max_bytes = self.max_events, self.max_bytes
        if self.max_batches is not None:
            while len(payloads) > self.max_batches:
                events -= pop_count()
                nbytes -= len(pop_payload())
        while len(payloads) > 1 and (events > max_events or nbytes > max_bytes):
            events -= pop_count()
            nbytes -= len(pop_payload())
        self.events, self.nbytes = events, nbytes

    def since(self, start: int, next_seq: int) -> list[tuple[int, bytes]]:
        """`(seq, payload)` of every buffered batch with seq >= start, oldest first."""
        first = next_seq - len(self.payloads)
        offset = max(0, start - first)
        return [(first + i, payload) for i, payload in
                enumerate(itertools.islice(self.payloads, offset, None), offset)]


def request_seq(frames: list[bytes]) -> int | None:
    """The seq a ROUTER-side replay request asks from, or None when it is malformed."""
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
        return None
    return int(SEQ.unpack(frames[2])[0])


async def send_replay(router: zmq.Socket[Any], client: bytes, topic: bytes,
                      entries: list[tuple[int, bytes]]) -> None:
    """Send `entries` then the end marker to `client`; never blocks on a slow or gone client."""
    pack = SEQ.pack
    for i, (seq, payload) in enumerate(entries, 1):
        # ROUTER without ROUTER_MANDATORY drops (never blocks) for a vanished client.
        router.send_multipart((client, b"", topic, pack(seq), payload), zmq.NOBLOCK)
        if i % REPLAY_CHUNK == 0:
            await asyncio.sleep(0)
    router.send_multipart((client, b"", b"", END_SEQ, b""), zmq.NOBLOCK)


def open_replay_router(ctx: zmq.Context[Any], endpoint: str,
                       secure: Callable[[Any], None] | None = None,
                       ) -> tuple[zmq.asyncio.Socket, zmq.Socket[Any], str]:
    """`(owner, sender, bound endpoint)` of a bound replay ROUTER.

    The owner is a zmq.asyncio socket (to await requests); replies go through a non-owning
    plain shadow of it, which needs no future per message. `secure` sets CURVE server options
    before the socket is reachable."""
    arouter = zmq.asyncio.Context.shadow(ctx.underlying).socket(zmq.ROUTER)
    try:
        router: zmq.Socket[Any] = zmq.Socket.shadow(arouter.underlying)
        # No HWM: a whole replay plus its end marker must fit even when the client reads
        # slowly; the buffer's own event and byte bounds limit what is queued.
        router.setsockopt(zmq.SNDHWM, 0)
        router.setsockopt(zmq.LINGER, 0)
        if secure is not None:
            secure(router)
        router.bind(endpoint)
        return arouter, router, router.getsockopt_string(zmq.LAST_ENDPOINT)
    except zmq.ZMQError:
        arouter.close(linger=0)
        raise
