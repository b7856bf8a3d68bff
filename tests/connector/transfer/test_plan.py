"""Copy plans (connector/transfer/plan.py): the pointer arrays one cuMemcpyBatchAsync gets are
computed from the job's block and slot arrays (``work_entries``); they must equal, entry for
entry, the reference built from one view pair per run (``batch_entries(ops(...))``)."""

from __future__ import annotations

import numpy as np
import pytest
from kvoffload.connector.transfer.engine import PoolMapping
from kvoffload.connector.transfer.plan import (
    batch_entries,
    ops,
    plan_work,
    segment_views,
    work_entries,
)

from tests.connector.transfer.test_paths import (
    LAYOUTS,
    SLOT,
    SLOTS,
    STORES,
    mapping,  # noqa: F401  (the fixture)
)

PATTERNS = {
    "shuffled, two groups": STORES,
    "one run": [(0, 10 + i, 4 + i) for i in range(6)],
    "runs and singles": [(0, 1, 3), (0, 2, 4), (0, 3, 5), (0, 20, 0), (1, 7, 9), (1, 8, 10)],
    "empty": [],
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("rank", [0, 1])
def test_work_entries_equal_the_per_view_reference(mapping: PoolMapping,  # noqa: F811
                                                   name: str, pattern: str, rank: int) -> None:
    layout = LAYOUTS[name](2)
    # Slots of two rank pages (TP 2): rank 1's page starts half a slot in.
    slots = SLOTS // 2
    pages = mapping.slot_view(2 * SLOT)[:, rank * SLOT : (rank + 1) * SLOT]
    items = [it for it in PATTERNS[pattern] if it[2] < slots]
    arr = np.asarray(items, dtype=np.int64).reshape(-1, 3)
    for store in (True, False):
        work = plan_work(segment_views(layout, pages), arr, by_slot=store)
        want = batch_entries(ops(work, store))
        got = work_entries(work, store)
        assert len(got[0]) == len(want[0]) and (len(items) == 0) == (len(got[0]) == 0)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == np.uint64 and a.tolist() == b.tolist()
