"""HTTP endpoints through aiohttp: /healthz (alive), /readyz (serving), /metrics (Prometheus)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class HttpServer:
    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 readiness: Callable[[], Mapping[str, object]],
                 details: Callable[[], Mapping[str, object]] | None = None) -> None:
        self.host, self.port = host, port
        self._registry = registry
        self._readiness = readiness
        self._details = details  # extra /readyz fields (the bound endpoints), not checks
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def _readyz(self, request: web.Request) -> web.Response:
        checks = self._readiness()
        ok = all(checks.values())
        extra = dict(self._details()) if self._details is not None else {}
        return web.json_response({"ready": ok, "checks": checks, **extra},
                                 status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
