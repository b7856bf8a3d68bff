"""Clients for the daemon's control socket.

``DaemonClient`` is the synchronous client the vLLM plugin uses from the scheduler process:
one DEALER socket, every call bounded by a timeout, so the engine never blocks on the daemon
for longer than the caller allows. It raises ``DaemonUnavailable`` (never hangs) when the daemon
is gone and re-registers by itself when a restarted daemon no longer knows its engine.

``AsyncDaemonClient`` is the asyncio client for the demo, the benchmarks and the tests: many
calls may be in flight at once; replies are matched to calls by ``rid``. It re-registers by
itself too (``call_engine``).

Both check their endpoint when made: a mistyped one is one ``BadEndpoint`` line, not a ZMQ
error from deep inside ``connect``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import msgspec
import zmq
import zmq.asyncio
from kvoffload.connector.transport import (
    BadEndpoint,
    DaemonUnavailable,
    R,
    _expect,
    _make_socket,
    background_context,
    check_endpoint,
)
from kvoffload.daemon.base import Geometry, KeyStatus
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.control.security import CurveClientKeys

__all__ = ["AsyncDaemonClient", "BadEndpoint", "DaemonClient", "DaemonUnavailable",
           "background_context", "check_endpoint"]

log = logging.getLogger("kvoffload.connector")

class DaemonClient:
    """Synchronous, thread-safe client; one registered engine per client."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_ms: int = 1000,
        name: str = "",
        lease_ms: int | None = None,
        curve: CurveClientKeys | None = None,
        time_model: tuple[float, float] | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.endpoint = check_endpoint(endpoint)
        self.curve = curve
        # (prefill tokens/s, copy bytes/s) sent with Register: the daemon then neither stores
        # nor loads partial tails that cannot repay their bytes (cost-aware tails).
        self.time_model = time_model
        self.timeout_ms = timeout_ms
        self.name = name or f"client pid {os.getpid()}"
        self.lease_ms = lease_ms
        self._ctx: zmq.Context[Any] = context or zmq.Context.instance()
        self._sock: zmq.Socket[Any] | None = None
        self._rids = itertools.count(1)
        self._lock = threading.Lock()
        self._geometry: tuple[Geometry, int] | None = None
        self._identity: tuple[str, int | None] = ("", None)  # sent again on a re-register
        self.welcome: p.Welcome | None = None
        self.registered: p.Registered | None = None
        self.round_trips = 0

    # -- transport ------------------------------------------------------------------

    def _socket(self) -> zmq.Socket[Any]:
        if self._sock is None:
            self._sock = _make_socket(self._ctx, self.endpoint, self.curve)
        return self._sock

    def _reset_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def socket(self) -> zmq.Socket[Any]:
        """The DEALER socket, for a caller that sends without waiting (``IndexSession``)."""
        return self._socket()

    def reset_socket(self) -> None:
        """Drop the socket without a goodbye: the daemon sees a new client next time."""
        with self._lock:
            self._reset_socket()
        self.welcome = self.registered = None

    def call(self, msg: p._Msg, timeout_ms: int | None = None) -> p._Msg:
        """Send one request and wait for its reply; replies to older calls are dropped."""
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        with self._lock:
            sock = self._socket()
            deadline = time.monotonic() + timeout / 1000
            # With IMMEDIATE the socket is writable only once connected: wait for that
            # within the call's own timeout, never longer.
            if not sock.poll(timeout, zmq.POLLOUT):
                self._reset_socket()
                raise DaemonUnavailable(f"daemon at {self.endpoint} is not connected")
            try:
                sock.send(p.encoder.encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                raise DaemonUnavailable(f"daemon at {self.endpoint} is not connected") from None
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                    # A late reply would be mistaken for the next call's: start a new socket.
                    self._reset_socket()
                    raise DaemonUnavailable(f"no reply from {self.endpoint} in {timeout} ms")
                reply = p.reply_decoder.decode(sock.recv())
                if reply.rid == msg.rid:
                    self.round_trips += 1
                    return reply

    def _call_engine(self, build: Any, kind: type[R], timeout_ms: int | None = None) -> R:
        """Call a request that names the engine; re-register once if the daemon forgot it."""
        if self.registered is None:
            raise p.ProtocolError(p.ErrorCode.NOT_REGISTERED, "register() first")
        reply = self.call(build(self.registered.engine), timeout_ms)
        if isinstance(reply, p.Error) and reply.code == p.ErrorCode.NOT_REGISTERED:
            # A restarted daemon: hello and register again, then retry once.
            assert self._geometry is not None
            self.connect()
            instance, dp_rank = self._identity
            self.register(*self._geometry, instance=instance, data_parallel_rank=dp_rank)
            reply = self.call(build(self.registered.engine), timeout_ms)
        return _expect(reply, kind)

    def rid(self) -> int:
        return next(self._rids)

    # -- calls ------------------------------------------------------------------------

    def connect(self) -> p.Welcome:
        msg = p.Hello(rid=self.rid(), version=p.PROTOCOL_VERSION, client=self.name,
                      lease_ms=self.lease_ms)
        self.welcome = _expect(self.call(msg), p.Welcome)
        return self.welcome

    def register(self, geometry: Geometry, rank: int = 0, *, instance: str = "",
                 data_parallel_rank: int | None = None) -> p.Registered:
        """Register one engine. ``instance`` (vLLM's engine_id) and ``data_parallel_rank``
        are the identity the plugin sends: a daemon with ``--engine-views-auto`` opens a
        per-engine event view for it, and ``Reset(scope="own")`` drops only its blocks."""
        if self.welcome is None:
            self.connect()
        prefill, copy = self.time_model or (0.0, 0.0)
        reply = self.call(p.Register(rid=self.rid(), geometry=geometry, rank=rank,
                                     prefill_tokens_per_s=prefill, copy_bytes_per_s=copy,
                                     instance=instance, data_parallel_rank=data_parallel_rank))
        self.registered = _expect(reply, p.Registered)
        self._geometry = (geometry, rank)
        self._identity = (instance, data_parallel_rank)
        return self.registered

    def register_reader(self, geometry: Geometry, instance: str = "",
                        data_parallel_rank: int | None = None, *, writer_lock: bool = False,
                        supersedes: str = "", timeout_ms: int | None = None) -> p.Registered:
        """Register as an engine that reads the shared index in place (``IndexSession``)."""
        if self.welcome is None:
            self.connect()
        prefill, copy = self.time_model or (0.0, 0.0)
        reply = self.call(p.Register(rid=self.rid(), geometry=geometry,
                                     prefill_tokens_per_s=prefill, copy_bytes_per_s=copy,
                                     reads_index=True, instance=instance,
                                     data_parallel_rank=data_parallel_rank,
                                     writer_lock=writer_lock, supersedes=supersedes),
                          timeout_ms)
        self.registered = _expect(reply, p.Registered)
        self._geometry = (geometry, 0)
        self._identity = (instance, data_parallel_rank)
        return self.registered

    def lookup(
        self,
        queries: list[p.LookupQuery],
        *,
        wait_ms: int = 0,
        pin: bool = False,
        timeout_ms: int | None = None,
    ) -> list[p.LookupAnswer]:
        def build(engine: int) -> p.Lookup:
            return p.Lookup(rid=self.rid(), engine=engine, queries=queries, wait_ms=wait_ms,
                            pin=pin)

        if timeout_ms is None and wait_ms:
            timeout_ms = self.timeout_ms + wait_ms
        return self._call_engine(build, p.LookupReply, timeout_ms).answers

    def probe(self, keys: Sequence[bytes]) -> list[KeyStatus]:
        reply = self._call_engine(
            lambda e: p.Probe(rid=self.rid(), engine=e, keys=list(keys)), p.ProbeReply)
        return [KeyStatus(s) for s in reply.statuses]

    def prepare_store(self, items: list[p.StoreItem]) -> p.StoreGrant:
        return self._call_engine(
            lambda e: p.PrepareStore(rid=self.rid(), engine=e, items=items), p.StoreGrant)

    def commit_store(self, keys: Sequence[bytes], ok: bool = True) -> int:
        return self._call_engine(
            lambda e: p.CommitStore(rid=self.rid(), engine=e, keys=list(keys), ok=ok),
            p.Ack).count

    def pin_load(self, keys: Sequence[bytes]) -> list[int]:
        return self._call_engine(
            lambda e: p.PinLoad(rid=self.rid(), engine=e, keys=list(keys)), p.LoadGrant).slots

    def complete_load(self, keys: Sequence[bytes]) -> int:
        return self._call_engine(
            lambda e: p.CompleteLoad(rid=self.rid(), engine=e, keys=list(keys)), p.Ack).count

    def touch(self, keys: Sequence[bytes]) -> int:
        return self._call_engine(
            lambda e: p.Touch(rid=self.rid(), engine=e, keys=list(keys)), p.Ack).count

    def reset(self) -> int:
        return self._call_engine(lambda e: p.Reset(rid=self.rid(), engine=e), p.Ack).count

    def heartbeat(self) -> None:
        _expect(self.call(p.Heartbeat(rid=self.rid())), p.Ack)

    def stats(self) -> dict[str, Any]:
        return _expect(self.call(p.Stats(rid=self.rid())), p.StatsReply).stats

    def close(self) -> None:
        """Say goodbye (best effort, never waits) so the daemon releases our pins now."""
        with self._lock:
            if self._sock is not None and self.welcome is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.send(p.encoder.encode(p.Bye(rid=self.rid())), zmq.NOBLOCK)
                # A moment of linger so the goodbye leaves before the socket closes.
                self._sock.close(linger=100)
                self._sock = None
            self._reset_socket()


class AsyncDaemonClient:
    """asyncio client: concurrent calls on one DEALER, replies matched by rid.

    Like ``DaemonClient`` it comes back by itself after a daemon restart: a call made through
    ``call_engine`` that is answered ``not_registered`` says hello and registers again (once,
    for every call in flight: the first to see the answer does it) and is sent again.
    ``registrations`` counts the registrations, so a caller that must know (the demo maps
    the pool the daemon names) can tell that the daemon changed under it."""

    def __init__(self, endpoint: str, *, timeout_ms: int = 5000, name: str = "",
                 curve: CurveClientKeys | None = None) -> None:
        self.endpoint = check_endpoint(endpoint)
        self.timeout_ms = timeout_ms
        self.name = name or f"async client pid {os.getpid()}"
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = cast(zmq.asyncio.Socket, _make_socket(self._ctx, endpoint, curve))
        self._rids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[p._Msg]] = {}
        self._reader: asyncio.Task[None] | None = None
        self.engine: int | None = None
        self.registered: p.Registered | None = None
        self.registrations = 0
        self._register_args: tuple[Geometry, int, str, int | None] | None = None
        self._reregister_lock = asyncio.Lock()
        self.round_trips = 0

    def rid(self) -> int:
        return next(self._rids)

    async def _read(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                reply = p.reply_decoder.decode(frame)
            except msgspec.DecodeError:
                log.warning("undecodable reply dropped")
                continue
            fut = self._waiting.pop(reply.rid, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def call(self, msg: p._Msg, timeout_ms: int | None = None) -> p._Msg:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        fut: asyncio.Future[p._Msg] = asyncio.get_running_loop().create_future()
        self._waiting[msg.rid] = fut
        timeout = (self.timeout_ms if timeout_ms is None else timeout_ms) / 1000
        try:
            if not await self._sock.poll(int(timeout * 1000), zmq.POLLOUT):  # type: ignore[call-arg]
                raise zmq.Again()
            await self._sock.send(p.encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self._waiting.pop(msg.rid, None)
            raise DaemonUnavailable(f"daemon at {self.endpoint} is not connected") from None
        try:
            reply = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise DaemonUnavailable(f"no reply from {self.endpoint} in {timeout}s") from None
        finally:
            self._waiting.pop(msg.rid, None)
        self.round_trips += 1
        return reply

    async def expect(self, msg: p._Msg, kind: type[R], timeout_ms: int | None = None) -> R:
        return _expect(await self.call(msg, timeout_ms), kind)

    async def call_engine(self, build: Callable[[int], p._Msg], kind: type[R],
                          timeout_ms: int | None = None) -> R:
        """Send ``build(engine)``; re-register once if the daemon no longer knows the engine
        (a restarted daemon: handles are per client and per daemon run), then send again."""
        seen = self.registered
        if seen is None:
            raise p.ProtocolError(p.ErrorCode.NOT_REGISTERED, "register() first")
        reply = await self.call(build(seen.engine), timeout_ms)
        if isinstance(reply, p.Error) and reply.code == p.ErrorCode.NOT_REGISTERED:
            await self._reregister(seen)
            assert self.registered is not None
            reply = await self.call(build(self.registered.engine), timeout_ms)
        return _expect(reply, kind)

    async def _reregister(self, seen: p.Registered) -> None:
        async with self._reregister_lock:
            if self.registered is not seen:
                return  # another call in flight already registered again
            assert self._register_args is not None
            geometry, rank, instance, dp_rank = self._register_args
            log.info("daemon at %s no longer knows engine %d: registering again",
                     self.endpoint, seen.engine)
            await self.connect()
            await self.register(geometry, rank, instance=instance, data_parallel_rank=dp_rank)

    async def connect(self) -> p.Welcome:
        hello = p.Hello(rid=self.rid(), version=p.PROTOCOL_VERSION, client=self.name)
        return await self.expect(hello, p.Welcome)

    async def register(self, geometry: Geometry, rank: int = 0, *, instance: str = "",
                       data_parallel_rank: int | None = None) -> p.Registered:
        """Register one engine; ``instance`` and ``data_parallel_rank`` as in
        ``DaemonClient.register`` (the identity the vLLM plugin sends)."""
        reg = await self.expect(p.Register(rid=self.rid(), geometry=geometry, rank=rank,
                                           instance=instance,
                                           data_parallel_rank=data_parallel_rank),
                                p.Registered)
        self._register_args = (geometry, rank, instance, data_parallel_rank)
        self.engine = reg.engine
        self.registered = reg
        self.registrations += 1
        return reg

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        for fut in self._waiting.values():
            fut.cancel()
        self._sock.close(linger=0)
