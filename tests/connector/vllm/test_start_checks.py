"""What the plugin refuses or changes at engine start, through vLLM 0.33's own config objects
and connectors: sync loads, unknown keys, the load-failure policy, the stock-connector warning.

Most checks build the WORKER-role connector: vLLM builds the spec there from the same configs
as in the scheduler, and no daemon is needed (only the scheduler's manager attaches to one).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_helpers import DaemonHandle, run_daemon  # noqa: E402
from tests.plugin_common import plugin_config  # noqa: E402
from tests.vllm_harness import (  # noqa: E402
    build_scheduler_connector,
    build_vllm_config,
    hybrid_kv_cache_config,
    vllm_import_error,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]

ROOT = Path(__file__).resolve().parents[3]
NOWHERE = "ipc:///nowhere"  # never reached: the worker role does not attach
LOGGER = "kvoffload.connector.vllm"


def _connector_class(name: str) -> Any:
    from kvoffload.connector.vllm import KVOffloadConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    return {"KVOffloadConnector": KVOffloadConnector,
            "OffloadingConnector": OffloadingConnector}[name]


def _worker_connector(extra: dict[str, Any], name: str = "KVOffloadConnector",
                      vc: Any = None) -> Any:
    """vLLM's WORKER-role connector over our spec, from vLLM's real configs."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    vc = vc or build_vllm_config(plugin_config(NOWHERE, **extra))
    return _connector_class(name)(vc, KVConnectorRole.WORKER, hybrid_kv_cache_config())


# --------------------------------------------------------------------------- sync loads


CONNECTORS = ["KVOffloadConnector", "OffloadingConnector"]


@pytest.mark.parametrize("name", CONNECTORS)
def test_a_sync_load_budget_is_refused_at_start(name: str) -> None:
    from kvoffload.connector.vllm.settings import SettingError

    # The scheduler role: the spec refuses before its manager would attach to a daemon.
    with pytest.raises(SettingError, match=r"sync_load_budget_bytes'\]=1048576 is refused") as e:
        build_scheduler_connector(plugin_config(NOWHERE, sync_load_budget_bytes=1 << 20),
                                  connector_class=_connector_class(name))
    assert "\n" not in str(e.value)  # one line
    # vLLM's "disabled" values start (it takes int() of the setting).
    for off in (0, "0"):
        _worker_connector({"sync_load_budget_bytes": off}, name).shutdown()


# --------------------------------------------------------------------------- unknown keys


def test_a_misspelled_key_is_refused_naming_the_closest() -> None:
    from kvoffload.connector.vllm.settings import SettingError

    for typo, meant in (("kvoffload_timout_ms", "kvoffload_timeout_ms"),
                        ("kvoffload_namepsace", "kvoffload_namespace"),
                        ("kvoffload_pool", "kvoffload_pool_path")):
        with pytest.raises(SettingError, match=f"{typo}.*did you mean '{meant}'"):
            _worker_connector({typo: 1})


def test_retired_keys_are_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _worker_connector({"kvoffload_lookup_wait_ms": 5000}).shutdown()
    assert any("kvoffload_lookup_wait_ms" in r.getMessage() and "no longer read" in
               r.getMessage() for r in caplog.records)


def test_every_key_the_plugin_reads_is_known_and_documented() -> None:
    """No valid key is refused: every ``kvoffload_*`` key read from the extra config in the
    plugin's sources is in KNOWN_KEYS, and the docs' key table lists exactly KNOWN_KEYS."""
    from kvoffload.connector.vllm.settings import KNOWN_KEYS

    sources = [*sorted((ROOT / "connector").rglob("*.py")), ROOT / "daemon/control/security.py"]
    read = set()
    for path in sources:
        text = path.read_text()
        # extra.get("kvoffload_x" ...), settings.get(...), _setting(extra, "kvoffload_x", ...)
        read |= set(re.findall(r"\.get\(\s*\"(kvoffload_\w+)\"", text))
        read |= set(re.findall(r"_setting\(\s*\w+(?:\.\w+)*,\s*\"(kvoffload_\w+)\"", text))
    assert read and read <= KNOWN_KEYS, read - KNOWN_KEYS
    table = (ROOT / "docs/vllm.md").read_text().split("## `kv_connector_extra_config` keys")[1]
    table = table.split("\n## ")[0]
    documented = {key for row in table.splitlines() if row.startswith("| `kvoffload_")
                  for key in re.findall(r"`(kvoffload_\w+)`", row.split("|")[1])}
    assert documented == KNOWN_KEYS


# --------------------------------------------------------------------------- load failures


def test_kvoffload_connector_makes_load_failures_recompute(
        caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's default "fail" becomes "recompute" before vLLM's Scheduler reads it (it reads
    the policy right after building the connector); one info line, in the scheduler role."""
    from kvoffload.connector.vllm import KVOffloadConnector
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    def policy(vc: Any) -> str:
        assert vc.kv_transfer_config is not None
        return str(vc.kv_transfer_config.kv_load_failure_policy)

    vc = build_vllm_config(plugin_config(NOWHERE))
    _worker_connector({}, vc=vc).shutdown()
    assert policy(vc) == "recompute"
    # The scheduler role (no daemon at NOWHERE: the manager goes offline after its timeout).
    vc = build_vllm_config(plugin_config(NOWHERE, kvoffload_timeout_ms=50))
    assert policy(vc) == "fail"  # vLLM's default
    with caplog.at_level(logging.INFO, logger=LOGGER):
        KVOffloadConnector(vc, KVConnectorRole.SCHEDULER, hybrid_kv_cache_config()).shutdown()
    lines = [r.getMessage() for r in caplog.records if "kv_load_failure_policy" in
             r.getMessage()]
    assert len(lines) == 1 and "'fail' -> 'recompute'" in lines[0]
    assert policy(vc) == "recompute"


def test_the_stock_connector_warns_once_recommending_ours(
        caplog: pytest.LogCaptureFixture) -> None:
    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and
                "stock OffloadingConnector" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _worker_connector({}).shutdown()
        assert warnings() == []
        vc = build_vllm_config(plugin_config(NOWHERE))
        _worker_connector({}, "OffloadingConnector", vc).shutdown()
    (line,) = warnings()
    assert "kv_connector=KVOffloadConnector" in line and "asserts" in line
    # vLLM's stock connector leaves the policy alone (the failed job stops the engine).
    assert vc.kv_transfer_config is not None
    assert vc.kv_transfer_config.kv_load_failure_policy == "fail"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonHandle]:
    with run_daemon(tmp_path, pool_bytes=24 * 4096, slot_bytes=4096) as d:
        yield d


def test_a_failed_load_with_default_config_is_recomputed(daemon: DaemonHandle) -> None:
    """vLLM's real Scheduler and worker-role connector, vLLM's default kv_load_failure_policy:
    the daemon is replaced between vLLM's lookup and the copy, the worker cannot prove the
    slots, and the request is recomputed in full instead of ending in an error."""
    from tests.plugin_engine import MiniEngine

    prompt = list(range(300, 330))
    e = MiniEngine(plugin_config(daemon.control, kvoffload_copy_async=False,
                                 kvoffload_liveness_ms=60_000),
                   connector="KVOffloadConnector", connector_module="kvoffload.connector.vllm")
    e.add(prompt, "first", max_tokens=2)
    e.run()
    assert e.scheduler.reset_prefix_cache()
    e.scribble()
    original_load = e.worker.start_load_kv
    replaced = {"done": False}

    def start_load_kv(ctx: Any) -> None:  # after vLLM scheduled the load, before the copy
        if e.worker._connector_metadata.load_jobs and not replaced["done"]:
            replaced["done"] = True
            daemon.kill()
            daemon.start()
        original_load(ctx)

    e.worker.start_load_kv = start_load_kv
    e.add(prompt, "second", max_tokens=2)
    e.run()
    assert replaced["done"] and "second" in e.failed_loads
    # Recomputed in full; under "fail" vLLM would have ended it with an error, computing nothing.
    assert e.prefill_tokens.get("second") == 30
    assert e.scheduler.recompute_kv_load_failures  # what vLLM's Scheduler read at its start
    e.shutdown()
