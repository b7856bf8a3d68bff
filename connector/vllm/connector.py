"""``KVOffloadConnector``: vLLM's ``OffloadingConnector`` plus what our spec needs handed over.

Load it with ``kv_connector="KVOffloadConnector"``,
``kv_connector_module_path="kvoffload.connector.vllm"`` (docs/vllm.md); the
``kv_connector_extra_config`` is the same as for the stock connector. It only adds, through
vLLM's public connector API:

* the engine's ``KVCacheConfig`` (group kinds) and ``VllmConfig`` (the model identity in the
  namespace, ``geometry.model_identity``) for the spec, via ``handover.py``;
* every request the scheduler sees (``on_new_request``), so stores carry token ids and fine
  hashes (self-describing events), and the outcome of each request's lookup
  (``get_num_new_matched_tokens``) for the daemon's lookup events;
* failed loads: a request whose blocks the worker could not prove intact is returned in
  ``failed_recving``, and vLLM recomputes it. vLLM 0.33 refuses block-level load errors on
  hybrid models (several KV-cache groups), so failures are reported per request;
* whether the engine is attached to the daemon, and what it skipped while it was not, added to
  the stock connector's scheduler-side stats (``get_kv_connector_stats``): vLLM's own path to
  its API server's ``/metrics`` (``session_metrics.py``).

vLLM's ``kv_load_failure_policy`` defaults to ``"fail"`` (an error for the user) and vLLM's
Scheduler reads it right after this constructor returns (``Scheduler.__init__``:
``recompute_kv_load_failures``), so the constructor sets it to ``"recompute"``: here a failed
load only means the pool slot could not be proved intact, and recomputing is always correct.
vLLM keeps no record of which config fields were given, so an explicit ``"fail"`` cannot be
told from the default: it is overridden too (docs/vllm.md). Under ``MultiConnector`` the
scheduler reads the parent's config, which this constructor does not see: set it there.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvoffload.connector.vllm.handover import CURRENT, Handover
from kvoffload.connector.vllm.session_metrics import SessionMetrics
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

log = logging.getLogger("kvoffload.connector.vllm")


class KVOffloadConnector(OffloadingConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        box = Handover(kv_cache_config, vllm_config)
        token = CURRENT.set(box)
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            CURRENT.reset(token)
        self._handover = box
        self._metrics = SessionMetrics()
        kvt = vllm_config.kv_transfer_config  # vLLM's base constructor checked it is set
        if kvt.kv_load_failure_policy != "recompute":
            if role == KVConnectorRole.SCHEDULER:  # the one reader; one line per engine
                log.info("kvoffload: kv_load_failure_policy %r -> 'recompute': a load whose "
                         "pool slots were reused is recomputed, not failed",
                         kvt.kv_load_failure_policy)
            kvt.kv_load_failure_policy = "recompute"

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        if self._handover.manager is not None:
            self._handover.manager.track(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        start = time.perf_counter()
        hit, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        manager = self._handover.manager
        if manager is not None:  # turned into a LookupReport at the step's end, not here
            manager.report_lookup((request.request_id, request.num_tokens,
                                   request.num_prompt_tokens, num_computed_tokens, hit,
                                   time.perf_counter() - start))
            if not manager.session.attached:  # the lookup had no index: it missed
                self._metrics.lookups_offline += 1
        return hit, is_async

    def get_kv_connector_stats(self) -> Any:
        """The stock connector's stats plus ours (scheduler role: vLLM's Scheduler calls this
        every step; the worker role has no manager and adds nothing)."""
        stats = super().get_kv_connector_stats()
        manager = self._handover.manager
        ours = self._metrics.collect(manager) if manager is not None else None
        if ours is None:
            return stats
        return ours if stats is None else stats.aggregate(ours)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        worker = self._handover.worker
        if worker is not None:
            failed = worker.take_failed_requests()
            if failed:
                log.warning("kvoffload: %d requests' loads did not get their blocks; vLLM "
                            "handles them as failed loads", len(failed))
                results.failed_recving |= failed
                results.finished_recving |= failed
        return results
