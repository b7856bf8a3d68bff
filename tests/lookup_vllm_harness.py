"""An out-of-tree offloading spec whose manager answers lookups from a dict.

Loaded by vLLM's ``OffloadingSpecFactory`` through ``spec_module_path``, so vLLM's own
scheduler code asks it, key by key, exactly as it would ask our plugin. Tests fill
``manager.statuses`` and read back every ``lookup`` and ``prepare_load`` call.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from kvoffload.daemon.base import KeyStatus
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

TO_LOOKUP_RESULT: Mapping[KeyStatus, LookupResult] = {
    KeyStatus.MISS: LookupResult.MISS,
    KeyStatus.HIT: LookupResult.HIT,
    KeyStatus.HIT_PENDING: LookupResult.HIT_PENDING,
    KeyStatus.RETRY: LookupResult.RETRY,
}


class NoopLoadStoreSpec(LoadStoreSpec):
    """Nothing is ever copied: these tests stop at the scheduler."""


class DictOffloadingManager(OffloadingManager):
    def __init__(self) -> None:
        self.statuses: dict[bytes, LookupResult] = {}
        self.lookups: list[bytes] = []
        self.loads: list[list[bytes]] = []

    def set_statuses(self, statuses: Mapping[bytes, KeyStatus]) -> None:
        self.statuses = {key: TO_LOOKUP_RESULT[status] for key, status in statuses.items()}

    def reset_calls(self) -> None:
        self.lookups.clear()
        self.loads.clear()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self.lookups.append(key)
        return self.statuses.get(key, LookupResult.MISS)

    def prepare_load(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        self.loads.append(list(keys))
        return NoopLoadStoreSpec()

    def prepare_store(
        self, keys: Iterable[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        return None  # never store: nothing leaves the scheduler in these tests

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        pass

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()


class DictOffloadingSpec(OffloadingSpec):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.manager = DictOffloadingManager()

    def get_manager(self) -> OffloadingManager:
        return self.manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        raise NotImplementedError("scheduler-side test spec: no worker")
