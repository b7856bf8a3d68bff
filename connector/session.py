"""An index-reading engine's session with the daemon: no message on the lookup path.

``IndexSession`` is what an engine's scheduler process holds (the vLLM manager uses it; any
engine can). Attaching -- Register, mapping the shared index (``IndexView``: a full read of
the table), its session file, a first store reservation -- runs on a background thread, never
on the scheduler's step: while it runs the session is offline (lookups miss, stores are
skipped, counted), and the next step after it finished picks the result up. After that the
session talks to the daemon only by sending ``Step`` messages without waiting; replies are read,
non-blocking, at the next step.

Liveness without a round trip: the daemon stamps a heartbeat into the index header. A stale
stamp, a superseded index (a newer daemon took the pool over), a send the socket refuses, or a
reply overdue by more than the liveness window make the session offline for ``retry_ms``; then
it re-attaches by itself, naming its earlier session (``Register.supersedes``) so the daemon
releases what that one held at once (its grants revoked and quarantined while this engine's
workers may still copy into them), not after a lease.

The other direction: vLLM does not step an idle engine, so a background thread stamps this
engine's heartbeat into its session file a few times per lease; the daemon renews the lease from
it. An idle engine keeps its reservation; a frozen one (SIGSTOP) stops stamping and loses it.

The reader record protocol (``daemon/store/reclaim.py``): ``begin()`` marks the record busy with
the epoch it is about to read past, a full fence, then refreshes the view and records the epoch
it applied; ``send`` counts the message and, at the end of a step, marks the record idle.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import zmq
from kvoffload.connector.client import DaemonClient, DaemonUnavailable, background_context
from kvoffload.connector.index_view import IndexGone, IndexView
from kvoffload.connector.reader_record import ReaderRecord
from kvoffload.daemon.base import Geometry
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.control.security import CurveClientKeys
from kvoffload.daemon.store import fence
from kvoffload.daemon.store import shared_index as si

log = logging.getLogger("kvoffload.connector")
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
REGISTER_MS = 30_000  # a first Register sizes the pool and builds its index: off the step


class _Attached:
    """What a background attach hands to the step: everything it made, or why not."""

    __slots__ = ("reg", "view", "record", "replies", "sent", "error")

    def __init__(self) -> None:
        self.reg: p.Registered | None = None
        self.view: IndexView | None = None
        self.record: ReaderRecord | None = None
        self.replies: list[p.StepReply] = []
        self.sent = 0  # Steps it sent (the reservation)
        self.error = ""


class IndexSession:
    def __init__(self, endpoint: str, geometry: Geometry, *, timeout_ms: int = 500,
                 retry_ms: int = 1000, liveness_ms: int = 2000, name: str = "",
                 instance: str = "", curve: CurveClientKeys | None = None,
                 time_model: tuple[float, float] | None = None, sync_ms: int = 1,
                 data_parallel_rank: int | None = None, io_sched_batch: bool = False,
                 reserve: int | Callable[[int], int] = 0, writer_lock: bool = True) -> None:
        self.endpoint = endpoint
        self.data_parallel_rank = data_parallel_rank  # sent on Register: the daemon's view
        self.sync_ms = sync_ms  # longest wait for our own writes' replies at a step's start
        self.geometry = geometry
        self.timeout_ms = timeout_ms
        self.retry_ms = retry_ms
        self.liveness_ns = liveness_ms * 1_000_000
        self.instance = instance
        # Slots asked for right after attaching (the attach thread), or a function of the
        # pool's slot count that says how many.
        self.reserve = reserve
        self.writer_lock = writer_lock  # our workers take the session's lock (worker.py)
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
        self._previous = ""  # our last session's file: the next Register releases it
        self._attaching: threading.Thread | None = None
        self._attached: _Attached | None = None  # the attach thread's result, once done
        self._stop = threading.Event()
        self._kick = threading.Event()  # wakes the heartbeat thread (a new session, close)
        self._heartbeat = threading.Thread(target=self._beat, daemon=True,
                                           name="kvoffload-heartbeat")
        self._heartbeat.start()
        self.on_lost: Callable[[], None] = lambda: None  # the manager drops what it held
        self.counters = {"attaches": 0, "offline_events": 0, "steps_sent": 0,
                         "replies": 0, "send_failures": 0, "attach_failures": 0}

    # -- attach / detach ----------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self.view is not None

    @property
    def attaching(self) -> bool:
        return self._attaching is not None

    def start(self, wait_s: float) -> bool:
        """Attach at engine start, waiting up to ``wait_s`` (off any step: the engine is not
        serving yet); True once attached. Slower than that, the engine serves without
        offload until the attach thread is done, and says so once."""
        self._start_attach()
        thread = self._attaching
        if thread is not None:
            thread.join(wait_s)
        self._take_attached()
        if self.view is None:
            log.warning("kvoffload: not attached to the daemon at %s after %.1f s (%s); the "
                        "engine serves without offload until it is", self.endpoint, wait_s,
                        "still registering" if self._attaching is not None else
                        "see the warning above")
        return self.view is not None

    def _start_attach(self) -> None:
        if self._attaching is not None or time.monotonic() < self._offline_until:
            return
        self.client.reset_socket()  # the old socket is not used from now on
        self._sock = None
        self._attaching = threading.Thread(target=self._attach_thread, daemon=True,
                                           name="kvoffload-attach")
        self._attaching.start()

    def _attach_thread(self) -> None:
        """Register, map the index and the session file, fill the reservation: the waiting
        part of attaching, off the scheduler's thread."""
        out = _Attached()
        try:
            self.client.connect()
            reg = self.client.register_reader(self.geometry, self.instance,
                                              self.data_parallel_rank,
                                              writer_lock=self.writer_lock,
                                              supersedes=self._previous,
                                              timeout_ms=max(self.timeout_ms, REGISTER_MS))
            if not reg.index_path:
                raise IndexGone("the daemon publishes no shared index (shared_index = false)")
            if not fence.AVAILABLE:
                raise IndexGone("no memory fence on this CPU (libatomic.so.1 is missing)")
            out.reg = reg
            out.view = IndexView(reg.index_path, reg.engine, reg.daemon_id)
            out.record = ReaderRecord(reg.readers_path, reg.reader_record)
            out.record.write(False, out.view.applied, 0)
            out.record.stamp()
            n = self.reserve(reg.num_slots) if callable(self.reserve) else self.reserve
            if n:
                out.replies = self._first_reservation(out.view.applied, n)
                out.sent = 1
        except (DaemonUnavailable, p.ProtocolError, IndexGone, OSError, zmq.ZMQError) as exc:
            out.error = f"cannot attach: {exc}"
            for res in (out.view, out.record):
                if res is not None:
                    res.close()
            out.view = out.record = None
        self._attached = out  # handed over under the GIL; picked up by the next step

    def _first_reservation(self, epoch: int, n: int) -> list[p.StepReply]:
        """One reservation, waited for here (the attach thread): stores have slots at once.
        The reply is handed to the manager with the step's other replies."""
        reg = self.client.registered
        assert reg is not None
        sock = self.client.socket()
        msg = p.Step(rid=self.client.rid(), engine=reg.engine, epoch=epoch,
                     reserve=n)
        sock.send(p.encoder.encode(msg), zmq.NOBLOCK)
        out: list[p.StepReply] = []
        if sock.poll(self.timeout_ms):
            reply = p.reply_decoder.decode(sock.recv())
            if isinstance(reply, p.StepReply):
                out.append(reply)
        return out

    def _take_attached(self) -> bool:
        """The step's side of attaching: install what the attach thread made."""
        out, thread = self._attached, self._attaching
        if out is None or thread is None:
            return False
        thread.join(0)  # done already (it set ``_attached`` last): never waits
        self._attached, self._attaching = None, None
        if out.error or out.view is None or out.record is None or out.reg is None:
            self.counters["attach_failures"] += 1
            self._lost(out.error or "cannot attach")
            return False
        self.reg, self.view, self._record = out.reg, out.view, out.record
        self._previous = out.reg.readers_path
        # The client's socket: Steps go out on it, so they are ordered after the Register.
        self._sock = self.client.socket()
        self._sent = out.sent
        self._outstanding.clear()
        self._sync.clear()
        self._record.write(False, self.view.applied, self._sent)
        self._pending_replies.extend(out.replies)
        self.counters["attaches"] += 1
        log.info("kvoffload: attached to daemon %s (engine %d, %d slots)", out.reg.daemon_id,
                 out.reg.engine, out.reg.num_slots)
        return True

    def settle(self) -> bool:
        """Between steps: start a due re-attach or install a finished one (never waits)."""
        if self.view is None:
            if self._attaching is None:
                self._start_attach()
            self._take_attached()
        return self.view is not None

    def _beat(self) -> None:
        """Stamp our heartbeat a few times per lease, whether vLLM steps or not."""
        lease_s = 0.1  # until a Welcome says: short, so the first lease never runs out
        while not self._stop.is_set():
            record = self._record
            if record is not None:
                record.stamp()
                welcome = self.client.welcome
                if welcome is not None:
                    lease_s = welcome.lease_ms / 1000
            self._kick.wait(max(0.02, min(1.0, lease_s / 4)))
            self._kick.clear()

    def _lost(self, why: str) -> None:
        if time.monotonic() >= self._offline_until:
            log.warning("kvoffload daemon unavailable (%s); lookups miss for %d ms", why,
                        self.retry_ms)
        self.counters["offline_events"] += 1
        self._offline_until = time.monotonic() + self.retry_ms / 1000
        self._detach()

    def _detach(self) -> None:
        was = self.view is not None
        view, record = self.view, self._record
        self.view, self._record, self._sock, self._busy = None, None, None, False
        for res in (view, record):
            if res is not None:
                res.close()
        if self._attaching is None:
            self.client.reset_socket()  # a fresh identity for the next attach
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
        """First index read of a step: None when offline, else the replies that arrived.
        Never waits on the daemon beyond ``sync_ms`` (attaching runs on its own thread)."""
        if self.view is None:
            if self._attaching is None:
                self._start_attach()
            if not self._take_attached():
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
        fence.full()  # ... visible to the daemon before we read what it published
        if view.refresh():  # the record holds the epoch read past: only a move needs it
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
            # Rounded up: zmq polls whole milliseconds, and 1.9 ms truncated to 1 gave up on
            # replies that came 1.2-1.7 ms after a ramp's ask (``_top_up``), sync_ms being 2.
            if left <= 0 or not self._sock.poll(math.ceil(left * 1000)):
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
        """A clean goodbye: the daemon releases what this session holds at once."""
        self._stop.set()
        self._kick.set()
        thread = self._attaching
        if thread is not None:
            thread.join(self.timeout_ms / 1000 + 1)
            self._take_attached()
        self.client.close()  # sends Bye while the daemon still knows us
        self._detach()
