"""The daemon's lifecycle: start -> ready -> serve -> drain -> stop.

``Server`` owns the edges (the control ROUTER socket, the HTTP server, the pool mapping, the
lease sweeper); ``Service`` owns the state. ``run`` wires signals: SIGTERM or SIGINT drains
(no new reservations, pins or stores; loads in flight finish, up to ``drain_ms``), then shuts
down (answers what is in flight, supersedes the index, flushes) and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from kvoffload.daemon.config import Config
from kvoffload.daemon.control.frames import ControlFrames, _salvage_rid  # noqa: F401 - re-exported
from kvoffload.daemon.control.security import (
    EVENTS_ZAP_DOMAIN,
    CurveGuard,
    curve_server_options,
    insecure_endpoint_warning,
    load_keypair,
)
from kvoffload.daemon.control.service import Service
from kvoffload.daemon.ops.http import HttpServer, NotReady
from kvoffload.daemon.ops.loop_health import (
    LoopLagMonitor,
    ParkedLookups,
    drain_backlog,
    has_unread,
)
from kvoffload.daemon.ops.metrics import DaemonMetrics
from kvoffload.daemon.ops.notify import Notifier
from kvoffload.daemon.preflight import (
    check_ipc_folders,
)
from kvoffload.daemon.startup import ServerStartup, StartupError
from kvoffload.daemon.state.journal import Journal
from kvoffload.daemon.store.index import BlockIndex
from kvoffload.daemon.store.pool import Pool
from kvoffload.daemon.store.shared_index import index_path_for, supersede
from kvoffload.daemon.streams.publish import DaemonEvents, event_options
from kvoffload.daemon.tiers import Promoter
from kvoffload.daemon.tiers.base import Tier
from kvoffload.daemon.tiers.disk.tier import DiskTier
from kvoffload.daemon.tiers.mooncake.promoter import SharedPromoter
from kvoffload.daemon.tiers.mooncake.tier import MooncakeTier
from prometheus_client import Gauge

log = logging.getLogger("kvoffload.daemon")
HANDOVER_TICK_S = 0.001  # reclaim retries while a claimed earmark waits for readers

class Server(ControlFrames, ServerStartup):
    def __init__(self, config: Config, ready_file: str | None = None) -> None:
        self.config = config
        self.ready_file = ready_file
        self.metrics = DaemonMetrics()
        self.pool = Pool(config.pool_path, config.pool_bytes, prefault=config.prefault)
        self.index = BlockIndex(self.pool, config.policy)
        self.index.earmark_reservations = config.earmark_reservations
        self._wake = asyncio.Event()  # a claimed earmark waits for readers: reclaim soon
        self.index.on_handover_queued = self._wake.set
        event_eps = {"events": config.events, "events_replay": config.events_replay,
                     "lookup_events": config.lookup_events, "hub": config.hub,
                     "hub_replay": config.hub_replay}
        check_ipc_folders(event_eps)  # one line naming the setting, not ZMQ's error
        secure = None
        if config.events_curve:  # CURVE servers before they bind; ZAP admits from start()
            try:
                keys = load_keypair(str(config.curve_server_key))
            except ValueError as exc:
                raise StartupError(str(exc)) from None
            secure = functools.partial(curve_server_options, server=keys,
                                       domain=EVENTS_ZAP_DOMAIN)
        try:  # the event sockets bind here: an address in use is a start fault
            self.events = DaemonEvents(events=config.events, events_replay=config.events_replay,
                                       lookup_events=config.lookup_events,
                                       int_hashes=config.event_hashes == "int",
                                       registry=self.metrics.registry,
                                       engine_events=config.engine_events,
                                       engine_max_tokens=config.engine_events_max_tokens,
                                       hub=config.hub, hub_replay=config.hub_replay,
                                       hub_buffer_batches=config.hub_buffer_batches,
                                       secure=secure, **event_options(config))
        except ValueError as exc:  # a profile, topic or engine view that cannot work
            raise StartupError(str(exc)) from None
        except zmq.ZMQError as exc:
            given = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in event_eps.items() if v)
            raise StartupError(f"cannot bind the event endpoints ({given}): {exc}; choose "
                               "free addresses (tcp://127.0.0.1:0 picks a port)") from None
        self.service = Service(config, self.index, self.metrics, self.events)
        self.tiers: Promoter | None = None  # with --disk-dir: the disk tier below the pool
        local: list[Tier] = []
        if config.disk_dir:
            self.events.keep_payloads = True  # evicted blocks keep their event on disk
            local.append(DiskTier(config.disk_dir, config.disk_bytes, self.metrics,
                                  self.events))
        self.mooncake: MooncakeTier | None = None  # with --mooncake-master: the shared tier
        if config.mooncake_master:
            self.events.keep_payloads = True  # blocks carry their event to other nodes
            self.mooncake = MooncakeTier(config, self.index, self.metrics, self.events)
            self.tiers = SharedPromoter(self.index, local, self.mooncake, self.metrics,
                                        self.events, self.service._update_pool_gauges)
        elif local:
            self.tiers = Promoter(self.index, local, self.metrics, self.events,
                                  self.service._update_pool_gauges,
                                  read_bytes_per_s=config.disk_read_bytes_per_s)
        if self.tiers is not None:
            self.service.lookups.tiers = self.tiers
            self.service.steps.tiers = self.tiers  # finds of index-reading engines
        self.http = HttpServer(*config.http_host_port, self.metrics.registry, self.readiness,
                               details=self.bound_endpoints, metrics=self.metrics)
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._lock_fd: int | None = None
        self._lock_made: Path | None = None
        self._made_dirs: list[Path] = []
        self._tasks: set[asyncio.Task[Any]] = set()  # replies still being worked out
        self._loops: list[asyncio.Task[Any]] = []  # the receive loop and the lease sweeper
        self._stopping = asyncio.Event()
        self.stop_requests = 0
        self.accepting = False
        self.control_endpoint = config.control
        self.notifier = Notifier.from_env()
        self.curve: CurveGuard | None = None
        self.journal: Journal | None = None  # with --state-dir: the index's journal
        self.started = False  # start() completed: only then is there a daemon to stop
        # A state dir that cannot be used: 1 while the daemon runs cold because of it.
        self.state_dir_faulty = Gauge("kvoffload_state_dir_faulty", "1 when the state dir "
                                      "was unusable at start and the daemon started cold.",
                                      registry=self.metrics.registry)
        self.loop_lag = LoopLagMonitor(self.metrics)
        self.parked = ParkedLookups()  # lookups waiting on pending keys, per client
        self.read_all_at = time.monotonic()  # the control socket had nothing unread then
        # A lookup parked for a client that has gone must not pin anything when it resolves.
        self.service.lookups.client_alive = self._client_alive

    # -- start ------------------------------------------------------------------------

    def readiness(self) -> dict[str, bool | str]:
        why = self.attach_problem()
        checks: dict[str, bool | str] = {
            "pool_mapped": self.pool.mapped, "control_bound": self._sock is not None,
            "accepting": self.accepting,
            "engines_can_attach": True if why is None else NotReady(why)}
        if self.mooncake is not None:  # a detail, never False: the pool serves without it
            checks["mooncake"] = self.mooncake.readiness()
        return checks

    def bound_endpoints(self) -> dict[str, object]:
        """What each socket is bound to (real ports for tcp://...:0), for /readyz and logs."""
        ev = self.events
        eps = {"control": self.control_endpoint if self._sock is not None else None,
               "http": self.http.url or None,
               "events": ev.kv.bound_endpoint if ev.kv else None,
               "events_replay": ev.kv.bound_replay_endpoint if ev.kv else None,
               "lookup_events": ev.lookups.bound_endpoint if ev.lookups else None,
               "hub": ev.hub.bound_endpoint if ev.hub else None,
               "hub_replay": ev.hub.bound_replay_endpoint if ev.hub else None}
        return {"endpoints": {k: v for k, v in eps.items() if v}, **ev.view_status()}

    async def start(self) -> None:
        self._lock_ipc()
        try:
            self.curve = CurveGuard.from_files(self.config.curve_server_key,
                                               self.config.curve_client_keys, self._ctx,
                                               self.metrics.registry)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        if warning := insecure_endpoint_warning(self.config.control, self.curve is not None):
            log.warning("%s", warning)
        try:  # before the pool is sized and pre-faulted: a port in use fails in a moment
            await self.http.start()  # /readyz answers 503 until the daemon accepts
        except OSError as exc:
            raise StartupError(f"http {self.config.http}: cannot listen: {exc.strerror or exc}"
                               "; choose a free port with --http HOST:PORT (port 0 picks one)"
                               ) from None
        try:
            self.pool.open()
        except OSError as exc:
            raise StartupError(f"pool_path {self.pool.path}: {exc}") from None
        self._check_index_files()
        # Ours now (the pool's lock is held): engines of a previous daemon stop trusting its
        # index before this one hands out any slot.
        supersede(index_path_for(self.pool.path))
        if self.config.slot_bytes:
            self.index.configure(self.config.slot_bytes)
        if self.config.state_dir:  # warm restart: rebuild and validate before any client
            self._recover(Path(self.config.state_dir))
        if self.tiers is not None:  # find the blocks a previous run left on disk
            try:
                await self.tiers.start()
            except ImportError as exc:
                raise StartupError(f"mooncake tier: the mooncake wheel cannot load ({exc}); "
                                   "see docs/tiers.md") from None
            except OSError as exc:
                raise StartupError(f"disk tier {self.config.disk_dir}: {exc}") from None
        self._bind()
        if self.config.events_curve and self.curve is not None:
            # The publishers' sockets live in the process-wide context: admit there too.
            self.curve.serve_context(zmq.Context.instance())
        await self.events.start()
        self.service.http_url = self.http.url
        loop = asyncio.get_running_loop()
        self._loops = [loop.create_task(self._serve_control()),
                       loop.create_task(self._sweep_leases()),
                       loop.create_task(self._index_heartbeat())]
        self.loop_lag.start()
        self.accepting = True
        self.started = True
        self.metrics.pool_bytes.labels("total").set(self.pool.pool_bytes)
        # Recovered state is exported from the first scrape, not from the first client.
        self.service._update_pool_gauges()
        self.metrics.engines.set(len(self.index.namespaces))
        log.info("kvoffload daemon ready: control %s, http %s, pool %s (%d bytes, policy %s)",
                 self.control_endpoint, self.http.url, self.pool.path, self.pool.pool_bytes,
                 self.config.policy)
        log.info("bound endpoints: %s", json.dumps(self.bound_endpoints()["endpoints"]))
        if self.ready_file:
            self._write_ready_file()
        self.notifier.ready(f"serving {self.control_endpoint}")
        self.notifier.start_watchdog()

    async def _index_heartbeat(self) -> None:
        """Engines read the daemon's liveness from the shared index, without a message; fenced
        and retired slots whose time came are reclaimed on the same tick. While a claimed
        earmark waits for readers (an engine's record stays busy a moment after its Step
        arrives: nothing is sent when it goes idle), the tick is every millisecond, so the
        writer waiting in its copy lane gets the slot about as soon as no reader holds it."""
        while True:
            shared = self.index.shared
            if shared is not None:
                shared.heartbeat()
                self.index.reclaim()
                self.index.expire_handovers()
                # Not while draining: nothing new will be stored, and an eviction now only
                # loses a block a warm restart would have kept.
                if not self.service.draining and (ahead := self.index.keep_free()):
                    self.metrics.evictions.labels(self.index.policy.name, "capacity").inc(ahead)
                    self.service._update_pool_gauges()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(),
                                       HANDOVER_TICK_S if self.index.handovers else 0.1)

    async def _sweep_leases(self) -> None:
        """Expire leases, but only after reading what clients sent: a sweep that wakes late
        (the daemon was frozen or starved) first lets the receive loop drain the backlog."""
        period = max(0.05, self.config.lease_ms / 4000)
        loop = asyncio.get_running_loop()
        due = loop.time() + period
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            late = loop.time() - due
            if late > period:  # a stall: heartbeats of the stalled time are still unread
                await drain_backlog(self._sock, settle=min(0.2, period), limit=4 * period)
            elif has_unread(self._sock):
                await drain_backlog(self._sock, settle=0.0, limit=period)
            # Parked lookups of expired clients stay: they answer a miss without pins when
            # their keys resolve (lookups.py), so a client that only waited too long learns.
            self.service.expire_leases(self.lease_cutoff())
            due = loop.time() + period

    def lease_cutoff(self) -> float:
        """The moment (time.monotonic()) up to which leases may be judged: now, unless frames
        wait unread (a backlog longer than the sweeper's drain). They may renew leases, so
        clients are judged only up to the last moment everything was read: one whose frames
        queue behind others' keeps what it holds. A socket never empty (a flood) delays
        expiry by at most the longest lease a client can get (10 x lease_ms)."""
        now = time.monotonic()
        if not has_unread(self._sock):
            self.read_all_at = now
            return now
        return max(self.read_all_at, now - 10 * self.config.lease_ms / 1000)

    # -- stop -------------------------------------------------------------------------

    def request_stop(self) -> None:
        self.stop_requests += 1  # a second signal cuts the drain short
        self._stopping.set()

    async def wait_stopped(self) -> None:
        await self._stopping.wait()

    def _stop_granting(self) -> None:
        if self.service.draining:
            return  # drain() did it already
        self.accepting = False  # /readyz: 503 from now on
        self.notifier.stopping()
        self.service.draining = True  # only commits, load completions, heartbeats, goodbyes
        self.service.lookups.stop_waiting()  # parked lookups answer now, even on pending keys
        self.index.cancel_waiters()  # parked lookups re-run and answer now

    async def drain(self) -> None:
        """Before ``shutdown``: stop granting, then wait until no slot is pinned (the loads in
        flight completed, or their clients' leases ended), ``drain_ms`` passed, or another
        SIGTERM/SIGINT came (an operator who means "now").

        Shutdown marks the index superseded, and every worker checks that flag after its copy:
        superseding at once would fail loads whose bytes are intact. The sockets, the lease
        sweeper and the heartbeat keep running meanwhile, so completions arrive and dead
        clients' pins go."""
        self._stop_granting()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0, self.config.drain_ms) / 1000
        signals = self.stop_requests
        if self.index.n_pinned:
            log.info("draining: %d slots pinned by loads in flight; waiting up to %d ms",
                     self.index.n_pinned, self.config.drain_ms)
        # Polled: pins drop in the index (a CompleteLoad, a Step's releases, a lease that
        # ends) with nothing to await; 10 ms is short next to the bound and costs nothing.
        while (self.index.n_pinned and loop.time() < deadline
               and self.stop_requests <= signals):
            await asyncio.sleep(0.01)
        if self.index.n_pinned:
            log.warning("drain ended (%s) with slots still pinned (%d): loads still copying "
                        "them will fail", "another signal" if self.stop_requests > signals
                        else f"drain_ms {self.config.drain_ms} passed", self.index.n_pinned)

    async def shutdown(self) -> None:
        """Stop accepting, answer parked lookups, close sockets, unmap and unlock; after a
        refused start, also remove what the start created."""
        self._stop_granting()
        self.loop_lag.stop()
        await asyncio.sleep(0)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        for task in [*self._tasks, *self._loops]:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, *self._loops, return_exceptions=True)
        if self.tiers is not None:  # promotions write into the pool: finish them first
            await self.tiers.aclose()
        await self.events.aclose()  # flush what is queued before the sockets go
        await self.http.stop()
        if self.curve is not None:
            await self.curve.aclose()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._ctx.term()
        if self.journal is not None:  # drain and snapshot before the pool is unmapped
            await asyncio.get_running_loop().run_in_executor(None, self.journal.close)
            self.journal = None
        if self.index.shared is not None:  # engines stop trusting it before the pool goes
            self.index.shared.close()
        self.service.close_sessions()
        # Without a state dir nothing can reuse the pool file: give its memory back. Nor
        # after a refused start that created it: nothing half-started stays.
        self.pool.close(remove=self.config.state_dir is None or
                        (not self.started and self.pool.created))
        if not self.started:
            self._undo_start()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self.notifier.close()
        if self.started:  # a start that failed said why; "stopped" would mislead
            log.info("kvoffload daemon stopped")


async def serve(config: Config, ready_file: str | None = None) -> Server:
    """Run a daemon until SIGTERM or SIGINT, then shut it down gracefully."""
    server = Server(config, ready_file)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_stop)
    try:
        await server.start()
        await server.wait_stopped()
        log.info("signal received: draining")
        await server.drain()
    finally:
        await server.shutdown()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return server


def _exit_now_if_needed(server: Server) -> None:
    """Everything is closed and flushed; only the Mooncake client's C++ teardown is left, and
    with its master unreachable it blocks for ~20 s: skip it (daemon/tiers/mooncake/tier.py)."""
    if server.mooncake is not None and server.mooncake.skip_teardown:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run(config: Config, ready_file: str | None = None) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep serving without it
        server = asyncio.run(serve(config, ready_file))
    else:
        server = uvloop.run(serve(config, ready_file))
    _exit_now_if_needed(server)
    return 0
