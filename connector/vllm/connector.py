"""What the manager needs from around it: vLLM's per-request state, daemon futures, and the
optional ``KVOffloadConnector`` that hands both over without looking at vLLM's frames.

* ``SchedulerRequests`` reads ``OffloadingConnectorScheduler._req_status`` (vLLM 0.33): the
  request's block hashes, token ids, LoRA name and the tokens the GPU prefix cache already
  holds. vLLM fills ``num_locally_computed_tokens`` right before it asks the manager, so the
  manager's one batched ``Lookup`` uses exactly vLLM's numbers.
* ``DaemonWaiter`` parks deferred lookups on the daemon's futures (``Lookup`` with ``wait_ms``)
  from a background asyncio thread with its own socket, so the scheduler thread never waits and
  never polls.
* ``KVOffloadConnector`` is ``OffloadingConnector`` plus two explicit hand-overs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from kvoffload.connector.client import AsyncDaemonClient, DaemonUnavailable
from kvoffload.connector.vllm.manager import DaemonOffloadingManager, RequestInfo
from kvoffload.daemon import protocol as p
from kvoffload.daemon.types import Geometry
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # type: ignore[import-untyped]
    OffloadingConnector,
)

log = logging.getLogger("kvoffload.connector.vllm")


class SchedulerRequests:
    """``RequestSource`` over vLLM 0.33's ``OffloadingConnectorScheduler._req_status``."""

    def __init__(self, scheduler: Any, prefetch_max: int = 16) -> None:
        self._scheduler = scheduler
        self._prefetch_max = prefetch_max

    @staticmethod
    def _info(state: Any) -> RequestInfo:
        req = state.req
        lora = getattr(req, "lora_request", None)
        return RequestInfo(
            block_hashes=req.block_hashes, num_tokens=req.num_tokens,
            num_prompt_tokens=req.num_prompt_tokens,
            local_tokens=state.num_locally_computed_tokens,
            token_ids=lambda a, b: list(req.all_token_ids[a:b]),
            lora_name=lora.lora_name if lora is not None else None)

    def get(self, req_id: str) -> RequestInfo | None:
        state = self._scheduler._req_status.get(req_id)
        return None if state is None else self._info(state)

    def waiting(self) -> Iterable[tuple[str, RequestInfo]]:
        """Requests vLLM may look up this step: waiting, not loading, reading the cache."""
        from vllm.v1.request import RequestStatus  # type: ignore[import-untyped]

        n = 0
        for req_id, state in list(self._scheduler._req_status.items()):
            if n >= self._prefetch_max:
                return
            req = state.req
            if (req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                    and not state.transfer_jobs and not req.skip_reading_prefix_cache):
                n += 1
                yield req_id, self._info(state)


class DaemonWaiter:
    """Sends ``Lookup(wait_ms, pin=False)`` for deferred queries; each resolves a Future."""

    def __init__(self, endpoint: str, geometry: Geometry, wait_ms: int, timeout_ms: int) -> None:
        self.endpoint = endpoint
        self.geometry = geometry
        self.wait_ms = wait_ms
        self.timeout_ms = timeout_ms
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="kvoffload-waiter")
        self._thread.start()
        self._client: AsyncDaemonClient | None = None
        self._engine: int | None = None

    async def _ensure(self) -> tuple[AsyncDaemonClient, int]:
        if self._client is None:
            self._client = AsyncDaemonClient(self.endpoint, timeout_ms=self.timeout_ms,
                                             name="vllm scheduler waiter")
        if self._engine is None:
            # A fresh socket refuses sends until connected: retry within one timeout.
            deadline = self._loop.time() + self.timeout_ms / 1000
            while True:
                try:
                    await self._client.connect()
                    self._engine = (await self._client.register(self.geometry)).engine
                    break
                except DaemonUnavailable:
                    if self._loop.time() >= deadline:
                        raise
                    await asyncio.sleep(0.01)
        return self._client, self._engine

    async def _wait(self, query: p.LookupQuery) -> p.LookupAnswer:
        try:
            client, engine = await self._ensure()
            msg = p.Lookup(rid=client.rid(), engine=engine, queries=[query],
                           wait_ms=self.wait_ms, pin=False)
            reply = await client.expect(msg, p.LookupReply, self.wait_ms + self.timeout_ms)
            return reply.answers[0]
        except (DaemonUnavailable, p.ProtocolError):
            # Start from scratch next time: the daemon may have restarted.
            if self._client is not None:
                await self._client.close()
            self._client, self._engine = None, None
            raise

    def park(self, query: p.LookupQuery) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(self._wait(query), self._loop)

    def close(self) -> None:
        async def stop() -> None:
            if self._client is not None:
                await self._client.close()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


class KVOffloadConnector(OffloadingConnector):  # type: ignore[misc]
    """``OffloadingConnector`` that hands our spec its ``KVCacheConfig`` and scheduler state
    explicitly (``kv_connector="KVOffloadConnector"``,
    ``kv_connector_module_path="kvoffload.connector.vllm"``)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        from kvoffload.connector.vllm.spec import KV_CACHE_CONFIG

        token = KV_CACHE_CONFIG.set(kv_cache_config)
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            KV_CACHE_CONFIG.reset(token)
        manager = getattr(self.connector_scheduler, "manager", None)
        if isinstance(manager, DaemonOffloadingManager):
            manager.requests = SchedulerRequests(self.connector_scheduler,
                                                 manager.settings.prefetch_max)
