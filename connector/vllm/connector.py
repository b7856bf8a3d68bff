"""What the manager needs from around it: its daemon connection, vLLM's per-request state,
daemon futures, and the optional ``KVOffloadConnector`` that hands vLLM's state over without
looking at vLLM's frames.

* ``DaemonLink`` owns the scheduler's ``DaemonClient``: registration (retried while a fresh
  socket connects), an offline window of ``retry_ms`` after a failure in which no call is made,
  and the daemon's generation (``daemon_id``): a restarted daemon holds none of our pins.
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
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from kvoffload.connector.client import AsyncDaemonClient, DaemonClient, DaemonUnavailable
from kvoffload.connector.vllm.worker import PoolInfo
from kvoffload.daemon import protocol as p
from kvoffload.daemon.security import CurveClientKeys
from kvoffload.daemon.types import Geometry
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # type: ignore[import-untyped]
    OffloadingConnector,
)

log = logging.getLogger("kvoffload.connector.vllm")

_CONNECT_GRACE_MS = 100


@dataclass
class RequestInfo:
    """What the manager needs to know about a request, read from vLLM's scheduler state."""

    block_hashes: list[bytes]
    num_tokens: int
    num_prompt_tokens: int
    local_tokens: int  # tokens the GPU prefix cache holds (vLLM's num_computed_tokens)
    token_ids: Callable[[int, int], list[int]] | None = None
    lora_name: str | None = None

    def store_item(self, key: bytes, end: int, block: int, tokens_per_hash: int) -> p.StoreItem:
        """A key whose state ends at token ``end``, described for self-describing events: a
        complete chunk covers its block, a partial tail the tokens since the block edge."""
        tail = end % block != 0
        start = (end // block) * block if tail else end - block
        first = start // tokens_per_hash
        return p.StoreItem(
            key=key, end_token=end, tail=tail,
            token_ids=self.token_ids(start, end) if self.token_ids else None,
            block_hashes=self.block_hashes[first:end // tokens_per_hash],
            parent_hash=self.block_hashes[first - 1] if start else None,
            lora_name=self.lora_name)


class RequestSource(Protocol):
    def get(self, req_id: str) -> RequestInfo | None: ...

    def waiting(self) -> Iterable[tuple[str, RequestInfo]]: ...


class RequestWaiter(Protocol):
    """Parks a deferred query on the daemon's futures (``Lookup`` with ``wait_ms``)."""

    def park(self, query: p.LookupQuery) -> Future[Any]: ...

    def close(self) -> None: ...


class DaemonLink:
    def __init__(self, client: DaemonClient, geometry: Geometry, timeout_ms: int,
                 retry_ms: int) -> None:
        self.client = client
        self.geometry = geometry
        self.timeout_ms = timeout_ms
        self.retry_ms = retry_ms
        self.pool: PoolInfo | None = None
        self.on_lost: Callable[[], None] = lambda: None
        self.counters: dict[str, int] = {"offline_events": 0, "protocol_errors": 0}
        self._offline_until = 0.0
        self._last_call = 0.0

    @property
    def offline(self) -> bool:
        return time.monotonic() < self._offline_until

    def online(self) -> bool:
        """Registered and reachable; (re)registers once the offline window has passed."""
        if self.offline:
            return False
        if self.pool is not None:
            return True
        # A fresh socket connects asynchronously and refuses sends until it has (well under a
        # millisecond over ipc): retry briefly; a daemon that is gone refuses just the same.
        deadline = time.monotonic() + min(self.timeout_ms, _CONNECT_GRACE_MS) / 1000
        while True:
            try:
                self.client.connect()  # a fresh Welcome: the daemon_id workers key pools on
                reg = self.client.register(self.geometry)
                break
            except p.ProtocolError as exc:
                self._lost(exc)
                return False
            except DaemonUnavailable as exc:
                if time.monotonic() >= deadline:
                    self._lost(exc)
                    return False
                time.sleep(0.01)
        self._adopt(reg)
        return True

    def _adopt(self, reg: p.Registered) -> None:
        welcome = self.client.welcome
        daemon_id = welcome.daemon_id if welcome else ""
        if self.pool is not None and self.pool.daemon_id != daemon_id:
            self.on_lost()
        pool_bytes = welcome.pool_bytes if welcome else reg.slot_bytes * reg.num_slots
        self.pool = PoolInfo(daemon_id, reg.pool_path, pool_bytes, reg.slot_bytes, reg.rank_bytes)
        self._last_call = time.monotonic()

    def _lost(self, exc: Exception) -> None:
        if not self.offline:
            log.warning("kvoffload daemon unavailable (%s); lookups miss for %d ms",
                        exc, self.retry_ms)
        self.counters["offline_events"] += 1
        self._offline_until = time.monotonic() + self.retry_ms / 1000
        # A restarted daemon knows none of our pins or grants; a slow one drops them when our
        # lease expires. Either way they are not ours to release any more.
        self.pool = None
        self.on_lost()

    def call(self, fn: Callable[[], Any]) -> Any:
        """One client call; None when it failed (a daemon gone makes the link offline)."""
        if self.offline or self.pool is None:
            return None
        try:
            result = fn()
        except DaemonUnavailable as exc:
            self._lost(exc)
            return None
        except p.ProtocolError as exc:
            self.counters["protocol_errors"] += 1
            log.error("kvoffload daemon refused a call: %s", exc)
            return None
        self._last_call = time.monotonic()
        reg, welcome = self.client.registered, self.client.welcome
        if reg is not None and welcome is not None and welcome.daemon_id != self.pool.daemon_id:
            self._adopt(reg)  # the client re-registered with a restarted daemon
        return result

    def keep_alive(self) -> None:
        """Heartbeat when a third of the lease passed without a call (pins die with it)."""
        lease_ms = self.client.welcome.lease_ms if self.client.welcome else 10_000
        if time.monotonic() - self._last_call > lease_ms / 3000:
            self.call(self.client.heartbeat)

    def close(self) -> None:
        self.client.close()


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

    def __init__(self, endpoint: str, geometry: Geometry, wait_ms: int, timeout_ms: int,
                 curve: CurveClientKeys | None = None) -> None:
        self.endpoint = endpoint
        self.curve = curve
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
                                             name="vllm scheduler waiter", curve=self.curve)
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
        from kvoffload.connector.vllm.manager import DaemonOffloadingManager
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
