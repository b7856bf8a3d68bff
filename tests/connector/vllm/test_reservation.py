"""The store reservation's sizing, alone (no daemon, no vLLM): it follows the steps' demand,
hands back what a quiet engine no longer needs, says when a deferred store would find its
slots next step, and which slots a store takes (never one the daemon withdrew)."""

from __future__ import annotations

from kvoffload.connector.vllm.reservation import (
    DEFAULT_FLOOR,
    HEADROOM,
    WINDOW,
    Reservation,
    auto_floor,
)


def _grant(res: Reservation, rid: int, n: int, start: int = 0) -> None:
    res.sent(rid, n)
    res.answered(rid, [(start + i, 1) for i in range(n)], no_space=False)


def test_the_refill_follows_the_demand_of_recent_steps() -> None:
    res = Reservation(floor=64)
    want = res.end_step()
    assert want == 64 and res.needs_refill(want)
    _grant(res, 1, 64)
    res.demand = 512  # a long prefill step offered 512 keys
    assert res.covers(512)  # deferring them is safe: the refill this step asks for covers it
    want = res.end_step()
    assert want == HEADROOM * 512 - 64
    res.sent(2, want)
    assert res.end_step() == 0  # asked already, the reply still out: nothing more
    res.answered(2, [(100 + i, 1) for i in range(want)], no_space=False)
    assert len(res) == HEADROOM * 512 and res.asked == 0 and not res.short


def test_a_quiet_engine_hands_slots_back_after_the_window() -> None:
    res = Reservation(floor=8)
    res.demand = 100
    _grant(res, 1, res.end_step())
    assert len(res) == 200
    for _ in range(WINDOW - 1):
        assert res.end_step() == 0 and res.surplus() == []
    assert res.end_step() == 0  # the burst left the window: 200 held, 8 wanted
    back = res.surplus()
    assert len(back) == 192 and len(res) == 8


def test_a_short_answer_bounds_what_a_deferral_may_count_on() -> None:
    res = Reservation(floor=4)
    res.demand = 300
    want = res.end_step()
    res.sent(7, want)
    res.answered(7, [(i, 1) for i in range(100)], no_space=False)  # capped by the daemon
    assert res.short and res.ceiling == 100
    assert res.covers(100) and not res.covers(101)
    assert not res.needs_refill(res.end_step())  # asked again with the next claims only
    res.sent(8, 10)
    res.answered(8, [], no_space=True)
    assert not res.covers(1)  # nothing is coming: store what fits instead
    res.clear()
    assert len(res) == 0 and res.asked == 0 and res.covers(4)


def test_the_default_floor_is_a_share_of_the_pool_and_covers_one_off_offers() -> None:
    """Issue 24: a floor of 64 slots in a 167-slot pool held 20 empty (the daemon's cap) and
    served fewer tokens than vLLM's manager in the same memory."""
    assert auto_floor(1 << 20, 1) == DEFAULT_FLOOR  # a real pool: the 64 of before
    assert auto_floor(64 * 40, 1) == 40
    assert auto_floor(167, 1) == HEADROOM  # a step's one-off offers still fit
    assert auto_floor(167, 4) == HEADROOM * 4  # a key per group: a hybrid model's block
    res = Reservation(None, groups=4)
    assert res.first(167) == 8 and res.floor == 8 and res.end_step() == 8
    assert res.first(1 << 20) == DEFAULT_FLOOR  # re-attached to a larger pool: follows it
    fixed = Reservation(floor=5, groups=4)
    assert fixed.first(1 << 20) == 5 and fixed.first(16) == 5  # the operator's, as set


def test_a_store_takes_the_newest_grants_and_a_slot_this_step_loads_last() -> None:
    res = Reservation(4)
    res.slots.extend([(10, 1), (11, 1), (12, 1), (13, 1)])
    assert res.take(2, set()) == [(12, 1), (13, 1)]
    res.slots.extend([(14, 1), (15, 1)])
    # Slot 15 is an earmarked block this step loads: a store into it would wait for the load.
    assert res.take(2, {15}) == [(11, 1), (14, 1)]
    assert res.slots == [(15, 1), (10, 1)]
    assert res.take(2, {15}) == [(15, 1), (10, 1)]  # nothing else left: taken all the same
    assert res.take(0, set()) == [] and res.slots == []


def test_withdrawn_earmarks_leave_the_reservation() -> None:
    res = Reservation(4)
    res.slots.extend([(10, 1), (11, 1), (12, 1)])
    assert res.withdraw([11, 99]) == 2
    assert res.slots == [(10, 1), (12, 1)]
