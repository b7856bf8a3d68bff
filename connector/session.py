"""An index-reading engine's session with the daemon: no message on the lookup path.

``IndexSession`` is what an engine's scheduler process holds (the vLLM manager uses it; any
engine can): it registers once (the only call it waits for, bounded by a timeout and made at
most once per retry window), maps the daemon's shared index (``IndexView``) and its own reader
record, and then talks to the daemon only by sending ``Step`` messages without waiting; replies
are read, non-blocking, at the next step.

Liveness without a round trip: the daemon stamps a heartbeat into the index header. A stale
stamp, a superseded index (a newer daemon took the pool over), a send the socket refuses, or a
reply overdue by more than the liveness window make the session offline for ``retry_ms``:
lookups then miss, nothing is stored, and after the window it re-attaches by itself (a new
socket and registration: whatever the old session held is released by its lease).

The reader record protocol (``daemon/store/reclaim.py``): ``begin()`` marks the record busy with the
epoch it is about to read past, refreshes the view, then records the epoch it applied; ``send``
counts the message and, at the end of a step, marks the record idle.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable
from typing import Any, cast

import zmq
from kvoffload.connector.client import DaemonClient, DaemonUnavailable, background_context
from kvoffload.connector.index_view import IndexGone, IndexView
from kvoffload.daemon.base import Geometry
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.control.security import CurveClientKeys
from kvoffload.daemon.store import shared_index as si

log = logging.getLogger("kvoffload.connector")
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class ReaderRecord:
    """This engine's record in the daemon's readers file (written here, read by the daemon)."""

    def __init__(self, path: str, record: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            self._mm = mmap.mmap(fd, 0, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        if not 0 <= record < len(self._mm) // si.READER_BYTES:
            self._mm.close()
            raise IndexGone(f"reader record {record} is outside {path}")
        self._off = record * si.READER_BYTES
        self._seq = si.SEQ.unpack_from(self._mm, self._off)[0] & ~1

    def write(self, busy: bool, epoch: int, sent: int) -> None:
        self._seq += 1  # odd: the daemon retries
        si.SEQ.pack_into(self._mm, self._off, self._seq)
        si.READER.pack_into(self._mm, self._off, self._seq, int(busy), epoch, sent)
        self._seq += 1
        si.SEQ.pack_into(self._mm, self._off, self._seq)

    def close(self) -> None:
        self._mm.close()


class IndexSession:
    def __init__(self, endpoint: str, geometry: Geometry, *, timeout_ms: int = 500,
                 retry_ms: int = 1000, liveness_ms: int = 2000, name: str = "",
                 instance: str = "", curve: CurveClientKeys | None = None,
                 time_model: tuple[float, float] | None = None, sync_ms: int = 2,
                 data_parallel_rank: int | None = None, io_sched_batch: bool = False) -> None:
        self.endpoint = endpoint
        self.data_parallel_rank = data_parallel_rank  # sent on Register: the daemon's view
        self.sync_ms = sync_ms  # longest wait for our own writes' replies at a step's start
        self.geometry = geometry
        self.timeout_ms = timeout_ms
        self.retry_ms = retry_ms
        self.liveness_ns = liveness_ms * 1_000_000
        self.instance = instance
        # Its own context (client.background_context: with io_sched_batch, the I/O thread a
        # Step's send wakes does not preempt the step).
        self.client = DaemonClient(endpoint, timeout_ms=timeout_ms, name=name, curve=curve,
                                   time_model=time_model,
                                   context=background_context(io_sched_batch))
        self.view: IndexView | None = None
        self.reg: p.Registered | None = None
        self._record: ReaderRecord | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._offline_until = 0.0
        self._sent = 0
        self._busy = False
        self._outstanding: dict[int, float] = {}  # rid -> send time of unanswered Steps
        self._sync: set[int] = set()  # of those, the ones the next index read must reflect
        self._pending_replies: list[p.StepReply] = []  # read early, handed out at begin()
        self.on_lost: Callable[[], None] = lambda: None  # the manager drops what it held
        self.counters = {"attaches": 0, "offline_events": 0, "steps_sent": 0,
                         "replies": 0, "send_failures": 0}

    # -- attach / detach ----------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self.view is not None

    def _attach(self) -> bool:
        """Register and map the index: the one waiting call, at most once per retry window."""
        try:
            # No goodbye for an old session: loads in flight may still read what it pinned;
            # its lease releases it (and fences its slots) when it runs out.
            self.client.reset_socket()
            self.client.connect()
            self.reg = reg = self.client.register_reader(self.geometry, self.instance,
                                                         self.data_parallel_rank)
            if not reg.index_path:
                raise IndexGone("the daemon publishes no shared index (shared_index = false)")
            self.view = IndexView(reg.index_path, reg.engine, reg.daemon_id)
            self._record = ReaderRecord(reg.readers_path, reg.reader_record)
        except (DaemonUnavailable, p.ProtocolError, IndexGone, OSError) as exc:
            self._lost(f"cannot attach: {exc}")
            return False
        # The client's socket: Steps go out on it, so they are ordered after the Register.
        self._sock = self.client.socket()
        self._sent = 0
        self._outstanding.clear()
        self._sync.clear()
        self._record.write(False, self.view.applied, 0)
        self.counters["attaches"] += 1
        log.info("kvoffload: attached to daemon %s (engine %d, %d slots)", reg.daemon_id,
                 reg.engine, reg.num_slots)
        return True

    def _lost(self, why: str) -> None:
        if time.monotonic() >= self._offline_until:
            log.warning("kvoffload daemon unavailable (%s); lookups miss for %d ms", why,
                        self.retry_ms)
        self.counters["offline_events"] += 1
        self._offline_until = time.monotonic() + self.retry_ms / 1000
        self._detach()

    def _detach(self) -> None:
        was = self.view is not None
        for res in (self.view, self._record):
            if res is not None:
                res.close()
        self.view, self._record, self._sock, self._busy = None, None, None, False
        self.client.reset_socket()  # a fresh identity: the old one's lease releases its hold
        self._outstanding.clear()
        self._sync.clear()
        if was:
            self.on_lost()

    def _healthy(self) -> str | None:
        view = self.view
        assert view is not None
        if view.superseded():
            return "its index was superseded (daemon restarted)"
        now = si.now_ns()
        if now - view.heartbeat_ns() > self.liveness_ns:
            return "its heartbeat stopped"
        # Insertion order: the first outstanding Step is the oldest. After an idle spell its
        # reply is usually just unread: read what arrived before judging.
        if self._outstanding and self._overdue():
            self._pending_replies.extend(self._poll())
            if self._outstanding and self._overdue():
                return "a step message is unanswered"
        return None

    def _overdue(self) -> bool:
        return next(iter(self._outstanding.values())) < time.monotonic() - self.liveness_ns / 1e9

    # -- one step -------------------------------------------------------------------------

    def begin(self) -> list[p.StepReply] | None:
        """First index read of a step: None when offline, else the replies that arrived."""
        if self.view is None and (time.monotonic() < self._offline_until
                                  or not self._attach()):
            return None
        why = self._healthy()
        if why is not None:
            self._lost(why)
            return None
        view, record = self.view, self._record
        assert view is not None and record is not None
        if self._busy:
            return []
        # Our own writes first: the daemon answers a Step after applying it, so once their
        # replies are in, the index we read next has our claims and commits. A reply still out
        # is waited for, briefly: it is almost always there already (the daemon needs ~0.1 ms,
        # a step takes milliseconds), and never longer than ``sync_ms``. Other replies are
        # read at the step's end (``poll``), off vLLM's lookup path.
        replies, self._pending_replies = self._pending_replies, []
        if self._sync:
            replies += self.wait_replies(self.sync_ms, only_sync=True)
        if self.view is None:
            return None  # lost while reading replies
        record.write(True, view.applied, self._sent)  # busy from before the read on
        view.refresh()
        record.write(True, view.applied, self._sent)
        self._busy = True
        return replies

    def poll(self) -> list[p.StepReply]:
        """The replies that arrived, without waiting (the manager reads them at step end)."""
        return self._poll() if self._outstanding else []

    def _poll(self) -> list[p.StepReply]:
        out: list[p.StepReply] = []
        sock = self._sock
        # Checking the socket's events is cheaper than a receive that raises when empty
        # (plain ints: pyzmq's enum operators cost more than the option read itself).
        while sock is not None and cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                self._lost(f"receive failed: {exc}")
                break
            try:
                reply = p.reply_decoder.decode(frame)
            except Exception:  # noqa: BLE001 - a bad frame is the daemon's bug, not fatal
                log.error("kvoffload: undecodable reply from the daemon")
                continue
            self._outstanding.pop(reply.rid, None)
            self._sync.discard(reply.rid)
            self.counters["replies"] += 1
            if isinstance(reply, p.StepReply):
                out.append(reply)
            elif isinstance(reply, p.Error):
                log.error("kvoffload daemon refused a step: %s: %s", reply.code,
                          reply.message)
                if reply.code == p.ErrorCode.NOT_REGISTERED:
                    self._lost("the daemon no longer knows this engine")
                    break
        return out

    def send(self, build: Callable[[int, int, int], p.Step], *, end_of_step: bool,
             sync: bool = False) -> int | None:
        """Send one Step built by ``build(rid, engine, epoch)`` without waiting; its rid.
        ``sync``: it writes what this engine's next read must see (its claims, commits)."""
        view, record, sock = self.view, self._record, self._sock
        if view is None or record is None or sock is None or self.reg is None:
            return None
        msg = build(self.client.rid(), self.reg.engine, view.applied)
        try:
            sock.send(p.encoder.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.counters["send_failures"] += 1
            self._lost(f"send failed: {exc}")
            return None
        self._sent += 1
        self._outstanding[msg.rid] = time.monotonic()
        if sync:
            self._sync.add(msg.rid)
        self.counters["steps_sent"] += 1
        busy = self._busy and not end_of_step
        record.write(busy, view.applied, self._sent)
        self._busy = busy
        return msg.rid

    def wait_replies(self, timeout_ms: int, only_sync: bool = False) -> list[p.StepReply]:
        """Block up to ``timeout_ms`` for the outstanding replies (all, or ``only_sync``: those
        of writes the next read must see)."""
        out: list[p.StepReply] = []
        deadline = time.monotonic() + timeout_ms / 1000
        while self._sock is not None and (self._sync if only_sync else self._outstanding):
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(max(1, int(left * 1000))):
                break
            out.extend(self._poll())
        return out

    def end_idle(self) -> None:
        """A step that sent nothing: the record goes idle all the same."""
        if self._record is not None and self.view is not None and self._busy:
            self._record.write(False, self.view.applied, self._sent)
            self._busy = False

    def post(self, build: Callable[[int, int], p._Msg]) -> bool:
        """Send a rare message (``Reset``) built by ``build(rid, engine)``, without waiting;
        its reply is read and dropped with the Step replies."""
        if self.reg is None or self._sock is None:
            return False
        try:
            self._sock.send(p.encoder.encode(build(self.client.rid(), self.reg.engine)),
                            zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._lost(f"send failed: {exc}")
            return False
        return True

    def close(self) -> None:
        self._detach()
        self.client.close()
