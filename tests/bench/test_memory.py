"""The memory suite's daemon RSS at 1M blocks is measured, never drawn through smaller fills.

Real daemon subprocesses, real fills through the control socket; no figure is asserted against
a bound (RSS depends on the interpreter and allocator), only where each figure comes from.
"""

from __future__ import annotations

import pytest
from kvoffload.bench.suites.memory import RSS_TARGET_BLOCKS, run_memory_bench


def test_daemon_fill_is_separate_from_the_index_sizes() -> None:
    # --quick relies on this: the index stops small while the daemon is filled further.
    r = run_memory_bench(True, sizes=(200,), rss_sizes=(200, 3_000))
    assert set(r["index_bytes_per_block"]) == {"200"}
    assert set(r["rss_anon_bytes"]) == {"0", "200", "3000"}
    assert r["ready_blocks"] == 3_000  # the daemon really holds the largest fill
    anon = r["rss_anon_bytes"]
    assert r["rss_bytes_per_block"] == round((anon["3000"] - anon["0"]) / 3_000, 1)
    assert r["rss_at_1m_bytes"] is None and r["meets"] is False


@pytest.mark.slow
def test_quick_mode_measures_the_daemon_at_one_million_blocks() -> None:
    r = run_memory_bench(True)
    assert max(r["sizes"]) == 100_000  # the tracemalloc index measurement stays quick
    assert r["ready_blocks"] == RSS_TARGET_BLOCKS
    assert r["rss_at_1m_bytes"] == r["rss_anon_bytes"][str(RSS_TARGET_BLOCKS)]
    assert r["rss_at_1m_note"].startswith("measured")
    assert (r["reason"] == "all sub-targets met") is r["meets"], r["reason"]
