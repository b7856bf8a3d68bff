"""The control socket's frames: decode, answer, reply, in bounded turns.

A mixin of ``server.Server`` (split out to keep each module readable). Every frame a client
sends gets exactly one typed answer; nothing a client sends raises out of here.

What one connection can make the daemon hold (docs/security.md, "Bad input and resource
bounds"): libzmq keeps at most ``RCVHWM_FRAMES + 1`` unread frames of it (its pipe, plus the
one its I/O thread holds once the pipe is full: measured), each at most ``MAXMSGSIZE``; the
daemon serves one frame at a time, decoded straight from libzmq's buffer (no copy), and keeps
at most ``PARKED_BYTES_PER_CLIENT`` of its parked lookups' frames.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from kvoffload.daemon.config import Config
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.control.errors import RequestError
from kvoffload.daemon.control.service import Service
from kvoffload.daemon.ops.loop_health import TURN_FRAMES, TURN_SECONDS, ParkedLookups
from kvoffload.daemon.ops.metrics import DaemonMetrics

log = logging.getLogger("kvoffload.daemon")

# Unread frames libzmq queues per connection before it stops reading that peer (back-pressure:
# the frames wait in the client's own send queue). One more sits in the I/O thread. Not 1: a
# connection authenticated through ZAP (CURVE) then never delivers a frame (libzmq 4.3.5).
RCVHWM_FRAMES = 2
# A frame at most this much over max_message_bytes still gets a typed ``too_large`` (a client
# learns why); a longer one makes libzmq drop the connection before buffering it whole.
TYPED_BAND_BYTES = 1 << 20
# Frame bytes of one client's lookups parked on pending keys (decoded, a lookup takes 2-13x
# its frame); past it a waiting Lookup is refused like past MAX_PARKED_PER_CLIENT. One lookup
# may always park, however long (max_message_bytes bounds it).
PARKED_BYTES_PER_CLIENT = 4 << 20


def socket_limits(config: Config) -> dict[int, int]:
    """Options of the control ROUTER, set before it binds (listeners copy them then)."""
    limit = config.max_message_bytes
    return {zmq.MAXMSGSIZE: limit + min(limit, TYPED_BAND_BYTES), zmq.RCVHWM: RCVHWM_FRAMES}


class _RidOnly(msgspec.Struct):
    rid: int = 0


_rid_decoder = msgspec.msgpack.Decoder(_RidOnly)


def _salvage_rid(payload: bytes | memoryview) -> int:
    """The rid of an otherwise invalid request, so the client can match the error to it."""
    try:
        return _rid_decoder.decode(payload).rid
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return 0


def _peer_of(frame: zmq.Frame) -> str:
    """A CURVE client's key (ZAP's User-Id), else the tcp peer's address."""
    for prop in ("User-Id", "Peer-Address"):
        try:
            value = frame.get(prop)
        except zmq.ZMQError:
            continue
        if value:
            return f"{prop}:{value}"
    return ""


def _pid_of(frame: zmq.Frame) -> int:
    """The process that connected over ipc, 0 if unknown. libzmq reads the socket's
    SO_PEERCRED into Peer-Address as ``localhost:UID:GID:PID`` (PID 0: the peer is outside
    this pid namespace, e.g. another container: not a process we can tell apart)."""
    try:
        value = frame.get("Peer-Address")
    except zmq.ZMQError:
        return 0
    parts = str(value).split(":")
    return int(parts[3]) if len(parts) == 4 and parts[3].isdigit() else 0


class ControlFrames:
    # Set by Server.__init__ (declared here for the methods below).
    config: Config
    metrics: DaemonMetrics
    service: Service
    parked: ParkedLookups
    _sock: zmq.asyncio.Socket | None
    read_all_at: float  # time.monotonic() when the socket last had nothing unread
    _tasks: set[asyncio.Task[Any]]

    @property
    def _ipc(self) -> bool:
        return self.config.control.startswith("ipc://")

    def _parked_bytes(self) -> dict[bytes, int]:
        """Frame bytes of each client's parked lookups (made here: frames.py's own tally)."""
        tally: dict[bytes, int] | None = self.__dict__.get("_parked_tally")
        if tally is None:
            tally = self.__dict__["_parked_tally"] = {}
        return tally

    def _park(self, identity: bytes, size: int, task: asyncio.Task[Any]) -> None:
        tally = self._parked_bytes()
        tally[identity] = tally.get(identity, 0) + size

        def done(_: asyncio.Task[Any]) -> None:
            left = tally.get(identity, 0) - size
            if left > 0:
                tally[identity] = left
            else:
                tally.pop(identity, None)

        task.add_done_callback(done)
        self.parked.add(identity, task)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- serve ------------------------------------------------------------------------

    async def _reply(self, identity: bytes, reply: p._Msg) -> None:
        if isinstance(reply, p.Error):
            self.metrics.protocol_errors.labels(reply.code.value).inc()
        assert self._sock is not None
        try:
            await self._sock.send_multipart([identity, p.encoder.encode(reply)])
        except zmq.ZMQError as exc:  # peer gone: nothing to answer
            log.debug("reply to a departed client dropped: %s", exc)

    async def _finish(self, identity: bytes, rid: int, pending: Any) -> None:
        try:
            reply = await pending
        except RequestError as exc:
            reply = p.Error(rid=rid, code=exc.code, message=exc.message)
        except Exception:
            log.exception("internal error while answering request %d", rid)
            reply = p.Error(rid=rid, code=p.ErrorCode.INTERNAL, message="internal error")
        await self._reply(identity, reply)

    def _client_alive(self, client: Any) -> bool:
        return self.service.leases.clients.get(client.identity) is client

    def _refuse(self, reason: str, rid: int, code: p.ErrorCode, message: str) -> p.Error:
        self.metrics.refused.labels(reason).inc()
        return p.Error(rid=rid, code=code, message=message)

    def answer(self, identity: bytes, payload: bytes | memoryview,
               peer: str = "") -> p._Msg | Any:
        """Decode and handle one frame; never raises for anything a client can send."""
        if len(payload) > self.config.max_message_bytes:  # checked before any decoding
            return self._refuse("frame_too_large", _salvage_rid(payload), p.ErrorCode.TOO_LARGE,
                                f"message of {len(payload)} bytes; the limit is "
                                f"{self.config.max_message_bytes}")
        try:
            msg = p.request_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return p.Error(rid=_salvage_rid(payload), code=p.ErrorCode.MALFORMED, message=str(exc))
        except RecursionError:  # msgspec bounds nesting by the interpreter's recursion limit
            return self._refuse("nesting", _salvage_rid(payload), p.ErrorCode.MALFORMED,
                                "msgpack nested too deeply")
        if isinstance(msg, p.Lookup) and msg.wait_ms > 0:
            if self.parked.full(identity):
                return self._refuse("parked_lookups", msg.rid, p.ErrorCode.TOO_LARGE,
                                    f"{self.parked.limit} lookups of this client are parked "
                                    "already")
            parked = self._parked_bytes().get(identity, 0)
            if parked and parked + len(payload) > PARKED_BYTES_PER_CLIENT:
                return self._refuse("parked_bytes", msg.rid, p.ErrorCode.TOO_LARGE,
                                    f"lookups of {parked} bytes of this client are parked; "
                                    f"the limit is {PARKED_BYTES_PER_CLIENT}")
        try:
            out = self.service.handle(identity, msg, peer)
            if isinstance(msg, p.Bye):  # gone now: its parked lookups answer nobody
                self.parked.cancel_departed(self.service.leases.clients)
            return out
        except RequestError as exc:
            return p.Error(rid=msg.rid, code=exc.code, message=exc.message)
        except Exception:
            log.exception("internal error while handling %s", type(msg).__name__)
            return p.Error(rid=msg.rid, code=p.ErrorCode.INTERNAL, message="internal error")

    async def _serve_frames(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            if len(frames) > 2:  # _reply counts the error
                await self._reply(frames[0].bytes, p.Error(
                    rid=0, code=p.ErrorCode.MALFORMED,
                    message="a request is exactly one msgpack frame"))
            return
        identity, payload = frames[0].bytes, frames[1]
        # tcp: who sent it, for per-peer caps (ipc peers are all the daemon's own user).
        peer = "" if self._ipc else _peer_of(payload)
        if identity not in self.service.leases.clients:
            # A new client: the process behind an ipc connection shares its quotas.
            self.service.quotas.note_client(identity, _pid_of(payload) if self._ipc else 0,
                                            self.service.leases.clients)
        try:
            out = self.answer(identity, payload.buffer, peer)  # decoded in place, no copy
            if isinstance(out, p._Msg):
                await self._reply(identity, out)
            else:
                self._park(identity, len(payload), self._spawn(
                    self._finish(identity, _salvage_rid(payload.buffer), out)))
        except Exception:  # whatever one frame does, the receive loop must go on
            log.exception("unexpected error while serving one frame; continuing")

    async def _serve_control(self) -> None:
        """Bounded turns: at most TURN_FRAMES frames or TURN_SECONDS, then yield.

        Awaiting a ready zmq future does not yield to the loop, so without the turn a flood
        would starve timers, /healthz and parked lookups. ROUTER fair-queues its peers, so
        within a turn every client with frames waiting gets its share."""
        sock = self._sock
        assert sock is not None
        clock = asyncio.get_running_loop().time
        # Frames, not bytes: their metadata names the peer (a tcp address, a CURVE key, an
        # ipc peer's pid) and a payload is decoded from libzmq's buffer without a copy.
        while True:
            await self._serve_frames(await sock.recv_multipart(copy=False))
            end = clock() + TURN_SECONDS
            for _ in range(TURN_FRAMES - 1):
                if clock() >= end:
                    break
                try:
                    frames = await sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    # Every frame that reached the socket so far is read: the lease sweeper
                    # may judge clients up to this moment (server._sweep_leases).
                    self.read_all_at = time.monotonic()
                    break
                await self._serve_frames(frames)
            await asyncio.sleep(0)
