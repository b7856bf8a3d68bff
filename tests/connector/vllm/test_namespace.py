"""The namespace covers what changes the KV bytes (or the keys) of equal tokens.

Engines are vLLM 0.33 WORKER-role ``KVOffloadConnector``s built from vLLM's own ``VllmConfig``,
``CacheConfig`` and ``KVTransferConfig``: vLLM builds the spec (and so the geometry) there from
the same configs as in the scheduler, and no daemon is needed. The model config is the
project's stub (vLLM's ``ModelConfig`` reads the model's files at construction) carrying
vLLM's own ``ModelConfig.compute_hash`` over the same fields.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.plugin_common import plugin_config  # noqa: E402
from tests.vllm_harness import (  # noqa: E402
    build_vllm_config,
    hybrid_kv_cache_config,
    vllm_import_error,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]


def _model(**fields: Any) -> Any:
    """The stub model config, with ``fields`` set, hashed by vLLM's ``ModelConfig.compute_hash``
    (a ``ModelConfig`` made without its constructor, which would inspect the model)."""
    from kvoffload.bench.vllm_baseline import StubModelConfig
    from vllm.config import ModelConfig

    class Model(StubModelConfig):
        def compute_hash(self) -> str:
            return real.compute_hash()

    model = Model(8192)
    real = ModelConfig.__new__(ModelConfig)
    for name, value in {"model": model.model, "dtype": model.dtype,
                        "max_model_len": model.max_model_len, **fields}.items():
        setattr(real, name, value)
        setattr(model, name, value)
    return model


def _namespace(model: Any = None, hash_algo: str = "sha256", connector: str = "ours",
               cache_dtype: str | None = None, **extra: Any) -> str:
    from kvoffload.connector.vllm import KVOffloadConnector, KVOffloadSpec
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    vc = build_vllm_config(plugin_config("ipc:///nowhere", **extra))
    vc.model_config = model or _model()
    vc.cache_config.prefix_caching_hash_algo = hash_algo  # type: ignore[assignment]
    if cache_dtype is not None:
        vc.cache_config.cache_dtype = cache_dtype
    cls = KVOffloadConnector if connector == "ours" else OffloadingConnector
    conn = cls(vc, KVConnectorRole.WORKER, hybrid_kv_cache_config())
    try:
        assert conn.connector_worker is not None
        spec = conn.connector_worker.spec
        assert isinstance(spec, KVOffloadSpec)
        return spec.geometry.namespace
    finally:
        conn.shutdown()


@pytest.fixture(autouse=True)
def _fixed_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # vLLM's default seed rule


def test_equal_engines_share_a_namespace() -> None:
    base = _namespace()
    assert _namespace() == base
    assert _namespace(_model(quantization="fp8")) == _namespace(_model(quantization="fp8"))
    assert base.startswith("kvoffload-bench-stub|float16|tp1pp1|")


@pytest.mark.parametrize("fields", [
    {"quantization": "fp8"},
    {"quantization_config": {"weight_block_size": [128, 128]}},
    {"revision": "0123abcd"},
    {"code_revision": "v2"},
    {"hf_overrides": {"rope_theta": 1e6}},  # compute_hash leaves hf_overrides out
    {"disable_sliding_window": True},  # only vLLM's model-config hash sees this one
], ids=lambda f: next(iter(f)))
def test_engines_differing_in_one_model_setting_do_not_share(fields: dict[str, Any]) -> None:
    assert _namespace(_model(**fields)) != _namespace(_model())


def test_the_prefix_hash_algorithm_and_seed_are_part_of_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    base = _namespace()
    assert _namespace(hash_algo="sha256_cbor") != base
    monkeypatch.setenv("PYTHONHASHSEED", "7")  # vLLM seeds NONE_HASH from it
    seven = _namespace()
    assert seven != base and _namespace() == seven
    monkeypatch.setenv("PYTHONHASHSEED", "8")
    assert _namespace() != seven
    # xxhash with PYTHONHASHSEED set: a seed every process agrees on, so shared.
    assert _namespace(hash_algo="xxhash") == _namespace(hash_algo="xxhash")


def test_xxhash_with_a_random_seed_is_never_shared(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM draws NONE_HASH's seed at random per process for xxhash without PYTHONHASHSEED:
    no other process computes the same keys, so each engine gets a namespace of its own."""
    with caplog.at_level(logging.INFO, logger="kvoffload.connector.vllm"):
        first = _namespace(hash_algo="xxhash")
    assert _namespace(hash_algo="xxhash") != first
    lines = [r.getMessage() for r in caplog.records if "random NONE_HASH seed" in r.getMessage()]
    assert len(lines) == 1 and "never shared" in lines[0]


def test_the_user_salt_still_separates() -> None:
    salted = _namespace(kvoffload_namespace="weights-2")
    assert salted != _namespace() and "|weights-2|" in salted


def test_the_stock_connector_cannot_see_the_model_config() -> None:
    """vLLM hands the spec no model config there: the namespace does not change with it
    (the start-up warning says so, test_start_checks.py)."""
    stock = _namespace(connector="stock")
    assert _namespace(_model(quantization="fp8"), connector="stock") == stock
    assert stock != _namespace()


@pytest.mark.parametrize("connector", ["ours", "stock"])
def test_engines_differing_only_in_kv_cache_dtype_do_not_share(connector: str) -> None:
    """The KV dtype changes every byte of a block: under either connector (the stock one sees
    no model config, only the offloading config's KV dtype)."""
    assert _namespace(cache_dtype="fp8", connector=connector) != _namespace(connector=connector)
