"""Asyncio subscriber of a KV-event stream (vLLM's or ours), with replay-based gap recovery.

Consumers iterate it and get, in seq order, `Received` items plus notices:

* `Gap(start, end)`: seqs `[start, end)` are lost for good (live stream skipped them and replay
  could not supply them, or no replay endpoint was configured). Recovered gaps are silent
  (counted in metrics only): the consumer just sees the batches, flagged `replayed=True`.
* `Reset(expected, seq)`: the publisher restarted (its seq went backwards). Everything the
  consumer derived from the old stream is stale. The new stream's batches follow, fetched from
  seq 0 by replay when possible. Limit: a restarted publisher whose seq already passed the old
  one before the SUB reconnected looks like a gap, not a reset (the wire carries no epoch).

Design notes (why):
* The hot path is a non-blocking `recv` on a plain socket; only when nothing is queued do we
  await readability through the zmq.asyncio socket that owns the handle. Awaiting a future per
  message would cost more than the message itself.
* The live stream of one publisher is strictly increasing, so a seq at or below the last live
  seq is a restart, while a seq below the expected one but above the last live seq was already
  delivered by a replay (a duplicate). A seq never delivered and below the expected one (after
  `from_seq`) also means a restart.
* Every replay is bounded by `replay_timeout`; a dead or slow replay endpoint costs at most that
  and turns the missing range into a `Gap`. The DEALER is rebuilt after a timeout so a late
  answer cannot be mistaken for the next replay's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from .metrics import event_metrics
from .publisher import END_SEQ, SEQ
from .schema import (
    EventBatch,
    LookupEventBatch,
    MalformedPayload,
    decode_batch,
    decode_lookup_batch,
)

__all__ = [
    "EventSubscriber",
    "Gap",
    "LookupEventSubscriber",
    "Received",
    "Reset",
    "SubscriberItem",
]

log = logging.getLogger(__name__)

B = TypeVar("B")
_RECV_BURST: Final = 64  # messages handled per wakeup before yielding to the loop


@dataclass(frozen=True, slots=True)
class Received(Generic[B]):
    seq: int
    batch: B
    replayed: bool = False  # delivered by the replay endpoint rather than live


@dataclass(frozen=True, slots=True)
class Gap:
    start: int  # first lost seq
    end: int  # one past the last lost seq

    @property
    def count(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Reset:
    expected: int  # the seq we expected from the old publisher
    seq: int  # the (lower) seq the restarted publisher sent


SubscriberItem = Received[B] | Gap | Reset


class _Subscriber(Generic[B]):
    """SUB (+ DEALER replay) state machine; subclasses choose the payload decoder."""

    _decode: Callable[[bytes], B]

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        from_seq: int | None = None,
        registry: CollectorRegistry | None = None,
        *,
        stream: str = "kv",
        rcvhwm: int = 100_000,
        replay_timeout: float = 5.0,
        context: zmq.Context[Any] | None = None,
        bind: bool = False,
    ) -> None:
        self._ctx: zmq.Context[Any] = context if context is not None else zmq.Context.instance()
        self._actx = zmq.asyncio.Context.shadow(self._ctx.underlying)
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._from_seq = from_seq
        self._rcvhwm = rcvhwm
        self._replay_timeout = replay_timeout
        self._bind = bind
        self._stream = stream

        self._next: int | None = from_seq  # seq we expect next; None until the first message
        self._last_live: int | None = None  # last seq seen on the live socket
        self._replayed_high: int | None = None  # highest seq a replay delivered
        self._pending: deque[Received[B] | Gap | Reset] = deque()
        self._asub: zmq.asyncio.Socket | None = None
        self._sub: zmq.Socket[Any] | None = None
        self._adealer: zmq.asyncio.Socket | None = None
        self._recovery: asyncio.Task[None] | None = None  # replay in progress, if any
        self._started = False
        self._closed = False
        self._logged: set[str] = set()

        m = event_metrics(registry)
        self._m_live = m.received_batches.labels(stream, "live")
        self._m_replay = m.received_batches.labels(stream, "replay")
        self._m_gaps = m.gaps.labels(stream)
        self._m_missed = m.missed_batches.labels(stream)
        self._m_resets = m.resets.labels(stream)
        self._m_malformed = m.malformed

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def bound_endpoint(self) -> str:
        """The SUB endpoint; with `bind=True`, as bound (real port for `tcp://host:*`)."""
        if self._bind and self._sub is not None:
            return self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        return self._endpoint

    @property
    def next_seq(self) -> int | None:
        """The seq expected next (resume point for a later `from_seq`)."""
        return self._next

    async def start(self) -> None:
        """Connect, then (with `from_seq` and a replay endpoint) fetch the backlog at once."""
        if self._started:
            return
        self._started = True
        # The async socket owns the handle (and closes it); the plain shadow does the recvs.
        self._asub = self._actx.socket(zmq.SUB)
        self._sub = zmq.Socket.shadow(self._asub.underlying)
        self._sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        if self._bind:
            self._sub.bind(self._endpoint)
        else:
            self._sub.connect(self._endpoint)
        if self._replay_endpoint is not None:
            self._new_dealer()
            if self._from_seq is not None:
                self._start_recovery(self._from_seq, None)
                await asyncio.shield(self._recovery)  # type: ignore[arg-type]

    async def aclose(self) -> None:
        self._closed = True
        if self._recovery is not None:
            self._recovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recovery
        if self._asub is not None:
            self._asub.close(linger=0)
        if self._adealer is not None:
            self._adealer.close(linger=0)

    async def __aenter__(self) -> _Subscriber[B]:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> _Subscriber[B]:
        return self

    async def __anext__(self) -> Received[B] | Gap | Reset:
        if not self._started:
            await self.start()
        pending = self._pending
        while not pending:
            if self._closed:
                raise StopAsyncIteration
            if self._recovery is not None:
                # Shielded: a consumer's timeout must not abort a replay half-way (the live
                # message that triggered it would be lost); the next call picks it up.
                await asyncio.shield(self._recovery)
                continue
            self._pump()
            if not pending and self._recovery is None:
                await self._wait_readable()
        return pending.popleft()

    async def recv(self, timeout: float | None = None) -> Received[B] | Gap | Reset:
        """Next item, waiting at most `timeout` seconds (TimeoutError after that)."""
        async with asyncio.timeout(timeout):
            return await self.__anext__()

    # -- live stream -------------------------------------------------------------------------

    async def _wait_readable(self) -> None:
        assert self._asub is not None
        try:
            await self._asub.poll(None)  # POLLIN is the default
        except asyncio.CancelledError:
            # Closing the socket cancels the poll: end iteration instead of leaking a
            # cancellation the consumer never asked for.
            if not self._closed:
                raise
        except zmq.ZMQError:
            if not self._closed:
                raise

    def _pump(self) -> None:
        """Handle queued live messages without awaiting, until items or a recovery appear."""
        sub = self._sub
        assert sub is not None
        for _ in range(_RECV_BURST):
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                if self._closed:
                    return
                raise
            self._on_live(frames)
            if self._pending or self._recovery is not None:
                return

    def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._malformed("frames", f"{len(frames)} frames")
            return
        seq_bytes = frames[1]
        if len(seq_bytes) != 8 or seq_bytes == END_SEQ:
            self._malformed("seq", f"seq frame of {len(seq_bytes)} bytes")
            return
        seq: int = SEQ.unpack(seq_bytes)[0]
        last_live, self._last_live = self._last_live, seq
        expected = self._next
        if expected is not None and seq < expected:
            replayed = self._replayed_high
            if (last_live is None or seq > last_live) and replayed is not None and seq <= replayed:
                return  # already delivered by a replay
            self._m_resets.inc()
            log.info("publisher %s restarted: expected seq %d, got %d", self._stream, expected, seq)
            self._pending.append(Reset(expected=expected, seq=seq))
            self._replayed_high = None
            expected = self._next = 0  # the new stream's history starts at 0
        if expected is None:
            self._next = seq  # first message ever: start where the stream is
        elif seq > expected:
            self._m_gaps.inc()
            if self._adealer is not None:
                self._start_recovery(expected, (seq, frames[2]))
                return
        self._deliver(seq, frames[2], replayed=False)

    def _deliver(self, seq: int, payload: bytes, replayed: bool) -> None:
        nxt = self._next
        if nxt is not None and seq > nxt:
            self._lost(nxt, seq)
        self._next = seq + 1
        try:
            batch = self._decode(payload)
        except MalformedPayload as exc:
            self._malformed("payload", str(exc))  # seq consumed: replaying it would not help
            return
        (self._m_replay if replayed else self._m_live).inc()
        self._pending.append(Received(seq, batch, replayed))

    def _lost(self, start: int, end: int) -> None:
        self._m_missed.inc(end - start)
        log.warning("stream %s lost seqs %d..%d", self._stream, start, end - 1)
        self._pending.append(Gap(start, end))

    def _malformed(self, kind: str, detail: str) -> None:
        self._m_malformed.labels(self._stream, kind).inc()
        if kind not in self._logged:  # once per kind: a garbage flood must not flood the log
            self._logged.add(kind)
            log.warning(
                "stream %s: skipping malformed message (%s): %s", self._stream, kind, detail
            )

    # -- replay ------------------------------------------------------------------------------

    def _new_dealer(self) -> None:
        if self._adealer is not None:
            self._adealer.close(linger=0)
        assert self._replay_endpoint is not None
        self._adealer = self._actx.socket(zmq.DEALER)
        self._adealer.setsockopt(zmq.LINGER, 0)
        self._adealer.setsockopt(zmq.RCVHWM, 0)  # a replay may exceed the default 1000
        self._adealer.connect(self._replay_endpoint)

    def _start_recovery(self, start: int, live: tuple[int, bytes] | None) -> None:
        self._recovery = asyncio.get_running_loop().create_task(self._recover(start, live))

    async def _recover(self, start: int, live: tuple[int, bytes] | None) -> None:
        """Replay from `start` and deliver in order, then the live message that showed the gap.

        Whatever neither supplies becomes a `Gap`.
        """
        try:
            got = await self._replay(start)
            if self._next is None:
                self._next = start
            for seq, payload in got:
                if seq >= self._next:
                    self._deliver(seq, payload, replayed=True)
                    self._replayed_high = seq
            if live is not None and live[0] >= self._next:
                self._deliver(live[0], live[1], replayed=False)
        finally:
            self._recovery = None

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self._adealer
        assert dealer is not None
        got: list[tuple[int, bytes]] = []
        try:
            async with asyncio.timeout(self._replay_timeout):
                await dealer.send_multipart((b"", SEQ.pack(start)))
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                        self._malformed("replay", f"{len(frames)} frames")
                        continue
                    if frames[2] == END_SEQ:
                        return got
                    got.append((SEQ.unpack(frames[2])[0], frames[3]))
        except asyncio.CancelledError:
            self._new_dealer()  # replies to this request must not reach the next one
            raise
        except zmq.ZMQError as exc:  # e.g. a bad endpoint: a replay failure is never fatal
            log.warning("stream %s: replay from %d failed: %s", self._stream, start, exc)
            if not self._closed:
                self._new_dealer()
        except TimeoutError:
            log.warning(
                "stream %s: replay from %d timed out after %.1fs (%d batches received)",
                self._stream,
                start,
                self._replay_timeout,
                len(got),
            )
            self._new_dealer()
        return got


class EventSubscriber(_Subscriber[EventBatch]):
    """Subscriber of a vLLM-compatible KV-event stream."""

    _decode = staticmethod(decode_batch)


class LookupEventSubscriber(_Subscriber[LookupEventBatch]):
    """Subscriber of our lookup-event stream."""

    _decode = staticmethod(decode_lookup_batch)

    def __init__(self, endpoint: str, *args: Any, stream: str = "lookup", **kwargs: Any) -> None:
        super().__init__(endpoint, *args, stream=stream, **kwargs)
