"""Start-up steps of ``server.Server``: the control path's lock, the control socket's bind,
warm restart from the state dir (or a loud cold start), the ready file; what a refused start
undoes; whether engines can attach (for /readyz).

A mixin of ``server.Server`` (split out to keep each module readable).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import zmq
import zmq.asyncio
from kvoffload.daemon.config import Config
from kvoffload.daemon.control.frames import socket_limits
from kvoffload.daemon.control.security import CurveGuard
from kvoffload.daemon.control.service import Service
from kvoffload.daemon.ops.http import HttpServer
from kvoffload.daemon.ops.metrics import DaemonMetrics
from kvoffload.daemon.preflight import StartFault, probe_state_dir, remove_folders, secure_dir
from kvoffload.daemon.state.journal import Journal, StateDirError, recover_state
from kvoffload.daemon.store import private_files as pf
from kvoffload.daemon.store import shared_index as si
from kvoffload.daemon.store.index import BlockIndex
from kvoffload.daemon.store.pool import Pool
from kvoffload.daemon.streams.publish import DaemonEvents
from prometheus_client import Gauge

log = logging.getLogger("kvoffload.daemon")

# The shared index as earlier daemons (and shared_index.py so far) write it, with no mark at
# its end: recognized by its header's magic.
INDEX_LEGACY = pf.starts_with(si.MAGIC)


class StartupError(StartFault):
    """The daemon cannot start (endpoint or pool in use, bad path); the message says why."""


class ServerStartup:
    # Set by Server.__init__ (declared here for the methods below).
    config: Config
    ready_file: str | None
    metrics: DaemonMetrics
    pool: Pool
    index: BlockIndex
    events: DaemonEvents
    service: Service
    http: HttpServer
    journal: Journal | None
    state_dir_faulty: Gauge
    control_endpoint: str
    _lock_fd: int | None
    _lock_made: Path | None  # the control lock file, when this start created it
    _made_dirs: list[Path]  # folders this start created for the control socket
    _ctx: zmq.asyncio.Context
    _sock: zmq.asyncio.Socket | None
    curve: CurveGuard | None

    def _lock_ipc(self) -> None:
        """ZMQ silently takes over an ipc path in use; a lock file makes a 2nd start fail.
        The folder and the lock file are the daemon's own (preflight, private_files)."""
        if not self.config.control.startswith("ipc://"):
            return
        path = Path(self.config.control[len("ipc://"):])
        self._made_dirs = secure_dir(path.parent, "control")
        lock = Path(f"{path}.lock")
        try:
            fd, created = pf.open_lock(lock, setting="control", what="control lock file")
        except pf.FileLocked as exc:
            raise StartupError(f"control {self.config.control} is in use by {exc.holder} "
                               "(another kvoffload daemon): stop it or choose another "
                               "--control") from None
        self._lock_fd = fd
        self._lock_made = lock if created else None

    def _bind(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # MAXMSGSIZE and RCVHWM bound what one connection can make the daemon hold
        # (frames.socket_limits, docs/security.md).
        for option, value in socket_limits(self.config).items():
            sock.setsockopt(option, value)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if self.curve is not None:
            self.curve.configure(sock)  # before bind: CURVE server + ZAP allow-list
        old = os.umask(0o177)  # ipc sockets are created 0600 (0o077 gave 0700)
        try:
            sock.bind(self.config.control)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise StartupError(f"cannot bind control endpoint {self.config.control}: "
                               f"{exc}") from None
        finally:
            os.umask(old)
        self.control_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.config.control.startswith("ipc://"):
            # A socket file takes the mode 0777 & ~umask = 0700; only read/write matter.
            os.chmod(self.config.control[len("ipc://"):], 0o600)
        self._sock = sock

    def _check_index_files(self) -> None:
        """Before the old index is superseded (and unlinked): a file at an index path that no
        kvoffload daemon of this user made stops the start in one line, untouched."""
        pf.check_previous(si.index_path_for(self.pool.path), kind=pf.KIND_INDEX,
                          setting="pool_path", what="shared index", legacy=INDEX_LEGACY)

    def attach_problem(self) -> str | None:
        """Why engines cannot attach now (map the pool, read the index), or None."""
        if not self.pool.mapped:
            return None  # not started: "pool_mapped" says so
        if why := self.pool.problem():
            return why
        if not self.config.shared_index or not self.pool.configured:
            return None  # the index is made with the slot size, by the first engine
        index = si.index_path_for(self.pool.path)
        if self.index.shared is None:
            return pf.problem(index, kind=pf.KIND_INDEX, setting="pool_path",
                              what="shared index", legacy=INDEX_LEGACY) or (
                f"the shared index {index} could not be created (the daemon's log says "
                "why): engines that read the index cannot attach; fix it and restart")
        return pf.problem(index, kind=pf.KIND_INDEX, setting="pool_path", what="shared index",
                          legacy=INDEX_LEGACY)

    def _undo_start(self) -> None:
        """A refused start leaves nothing behind: the lock file it created goes while it is
        still held (so no other daemon can be using it), then the folders it created, if
        empty. Call it after the sockets and the pool are closed."""
        if self._lock_fd is not None:
            if self._lock_made is not None:
                pf.remove(self._lock_made, self._lock_fd)
            os.close(self._lock_fd)
            self._lock_fd = None
        remove_folders(self.pool.made_dirs)
        remove_folders(self._made_dirs)

    def _recover(self, state_dir: Path) -> None:
        """Warm restart from the state dir, or a cold start when it cannot be used
        (``state_dir_errors = "cold"``, the default) or one line (``"refuse"``). Whatever
        the folder holds, the start never ends in a traceback."""
        why = probe_state_dir(state_dir)
        if why is None:
            try:
                self.journal = recover_state(state_dir, self.index, self.metrics.registry,
                                             self.config.slot_bytes, self.service._block_added,
                                             errors=self.config.state_dir_errors)
            except StateDirError as exc:  # refused: the message names the folder and why
                raise StartupError(f"{exc}; fix it, or set state_dir_errors = \"cold\" to "
                                   "start without warm restart") from None
            except OSError as exc:  # after the probe passed: the disk failed meanwhile
                why = f"recovery failed: {exc.strerror or exc}"
            except Exception as exc:  # a state dir no check foresaw: still one line
                if self.index.namespaces:  # blocks half restored: not a cold start any more
                    raise StartupError(f"state_dir {state_dir}: recovery failed: "
                                       f"{type(exc).__name__}: {exc}; move the folder away or "
                                       "start without --state-dir") from None
                why = f"recovery failed: {type(exc).__name__}: {exc}"
            else:
                for ns in self.index.namespaces:  # re-announced once their payload is known
                    for key, slot in ns.keys.items():
                        self.events.recovered(ns, key, slot, bool(self.index.tail[slot]))
                return
        if self.config.state_dir_errors == "refuse":
            raise StartupError(f"state_dir {state_dir}: {why}; fix it, or set "
                               "state_dir_errors = \"cold\" to start without warm restart")
        self.state_dir_faulty.set(1)
        kept = len(self.index)  # blocks restored before the disk failed: validated, served
        log.warning("STATE DIR UNUSABLE: state_dir %s: %s. Starting COLD: %s and nothing is "
                    "journaled until it is fixed and the daemon restarted (state_dir_errors = "
                    "\"refuse\" stops the start instead)", state_dir, why,
                    f"{kept} blocks recovered" if kept else "nothing is recovered")

    def _write_ready_file(self) -> None:
        """Written whole, then renamed: a watcher never reads a half-written file."""
        assert self.ready_file is not None
        tmp = Path(f"{self.ready_file}.tmp")
        tmp.write_text(json.dumps({
                "pid": os.getpid(), "control": self.control_endpoint, "http": self.http.url,
                "pool_path": str(self.pool.path),
                "events": self.events.kv.bound_endpoint if self.events.kv else None,
                "events_replay": (self.events.kv.bound_replay_endpoint
                                  if self.events.kv else None),
                "lookup_events": (self.events.lookups.bound_endpoint
                                  if self.events.lookups else None),
                "hub": self.events.hub.bound_endpoint if self.events.hub else None,
                "hub_replay": (self.events.hub.bound_replay_endpoint
                               if self.events.hub else None),
                "engine_views": [{"rank": v.spec.rank, "events": v.pub.bound_endpoint,
                                  "replay": v.pub.bound_replay_endpoint}
                                 for v in self.events.views]}))
        tmp.replace(self.ready_file)
