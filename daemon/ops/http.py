"""HTTP endpoints: /healthz (alive), /readyz (serving), /metrics (Prometheus).

A deliberately small HTTP/1.1 server on asyncio streams, because the endpoints are reachable
by every local user and must never cost the daemon its descriptors or its loop:

- the request head must arrive whole within ``header_timeout`` seconds (a half-sent request
  is closed, counted ``kvoffload_refused_total{reason="http_timeout"}``); bodies are not
  accepted at all (``Content-Length`` > 0 or chunked: 413), so there is no body to wait for;
- at most ``max_connections`` connections are open; one more closes the oldest (the one that
  has waited longest for its head, most likely a stalled one) so a prober still gets in,
  counted ``http_connections``. The bound is also kept under an eighth of the process's
  descriptor limit: libzmq aborts the process when it cannot get a descriptor;
- every answer is ``Connection: close``: no idle keep-alive connection holds a descriptor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

from kvoffload.daemon.ops.metrics import DaemonMetrics
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

MAX_HEAD_BYTES = 8192  # request line + headers; more is refused (431)
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            413: "Content Too Large", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}


class NotReady(str):
    """A readiness check that fails, with its reason: /readyz shows the check as ``false``
    and the reason under ``reasons``. (A plain string is a detail, never a failure.)"""


def descriptor_budget(share: int = 8) -> int:
    """A 1/``share`` part of the soft RLIMIT_NOFILE (at least 4)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(4, soft // share)


class HttpServer:
    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 readiness: Callable[[], Mapping[str, object]],
                 details: Callable[[], Mapping[str, object]] | None = None, *,
                 metrics: DaemonMetrics | None = None, max_connections: int = 64,
                 header_timeout: float = 5.0, write_timeout: float = 10.0) -> None:
        self.host, self.port = host, port
        self._registry = registry
        self._readiness = readiness
        self._details = details  # extra /readyz fields (the bound endpoints), not checks
        self._metrics = metrics
        self.max_connections = max(1, min(max_connections, descriptor_budget()))
        self.header_timeout = header_timeout
        self.write_timeout = write_timeout
        self._server: asyncio.Server | None = None
        # Open connections, oldest first: the one to close when a new one needs room.
        self._conns: OrderedDict[asyncio.Task[None], float] = OrderedDict()
        self.url = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port,
                                                  limit=MAX_HEAD_BYTES, reuse_address=True,
                                                  backlog=128)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._conns):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    @property
    def connections(self) -> int:
        return len(self._conns)

    def _refused(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.refused.labels(reason).inc()

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.http_connections.set(len(self._conns))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        while len(self._conns) >= self.max_connections:
            oldest, _ = self._conns.popitem(last=False)
            oldest.cancel()  # its finally closes its socket
            self._refused("http_connections")
        self._conns[task] = time.monotonic()
        self._gauge()
        try:
            status, ctype, body = await self._answer(reader)
            head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
                    f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n").encode()
            writer.write(head + body)
            await asyncio.wait_for(writer.drain(), self.write_timeout)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass  # the peer went away or does not read: nothing more to do for it
        finally:
            self._conns.pop(task, None)
            self._gauge()
            writer.transport.abort()  # no lingering close handshake holding the descriptor

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, str, bytes]:
        try:
            raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.header_timeout)
        except TimeoutError:
            self._refused("http_timeout")
            raise
        except asyncio.LimitOverrunError:
            self._refused("http_bad_request")
            return 431, "text/plain", b"request head too large\n"
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._refused("http_bad_request")
            return 400, "text/plain", b"bad request line\n"
        method, target = parts[0], parts[1]
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers:
            self._refused("http_bad_request")
            return 413, "text/plain", b"no request bodies here\n"
        if method != "GET":
            return 405, "text/plain", b"GET only\n"
        path = target.split("?", 1)[0]
        if path == "/healthz":
            return 200, "application/json", b'{"status": "alive"}'
        if path == "/readyz":
            checks = dict(self._readiness())
            reasons = {k: str(v) for k, v in checks.items() if isinstance(v, NotReady)}
            checks.update(dict.fromkeys(reasons, False))
            ok = all(checks.values())
            extra = dict(self._details()) if self._details is not None else {}
            if reasons:
                extra["reasons"] = reasons
            return (200 if ok else 503, "application/json",
                    json.dumps({"ready": ok, "checks": checks, **extra}).encode())
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
        return 404, "text/plain", b"not found\n"
