"""This engine's own stores, from the claim until the shared index shows them READY.

vLLM's own manager never loses a block it stored; neither may ours while the daemon is slow. A
store's life here: claimed (a slot of the reservation, sent in the step's ``Step``), answered
(the daemon applied the claim: the index holds the key PENDING in our slot), committed (the
workers are done; the commit rides the next ``Step``), READY in the view. Until the view
shows it READY the manager answers for it from here: PENDING, or HIT once committed and the
daemon has answered the claim (a load's pin travels after the commit on one ordered socket).

Once the daemon has answered a claim, every reply absorbed so far was read before the view's
last refresh, so the view is the truth for that key: READY (the view answers), still PENDING
in our slot (the commit is on its way), or gone -- another engine's store evicted it, a reset
dropped it: forgotten at once, so vLLM's next offer stores it again. A claim the daemon has
not answered keeps its own answer however long the daemon takes (within the session's
liveness window; past it the session drops everything the daemon granted).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol


class _View(Protocol):
    ready: dict[bytes, tuple[int, int]]

    def slot_of(self, key: bytes) -> int | None: ...


class OwnStores:
    def __init__(self, counters: Counter[str]) -> None:
        self.counters = counters
        self.slots: dict[bytes, tuple[int, int]] = {}  # key -> (slot, generation)
        self.unapplied: set[bytes] = set()  # claims the daemon has not answered yet
        self.committed: set[bytes] = set()  # workers done: commit queued or sent
        self.dupes: set[bytes] = set()  # claims of keys stored meanwhile: the slot stays ours
        self._claim_rids: dict[int, list[bytes]] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self.slots

    def claimed(self, keys: Sequence[bytes], refs: list[tuple[int, int]]) -> None:
        self.slots.update(zip(keys, refs, strict=True))
        self.unapplied.update(keys)

    def sent(self, rid: int, keys: list[bytes]) -> None:
        self._claim_rids[rid] = keys

    def answered(self, rid: int, exists: list[bytes], refused: list[bytes]
                 ) -> list[tuple[int, int]]:
        """A Step's reply: its claims are applied. Returns slots free for the next store."""
        claimed = self._claim_rids.pop(rid, None)
        if claimed is not None:
            self.unapplied.difference_update(claimed)
        back: list[tuple[int, int]] = []
        if not exists and not refused:
            return back
        mine = set(claimed or ())
        for key in exists:  # stored meanwhile by another engine: our slot stays reserved
            if key in mine and key in self.slots:
                self.counters["stores_exist"] += 1
                if key in self.committed:  # its workers are done: reuse the slot now
                    self.committed.discard(key)
                    back.append(self.slots.pop(key))
                else:
                    self.dupes.add(key)  # reused once its workers are done
        for key in refused:  # a claim or commit not in our slot any more: forget it
            if key in self.slots and (key in mine or key in self.committed):
                self.counters["stores_refused"] += 1
                self._forget(key)
        return back

    def settle(self, view: _View) -> None:
        """At a step's start, after the view's refresh: the answered claims the view now
        answers for (READY, or gone)."""
        unapplied, slots = self.unapplied, self.slots
        for key in [k for k in self.committed if k not in unapplied]:
            if key in view.ready or view.slot_of(key) != slots[key][0]:
                self.committed.discard(key)
                del slots[key]

    def hit(self, key: bytes) -> bool:
        """Committed, and the daemon answered its claim: the index holds the key in our slot
        (the workers check the index itself, not our view of it), so it loads now."""
        return key in self.committed and key not in self.unapplied

    def done(self, key: bytes, success: bool) -> tuple[str, tuple[int, int]] | None:
        """vLLM reports the key's store done: ("commit" | "abort" | "reuse", its slot)."""
        ref = self.slots.get(key)
        if ref is None:
            return None
        if key in self.dupes:  # the daemon kept the slot reserved for us
            self.dupes.discard(key)
            del self.slots[key]
            return "reuse", ref
        if success:
            self.committed.add(key)  # in ``slots`` until the view shows it READY
            return "commit", ref
        self._forget(key)
        return "abort", ref

    def _forget(self, key: bytes) -> None:
        self.slots.pop(key, None)
        self.committed.discard(key)
        self.dupes.discard(key)
        self.unapplied.discard(key)

    def clear(self) -> None:
        self.slots.clear()
        self.unapplied.clear()
        self.committed.clear()
        self.dupes.clear()
        self._claim_rids.clear()
