"""Keeping the event loop breathing: lag measurement, per-client parked work, backlog drains.

Everything the daemon does runs on one asyncio loop, so one client that sends a flood, a huge
request or a lookup that parks forever must not delay anybody else (other clients, /healthz,
the lease sweeper, the systemd watchdog). The server's receive loop works in bounded turns
(``TURN_FRAMES`` / ``TURN_SECONDS``) and yields in between; this module holds the pieces it
uses:

- ``LoopLagMonitor``: a timer that re-arms itself every ``interval`` and records how late it
  fired, the loop's lag, in ``kvoffload_event_loop_lag_seconds`` (a histogram, so p99 and
  p99.99 stalls are visible from Prometheus);
- ``ParkedLookups``: the lookups parked on pending keys, per client, so their number is
  bounded and a departed client's parked lookups are cancelled (they would otherwise take
  pins for nobody when their keys commit);
- ``drain_backlog``: waits until the control socket has no unread message, so the lease
  sweeper judges clients on what they sent, not on what the daemon has not read yet (after a
  SIGSTOP/SIGCONT freeze, heartbeats sent meanwhile wait in the socket).
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio
from kvoffload.daemon.ops.metrics import DaemonMetrics

# One turn of the receive loop handles at most this many frames or this much time, then
# yields: timers, HTTP answers and replies of parked lookups run between turns.
TURN_FRAMES = 64
TURN_SECONDS = 0.005
# Lookups a single client may have parked on pending keys at once (each holds a task, its
# request and futures); more are refused with ``too_large``.
MAX_PARKED_PER_CLIENT = 1024


class LoopLagMonitor:
    """Measures how late a periodic timer fires on the running loop."""

    def __init__(self, metrics: DaemonMetrics, interval: float = 0.025) -> None:
        self.metrics = metrics
        self.interval = interval
        self.max_lag = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._due = loop.time() + self.interval
        self._handle = loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        lag = max(0.0, now - self._due)
        self.metrics.loop_lag.observe(lag)
        if lag > self.max_lag:
            self.max_lag = lag
            self.metrics.loop_lag_max.set(lag)
        self._due = now + self.interval
        self._handle = loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class ParkedLookups:
    """Tasks of lookups parked on pending keys, by client identity."""

    def __init__(self, limit: int = MAX_PARKED_PER_CLIENT) -> None:
        self.limit = limit
        self._by_client: dict[bytes, set[asyncio.Task[Any]]] = {}

    def full(self, identity: bytes) -> bool:
        return len(self._by_client.get(identity, ())) >= self.limit

    def add(self, identity: bytes, task: asyncio.Task[Any]) -> None:
        tasks = self._by_client.setdefault(identity, set())
        tasks.add(task)
        task.add_done_callback(lambda t: self._done(identity, t))

    def _done(self, identity: bytes, task: asyncio.Task[Any]) -> None:
        tasks = self._by_client.get(identity)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._by_client[identity]

    def cancel_departed(self, present: Any) -> int:
        """Cancel the parked lookups of every client not in ``present`` (a container of
        identities); returns how many. Their replies would reach nobody, and a pin taken for
        a client whose lease is gone is never released."""
        n = 0
        for identity in [i for i in self._by_client if i not in present]:
            for task in list(self._by_client.get(identity, ())):
                task.cancel()
                n += 1
        return n

    def __len__(self) -> int:
        return sum(len(t) for t in self._by_client.values())


def has_unread(sock: zmq.asyncio.Socket | None) -> bool:
    if sock is None or sock.closed:
        return False
    # ``get``, not ``getsockopt``: reading ZMQ_EVENTS consumes the edge-triggered ZMQ_FD
    # signal, and only the asyncio socket's ``get`` re-schedules a waiting recv future for it
    # (else the receive loop can sleep on frames that are already there).
    events = sock.get(zmq.EVENTS)
    return isinstance(events, int) and bool(events & zmq.POLLIN)


async def drain_backlog(sock: zmq.asyncio.Socket | None, settle: float,
                        limit: float) -> None:
    """Let the receive loop read what is queued: first ``settle`` seconds (libzmq's I/O thread
    moves bytes the kernel buffered during a freeze into the socket), then until the socket
    reports nothing unread, at most ``limit`` seconds in all."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    if settle > 0:
        await asyncio.sleep(settle)
    while has_unread(sock) and loop.time() < end:
        await asyncio.sleep(TURN_SECONDS)
