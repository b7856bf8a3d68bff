"""A test-only vLLM OffloadingSpec that captures the CanonicalKVCaches vLLM hands its worker.

vLLM's WORKER-role OffloadingConnector builds ``CanonicalKVCaches`` from the engine's KV tensors
in ``register_kv_caches`` and passes them to ``spec.get_worker``; loading this module as an
out-of-tree spec (``spec_module_path``) lets a test get exactly what our plugin will get.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    TransferResult,
)

CAPTURED: list[CanonicalKVCaches] = []


class _InertWorker(OffloadingWorker):
    """Accepts nothing: the copier tests drive our BlockCopier directly."""

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return False

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        return False

    def get_finished(self) -> list[TransferResult]:
        return []

    def wait(self, job_ids: set[int]) -> None:
        return None


class CaptureSpec(OffloadingSpec):
    def get_manager(self) -> OffloadingManager:
        raise RuntimeError("CaptureSpec is worker-side only")

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        CAPTURED.append(kv_caches)
        return _InertWorker()


def spec_extra_config() -> dict[str, Any]:
    return {"spec_name": CaptureSpec.__name__, "spec_module_path": __name__}
