"""A block on the daemon's disk tier, asked for by vLLM's scheduler over our plugin: the key
answers RETRY and the step's message asks the tier (no round trip is waited for); the
promotion shows in the shared index as PENDING, then READY; vLLM asks again on its next step and
loads the right bytes. A key no tier held when first asked is asked again once this engine
has stored it (``Finds.stored``), however recent that "not found" was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.daemon_helpers import run_daemon  # noqa: E402
from tests.plugin_common import plugin_config  # noqa: E402
from tests.vllm_harness import vllm_import_error  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_import_error() is not None, reason=str(vllm_import_error())),
]


@pytest.mark.parametrize("ttl", [64, 1_000_000], ids=["default-ttl", "not-found-forgotten-on-store"])
def test_disk_tier_blocks_come_back_through_finds_and_load_correct_bytes(
        tmp_path: Path, ttl: int) -> None:
    from kvoffload.bench.vllm_engine import BLOCK, ROW, MiniEngine, token_row

    disk = tmp_path / "disk"
    disk.mkdir()
    with run_daemon(tmp_path, "--disk-dir", str(disk), "--disk-bytes", str(4 << 20),
                    pool_bytes=32 * 4096, slot_bytes=4096) as d:
        e = MiniEngine(plugin_config(d.control, kvoffload_copy_async=False,
                                     kvoffload_store_reserve=4,
                                     # 1,000,000: the first "not found" never expires by age
                                     kvoffload_find_ttl_steps=ttl),
                       connector="KVOffloadConnector", connector_module="kvoffload.connector.vllm")
        manager = e.connector.scheduler.manager
        assert manager._tiers  # the daemon said it has a lower tier
        prompt = list(range(900, 930))

        def serve(tokens: list[int], req_id: str) -> int:
            e.add(tokens, req_id, max_tokens=2)
            e.run()
            return e.prefill_tokens[req_id]

        answers: list[Any] = []
        original = e.connector.get_num_new_matched_tokens

        def recording(request: Any, local: int) -> Any:
            result = original(request, local)
            answers.append(result[0])
            return result

        e.connector.get_num_new_matched_tokens = recording
        assert serve(prompt, "first") == 30
        assert answers[0] is None  # the tier was asked (and held nothing): "not found" noted
        for i in range(24):  # other prompts push the first one out of the 32-slot pool
            assert serve(list(range(5000 + 40 * i, 5030 + 40 * i)), f"filler{i}") == 30
        assert e.scheduler.reset_prefix_cache()
        e.scribble()
        seen: dict[str, Any] = {}

        def check(req_id: str) -> None:
            upto = e.scheduler.requests[req_id].num_computed_tokens  # what the load restored
            attn, _ = e.block_table(req_id)
            seen["loaded"] = upto
            seen["ok"] = all(
                bytes(e.pages["attn.0"][attn[t // BLOCK], ROW * (t % BLOCK):
                                        ROW * (t % BLOCK + 1)].numpy())
                == bytes(token_row(prompt, t).numpy()) for t in range(upto))

        e.on_loaded = check
        trips = manager.session.client.round_trips
        answers.clear()
        got = serve(prompt, "again")
        # The complete chunk came back from disk (tails go to disk only when their read pays).
        assert got == 30 - seen["loaded"] and seen["loaded"] >= 16
        assert seen["ok"]
        assert answers[0] is None and answers[-1] == seen["loaded"]  # asked again, step by step
        assert manager.session.client.round_trips == trips  # nothing waited for
        e.shutdown()
