"""systemd's notify protocol (``Type=notify``), spoken directly: no libsystemd, no python-systemd.

The protocol is one datagram of ``KEY=VALUE`` lines sent to the AF_UNIX socket named by
``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace). We send:

- ``READY=1`` (with ``STATUS=`` and ``MAINPID=``) once the daemon serves: systemd holds back
  units ordered after us (and ``systemctl start`` returns) until then;
- ``STOPPING=1`` when shutdown begins, so ``systemctl status`` says "deactivating" while we drain;
- ``WATCHDOG=1`` every ``WATCHDOG_USEC / 4`` once ready, from a task on the daemon's own event
  loop: if the loop wedges, the pings stop and systemd restarts us (``WatchdogSec=``). A
  quarter, not sd_watchdog_enabled(3)'s half, so that the gap between two pings stays under a
  third of the timeout even when the loop is late by a few hundred ms; the receive loop works
  in bounded turns (daemon/ops/loop_health.py), so a busy daemon still pings.

Without ``NOTIFY_SOCKET`` (a shell, a container, the tests) every call is a cheap no-op.
Nothing here ever raises into the daemon: a lost notification must not take the service down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("kvoffload.daemon.ops.notify")

# A blocking send to a receiver that does not drain (it never happens with systemd itself)
# must not stall the event loop for long.
_SEND_TIMEOUT_S = 0.5


def _socket_address(raw: str) -> str | None:
    """NOTIFY_SOCKET -> an address for ``sendto``; None for anything we cannot use."""
    if raw.startswith("@"):
        # The abstract namespace: Linux spells it with a leading NUL byte.
        return "\0" + raw[1:] if len(raw) > 1 else None
    if raw.startswith("/"):
        return raw
    # systemd >= 254 also accepts vsock:CID:PORT (VMs); a node-local daemon never sees it.
    return None


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Seconds between WATCHDOG=1 pings, or None when systemd asked for no watchdog."""
    raw = env.get("WATCHDOG_USEC", "")
    if not raw:
        return None
    try:
        usec = int(raw)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", raw)
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    # WATCHDOG_PID names the process systemd expects pings from; a child that inherited the
    # environment (or a daemon started by a wrapper script) must stay quiet.
    if pid and pid != str(os.getpid()):
        return None
    # Half the timeout (sd_watchdog_enabled(3)) leaves no room for a late ping; a quarter
    # keeps every gap under a third of it.
    return usec / 4 / 1_000_000


class Notifier:
    """Sends sd_notify messages; every method is a no-op when ``address`` is None."""

    def __init__(self, address: str | None, watchdog_interval: float | None = None) -> None:
        self.address = address
        self.watchdog_interval = watchdog_interval if address else None
        self._sock: socket.socket | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        address = _socket_address(raw) if raw else None
        if raw and address is None:
            log.warning("ignoring NOTIFY_SOCKET=%r: not a path or an @abstract name", raw)
        return cls(address, _watchdog_interval(env) if address else None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_running(self) -> bool:
        return self._watchdog is not None and not self._watchdog.done()

    # -- sending ----------------------------------------------------------------------

    def send(self, *fields: str) -> bool:
        """Send one datagram of ``KEY=VALUE`` fields; True when it left, False otherwise."""
        if self.address is None:
            return False
        payload = "\n".join(fields).encode()
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.settimeout(_SEND_TIMEOUT_S)
                self._sock = sock
            self._sock.sendto(payload, self.address)
        except OSError as exc:
            # Warn once: a missing or full socket would otherwise log on every watchdog tick.
            if not self._warned:
                log.warning("systemd notification to %r failed: %s", self.address, exc)
                self._warned = True
            else:
                log.debug("systemd notification failed: %s", exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """READY=1 (+ STATUS, MAINPID); starts the watchdog when systemd asked for one.

        systemd arms the watchdog when start-up completes, i.e. at READY=1, so this is the
        moment to begin pinging. Call it from the daemon's event loop.
        """
        fields = ["READY=1", f"MAINPID={os.getpid()}"]
        if status:
            fields.append(f"STATUS={status}")
        sent = self.send(*fields)
        self.start_watchdog()
        return sent

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def stopping(self, status: str | None = "draining") -> bool:
        """STOPPING=1, and stop pinging: systemd stops watching once it knows we stop."""
        self.stop_watchdog()
        fields = ["STOPPING=1"]
        if status:
            fields.append(f"STATUS={status}")
        sent = self.send(*fields)
        self.close()  # nothing else is sent while we drain; a late send reopens it
        return sent

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    # -- watchdog ---------------------------------------------------------------------

    def start_watchdog(self) -> asyncio.Task[None] | None:
        """Ping WATCHDOG=1 every interval from the running loop; None without a watchdog."""
        if self.watchdog_interval is None or self.watchdog_running:
            return self._watchdog
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            log.warning("WATCHDOG_USEC is set but no event loop runs: not pinging")
            return None
        self._watchdog = loop.create_task(self._ping_forever(self.watchdog_interval),
                                          name="kvoffload-watchdog")
        return self._watchdog

    async def _ping_forever(self, interval: float) -> None:
        # Running on the daemon's loop is the point: a blocked loop means missed pings.
        # Due times are absolute, so lateness of one ping does not push back the next.
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            self.watchdog()
            due += interval
            now = loop.time()
            if due <= now:  # this ping was late by more than an interval: restart the grid
                due = now + interval
            await asyncio.sleep(due - now)

    def stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def close(self) -> None:
        self.stop_watchdog()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
