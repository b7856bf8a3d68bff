"""The own-store state machine (connector/vllm/own_stores.py): every (state, event) pair, the
written-down table, and the paths the manager drives, without vLLM."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest
from kvoffload.connector.vllm import own_stores
from kvoffload.connector.vllm.own_stores import Action, Event, OwnStores, State

K = b"k" * 16
SLOT, GEN = 3, 7

# Written here from the design, not read from the module: (state, event) -> (next, action).
# Every pair not listed must be refused and change nothing.
EXPECTED: dict[tuple[str, str], tuple[str | None, str]] = {
    ("claimed", "applied"): ("writing", "none"),
    ("claimed", "exists"): ("duplicate", "none"),
    ("claimed", "refused"): (None, "forget"),
    ("claimed", "stored"): ("done_early", "commit"),
    ("claimed", "failed"): (None, "abort"),
    ("writing", "stored"): ("committed", "commit"),
    ("writing", "failed"): (None, "abort"),
    ("done_early", "applied"): ("committed", "none"),
    ("done_early", "exists"): (None, "reuse"),
    ("done_early", "refused"): (None, "forget"),
    ("committed", "refused"): (None, "forget"),
    ("committed", "settled"): (None, "forget"),
    ("duplicate", "stored"): (None, "reuse"),
    ("duplicate", "failed"): (None, "reuse"),
}


def _at(state: str) -> OwnStores:
    """A machine holding K in ``state``, reached through the manager's calls."""
    own = OwnStores(Counter())
    own.claimed([K], [(SLOT, GEN)])
    own.sent(1, [K])
    if state in ("writing", "committed"):
        assert own.answered(1, [], []) == []
    if state in ("done_early", "committed"):
        done = own.done(K, True)
        assert done is not None and done[0] is Action.COMMIT
    if state == "duplicate":
        assert own.answered(1, [K], []) == []
    assert own.state(K) is State(state)
    return own


@pytest.mark.parametrize(("state", "event"), list(itertools.product(
    [s.value for s in State], [e.value for e in Event])))
def test_every_state_and_event(state: str, event: str) -> None:
    own = _at(state)
    back: list[tuple[int, int]] = []
    action = own._step(K, Event(event), back)
    want = EXPECTED.get((state, event))
    if want is None:
        assert action is None and own.state(K) is State(state)
        assert own.counters["own_store_bad_events"] == 1
        return
    nxt, what = want
    assert action is Action(what)
    assert own.state(K) == (State(nxt) if nxt else None)
    assert back == ([(SLOT, GEN)] if what == "reuse" else [])
    # The derived facts follow the state.
    assert own.hit(K) == (nxt == "committed")
    assert own.unanswered == (nxt in ("claimed", "done_early"))
    assert own.any_committed == (nxt == "committed")
    assert (K in own) == (nxt is not None)


def test_the_docstring_table_is_the_code() -> None:
    doc = own_stores.__doc__ or ""
    rows = re.findall(r"^([A-Z_]+)\s+([A-Z]+)\s+(-|[A-Z_]+)", doc.split("Events and")[1], re.M)
    written = {(State[a], Event[b]): (None if c == "-" else State[c]) for a, b, c in rows}
    assert written == {k: v[0] for k, v in own_stores.TRANSITIONS.items()}
    assert {(s.value, e.value) for s, e in written} == set(EXPECTED)


def test_a_store_whose_workers_finish_before_the_reply_is_a_hit_once_answered() -> None:
    own = _at("claimed")
    done = own.done(K, True)
    assert done == (Action.COMMIT, (SLOT, GEN))
    assert not own.hit(K) and own.done_early(K) and own.loadable(K) is None
    own.answered(1, [], [])
    assert own.hit(K) and own.loadable(K) == (SLOT, GEN) and not own.unanswered


def test_a_refused_commit_forgets_only_committed_keys() -> None:
    own = _at("writing")
    own.answered(2, [], [K])  # a refusal for a Step that did not claim K: not its commit yet
    assert own.state(K) is State.WRITING
    own.done(K, True)
    own.answered(3, [], [K])
    assert K not in own and own.counters["stores_refused"] == 1


def test_settle_leaves_a_key_still_pending_in_our_slot() -> None:
    class View:
        caught_up = True

        def __init__(self, ready: dict[bytes, tuple[int, int]], slot: int | None) -> None:
            self.ready, self._slot = ready, slot

        def slot_of(self, key: bytes) -> int | None:
            return self._slot

        def lags(self, slot: int) -> bool:
            return False

    own = _at("committed")
    own.settle(View({}, SLOT))  # the commit is on its way: still ours
    assert own.hit(K)
    own.settle(View({}, None))  # gone from the index (evicted by another engine's store)
    assert K not in own
    own = _at("committed")
    own.settle(View({K: (SLOT, GEN)}, SLOT))  # READY: the view answers
    assert K not in own


def test_a_second_claim_of_a_held_key_is_refused() -> None:
    own = _at("writing")
    own.claimed([K], [(9, 1)])
    assert own.state(K) is State.WRITING and own.held[K].slot == SLOT
    assert own.counters["own_store_bad_events"] == 1


def test_done_for_an_unknown_key_and_clear() -> None:
    own = _at("done_early")
    assert own.done(b"x" * 16, True) is None
    own.clear()
    assert len(own) == 0 and not own.unanswered and not own.any_committed
    assert own.done(K, True) is None
