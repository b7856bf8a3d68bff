"""This engine's own stores, from the claim until the shared index shows them READY: one state
machine per key.

vLLM's own manager never loses a block it stored; neither may ours while the daemon is slow.
Until the view shows a store READY the manager answers for it from here. A key's states:

============  =====================================================  ===================
state         meaning                                                lookup answers
============  =====================================================  ===================
CLAIMED       a reserved slot is the key's; the claim is queued or   PENDING
              sent; the workers write; the daemon has not answered
WRITING       the daemon applied the claim (the index holds the key  PENDING
              PENDING in our slot); the workers write
DONE_EARLY    the workers are done, the commit is queued; the        PENDING (a lookup
              daemon has not answered the claim yet                  waits ``sync_ms``)
COMMITTED     workers done and claim applied: the daemon takes the   HIT
              commit before any pin of the same or a later Step
DUPLICATE     the daemon says the key was stored meanwhile (by       PENDING
              someone else); our workers still write our slot
============  =====================================================  ===================

Events and transitions (``TRANSITIONS``; anything else is refused, counted and logged, and
changes nothing). "->  -" means the key leaves the machine; the action says what becomes of
its slot:

==========  ==========  =========================================  ===========================
from        event       to                                         slot
==========  ==========  =========================================  ===========================
CLAIMED     APPLIED     WRITING
CLAIMED     EXISTS      DUPLICATE
CLAIMED     REFUSED     -                                          gone (not ours)
CLAIMED     STORED      DONE_EARLY                                 commit queued
CLAIMED     FAILED      -                                          abort queued
WRITING     STORED      COMMITTED                                  commit queued
WRITING     FAILED      -                                          abort queued
DONE_EARLY  APPLIED     COMMITTED
DONE_EARLY  EXISTS      -                                          back to the reservation
DONE_EARLY  REFUSED     -                                          gone
COMMITTED   REFUSED     -                                          gone (the commit refused:
                                                                   a revoked grant)
COMMITTED   SETTLED     -                                          the view answers (READY,
                                                                   or gone from the index)
DUPLICATE   STORED      -                                          back to the reservation
DUPLICATE   FAILED      -                                          back to the reservation
==========  ==========  =========================================  ===========================

``SETTLED`` happens at a step's start, after a refresh that caught up with the head it read:
once the daemon answered a claim, every reply absorbed so far was read before that refresh,
so the view is the truth -- READY (the view answers), still PENDING in our slot (the commit
is on its way: stays), or gone (another engine's store evicted it, a reset dropped it:
forgotten at once, so vLLM's next offer stores it again). A claim the daemon has not answered keeps its own answer however long
the daemon takes (within the session's liveness window; past it the session drops everything
the daemon granted: ``clear``). The rest of a key's engine-side life is in docs/architecture.md
("A key's life in the engine").
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Container, Iterator, Sequence
from typing import Protocol

log = logging.getLogger("kvoffload.connector.vllm")


class State(enum.Enum):
    CLAIMED = "claimed"
    WRITING = "writing"
    DONE_EARLY = "done_early"
    COMMITTED = "committed"
    DUPLICATE = "duplicate"


class Event(enum.Enum):
    APPLIED = "applied"  # the daemon answered the claim: the key is PENDING in our slot
    EXISTS = "exists"  # the daemon answered the claim: the key was stored meanwhile
    REFUSED = "refused"  # the daemon refused the claim or the commit: the slot is not ours
    STORED = "stored"  # vLLM: the workers' copy succeeded
    FAILED = "failed"  # vLLM: the workers' copy failed
    SETTLED = "settled"  # the refreshed view answers for the key now


class Action(enum.Enum):
    NONE = "none"
    COMMIT = "commit"  # queue the commit (next Step)
    ABORT = "abort"  # queue the abort: the daemon frees the slot
    REUSE = "reuse"  # the daemon kept the slot reserved for us: back to the reservation
    FORGET = "forget"  # nothing to send: the slot is not ours any more, or the view answers


S, E, A = State, Event, Action
# (state, event) -> (next state, or None when the key leaves; what becomes of its slot)
TRANSITIONS: dict[tuple[State, Event], tuple[State | None, Action]] = {
    (S.CLAIMED, E.APPLIED): (S.WRITING, A.NONE),
    (S.CLAIMED, E.EXISTS): (S.DUPLICATE, A.NONE),
    (S.CLAIMED, E.REFUSED): (None, A.FORGET),
    (S.CLAIMED, E.STORED): (S.DONE_EARLY, A.COMMIT),
    (S.CLAIMED, E.FAILED): (None, A.ABORT),
    (S.WRITING, E.STORED): (S.COMMITTED, A.COMMIT),
    (S.WRITING, E.FAILED): (None, A.ABORT),
    (S.DONE_EARLY, E.APPLIED): (S.COMMITTED, A.NONE),
    (S.DONE_EARLY, E.EXISTS): (None, A.REUSE),
    (S.DONE_EARLY, E.REFUSED): (None, A.FORGET),
    (S.COMMITTED, E.REFUSED): (None, A.FORGET),
    (S.COMMITTED, E.SETTLED): (None, A.FORGET),
    (S.DUPLICATE, E.STORED): (None, A.REUSE),
    (S.DUPLICATE, E.FAILED): (None, A.REUSE),
}
_UNANSWERED = (S.CLAIMED, S.DONE_EARLY)  # the daemon has not answered these claims yet


class _View(Protocol):
    @property
    def ready(self) -> Container[bytes]: ...

    @property
    def caught_up(self) -> bool: ...

    def slot_of(self, key: bytes) -> int | None: ...

    def lags(self, slot: int) -> bool: ...


class _Store:
    __slots__ = ("slot", "gen", "state")

    def __init__(self, slot: int, gen: int) -> None:
        self.slot, self.gen, self.state = slot, gen, S.CLAIMED


class OwnStores:
    def __init__(self, counters: Counter[str]) -> None:
        self.counters = counters
        self._keys: dict[bytes, _Store] = {}
        self._committed: set[bytes] = set()  # the COMMITTED keys (settle walks only these)
        self._unanswered = 0  # keys CLAIMED or DONE_EARLY
        self._claim_rids: dict[int, list[bytes]] = {}
        self._warned = False

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def held(self) -> dict[bytes, _Store]:
        """The keys we hold, for fast membership tests on the store path (read only)."""
        return self._keys

    def state(self, key: bytes) -> State | None:
        store = self._keys.get(key)
        return store.state if store is not None else None

    # -- what the manager asks ------------------------------------------------------------

    def hit(self, key: bytes) -> bool:
        """Committed, and the daemon answered its claim: the index holds the key in our slot
        (the workers check the index itself, not our view of it), so it loads now."""
        store = self._keys.get(key)
        return store is not None and store.state is S.COMMITTED

    def done_early(self, key: bytes) -> bool:
        """Workers done, claim not answered: a lookup may wait ``sync_ms`` for the reply."""
        store = self._keys.get(key)
        return store is not None and store.state is S.DONE_EARLY

    def loadable(self, key: bytes) -> tuple[int, int] | None:
        """(slot, generation) of a COMMITTED key: what its load reads."""
        store = self._keys.get(key)
        return (store.slot, store.gen) if store is not None and store.state is S.COMMITTED \
            else None

    @property
    def unanswered(self) -> bool:
        return self._unanswered > 0

    @property
    def any_committed(self) -> bool:
        return bool(self._committed)

    def grants(self) -> Iterator[tuple[bytes, int, int]]:
        """Every (key, slot, generation) we hold, whatever its state (a reset aborts them)."""
        return ((k, s.slot, s.gen) for k, s in self._keys.items())

    # -- events ---------------------------------------------------------------------------

    def claimed(self, keys: Sequence[bytes], refs: list[tuple[int, int]]) -> None:
        for key, (slot, gen) in zip(keys, refs, strict=True):
            if key in self._keys:  # the manager filters these: never two claims of one key
                self._refuse(key, "claimed twice")
                continue
            self._keys[key] = _Store(slot, gen)
            self._unanswered += 1

    def sent(self, rid: int, keys: list[bytes]) -> None:
        self._claim_rids[rid] = keys

    def answered(self, rid: int, exists: list[bytes], refused: list[bytes]
                 ) -> list[tuple[int, int]]:
        """A Step's reply: its claims are answered. Returns slots free for the next store."""
        back: list[tuple[int, int]] = []
        claimed = self._claim_rids.pop(rid, None)
        gone, taken = set(exists), set(refused)
        for key in claimed or ():
            event = E.EXISTS if key in gone else E.REFUSED if key in taken else E.APPLIED
            if key in gone:
                self.counters["stores_exist"] += 1
            self._step(key, event, back)
        mine = set(claimed or ())
        for key in refused:  # a commit refused: its slot's generation moved (revoked)
            if key not in mine and self.state(key) in (S.COMMITTED, S.DONE_EARLY):
                self._step(key, E.REFUSED, back)
        return back

    def settle(self, view: _View) -> None:
        """At a step's start, after the view's refresh: the COMMITTED keys the view now
        answers for (READY, or gone from our slot). Not a key whose slot the view has not
        applied up to the head it read (an addition waiting for the refresh's budget,
        ``index_view.REFRESH_BUDGET_S``): its claim or commit may be what waits, and the key
        would read as gone."""
        keys, lags = self._keys, None if view.caught_up else view.lags
        for key in [k for k in self._committed
                    if (lags is None or not lags(keys[k].slot))
                    and (k in view.ready or view.slot_of(k) != keys[k].slot)]:
            self._step(key, E.SETTLED, [])

    def done(self, key: bytes, success: bool) -> tuple[Action, tuple[int, int]] | None:
        """vLLM reports the key's store done: what to do with its slot (COMMIT, ABORT or
        REUSE), or None for a key we do not hold (a reset, a lost session)."""
        store = self._keys.get(key)
        if store is None:
            return None
        action = self._step(key, E.STORED if success else E.FAILED, [])
        return (action, (store.slot, store.gen)) if action is not None else None

    def clear(self) -> None:
        """The daemon went away, or a reset: nothing it granted is ours any more."""
        self._keys.clear()
        self._committed.clear()
        self._claim_rids.clear()
        self._unanswered = 0

    # -- the machine ----------------------------------------------------------------------

    def _step(self, key: bytes, event: Event, back: list[tuple[int, int]]) -> Action | None:
        """Apply one event; every state change goes through here. None: refused."""
        store = self._keys.get(key)
        if store is None:
            return None
        move = TRANSITIONS.get((store.state, event))
        if move is None:
            self._refuse(key, f"{event.value} in state {store.state.value}")
            return None
        nxt, action = move
        before = store.state
        if before in _UNANSWERED:
            self._unanswered -= 1
        if before is S.COMMITTED:
            self._committed.discard(key)
        if nxt is None:
            del self._keys[key]
            if event is E.REFUSED:
                self.counters["stores_refused"] += 1
        else:
            store.state = nxt
            if nxt in _UNANSWERED:
                self._unanswered += 1
            if nxt is S.COMMITTED:
                self._committed.add(key)
        if action is A.REUSE:
            back.append((store.slot, store.gen))
        return action

    def _refuse(self, key: bytes, what: str) -> None:
        self.counters["own_store_bad_events"] += 1
        if not self._warned:  # a bug of ours, never the daemon's input: say it once
            self._warned = True
            log.warning("kvoffload: own store %s: event %s refused (state unchanged)",
                        key.hex()[:16], what)
