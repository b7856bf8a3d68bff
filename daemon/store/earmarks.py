"""Earmarked grants: store reservations that keep their blocks readable until claimed.

A reservation of empty slots is capacity the pool does not use: in a pool of 167 slots the
~7 slots engines held empty for their next stores cost 0.4-0.7 % of the tokens vLLM's own
manager served in the same memory (issue 24), where vLLM evicts at ``prepare_store``, in the
scheduler, and keeps no slot empty. With ``earmark_reservations`` a full pool grants READY
blocks instead: the eviction policy's next victims, taken out of its order and *earmarked*
for one engine. Their blocks stay READY and loadable by every engine until the engine claims
the slot for a store; only then is the block evicted.

The grant's generation is the slot's generation + 1. The slot is written only once the
daemon has *handed it over* -- moved its generation to the granted one -- and it does that
only after reclamation: no pin holds the slot and no reader can still act on the evicted
block (``reclaim.py``, the same rule as any retired slot). Until then the shared index shows
the new key PENDING at the old generation, one below the grant's, and the worker parks the
store (``connector/vllm/parked.py``): ``submit_store`` and ``get_finished`` never wait for
it; only vLLM's flush of a store whose GPU blocks it is about to reuse (``wait``) does, until
the handover, at most to the stamp's deadline. The daemon checks for handovers every
millisecond while one waits (``server.py``), and an engine's record is busy only while it
schedules, so that wait is about one scheduling pass of the engines reading the index.

Giving up is always safe because the generation only moves forward and never lands on the
granted one after a give-up:

- the daemon hands over no later than ``HANDOVER_S`` after the claim's stamp (the monotonic
  time the engine took the slots, carried in the ``Step`` and in the worker's spec); past it,
  and whenever a grant ends before its handover (the engine's session ended or it handed
  the slot back, its claim was refused, came past the deadline or was answered ``exists``,
  the block was used meanwhile), the grant is *burnt*: the generation moves by two,
  published at once (once no load pins the block), so a waiting worker sees the change and
  writes nothing, and a late commit is refused (its generation never matches);
- a worker gives up at ``HANDOVER_WAIT_S`` = 2 x ``HANDOVER_S`` after the same stamp.

An earmarked block that is used meanwhile -- pinned by a load or touched (a request reused
it) -- is *withdrawn* from its engine: back in the eviction order where its use puts it, as
vLLM's LRU would keep a block it just used, and its grant burnt once no load holds it (a burn
moves the generation, which would fail a load in flight). The engine learns it in its next
``StepReply`` (``withdrawn``) and drops the slot from its reservation; a claim already on
its way is refused. Measured (issue 24), without this a hit on an earmarked block did not
save it, and evicting blocks in reuse cost more than the earmarks' capacity gained.

A mixin of ``index.BlockIndex`` (split out to keep each module readable).
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload.daemon.store import shared_index as si
from kvoffload.daemon.store.eviction import EvictionPolicy
from kvoffload.daemon.store.reclaim import Reclaimer
from kvoffload.daemon.store.slot_states import Listener, Namespace, SlotState

# Called with (holder, slot) when a claimed earmark is given up before its handover: the
# holder's books (its pending stores) drop the slot.
CancelListener = Callable[[object, int], None]


@dataclass(slots=True)
class Handover:
    holder: object  # the client whose claim waits for the slot
    deadline: float  # time.monotonic() past which the slot is not handed over, but burnt


class EarmarkTable:
    # Set by BlockIndex (declared here for the methods below).
    gen: array[int]
    pins: array[int]
    state: bytearray
    slot_key: list[bytes | None]
    ns_of: array[int]
    namespaces: list[Namespace]
    policy: EvictionPolicy[int]
    reclaimer: Reclaimer
    on_evict: list[Listener]
    on_drop: list[Listener]
    on_abort: list[Listener]
    n_ready: int
    n_pending: int

    def _init_earmarks(self) -> None:
        self.earmark_reservations = False  # set from the daemon's configuration
        self.earmarks: dict[int, object] = {}  # READY slot -> the engine it is granted to
        self.handovers: dict[int, Handover] = {}  # claimed, evicted, waiting for readers
        self.on_cancel: list[CancelListener] = []
        self.on_handover_queued: Callable[[], None] | None = None  # wakes the daemon's loop
        self.burnt = 0  # grants given up before their handover (metrics)
        # id(holder) -> earmarks taken back (holders need not be hashable; popped when told
        # and when the holder leaves, so an id is never read for another holder)
        self.withdrawn: dict[int, list[int]] = {}
        self._burn_unpinned: set[int] = set()  # withdrawn while pinned: burnt at the unpin

    if TYPE_CHECKING:  # provided by BlockIndex and SlotTable
        def publish(self, slot: int) -> None: ...
        def _bump(self, slot: int) -> None: ...
        def _occupy(self, ns: Namespace, key: bytes, slot: int, state: SlotState,
                    end_token: int, tail: bool, owner: int = 0) -> None: ...
        def _resolve(self, slot: int, ok: bool) -> None: ...
        def _free(self, slot: int) -> None: ...
        def _evictable(self, slot: int) -> bool: ...

        @property
        def epoch(self) -> int: ...

    def _earmark(self, holder: object, n: int) -> list[tuple[int, int]]:
        """Up to ``n`` of the policy's next victims, granted to ``holder`` at generation + 1."""
        out = []
        for slot in self.policy.victims(n, self._evictable):
            self.earmarks[slot] = holder
            out.append((slot, (self.gen[slot] + 1) & si.GEN_MASK))
        return out

    def _burn(self, slot: int) -> None:
        """The grant of ``slot`` will never be handed over: its generation skips the granted
        one, published now (a waiting worker stops waiting and writes nothing)."""
        self.gen[slot] = (self.gen[slot] + 2) & si.GEN_MASK
        self.burnt += 1
        self.publish(slot)

    def withdraw(self, slot: int, tell: bool = True) -> None:
        """An earmarked block is in use again (or handed back, ``tell`` False: its engine
        knows): it goes back to the eviction order and its grant is burnt, now or once the
        loads pinning it are done (a burn moves the generation, failing a load in flight)."""
        holder = self.earmarks.pop(slot)
        self.policy.on_insert(slot)
        if tell:
            self.withdrawn.setdefault(id(holder), []).append(slot)
        if self.pins[slot]:
            self._burn_unpinned.add(slot)
        else:
            self._burn(slot)

    def _unpinned(self, slot: int) -> None:
        if slot in self._burn_unpinned:
            self._burn_unpinned.discard(slot)
            self._burn(slot)

    def take_withdrawn(self, holder: object) -> list[int]:
        return self.withdrawn.pop(id(holder), [])

    def release_earmark(self, slot: int) -> bool:
        """An earmark goes back unclaimed, burnt: its block stays READY. Burnt even when the
        engine hands it back as unused (``unreserve``): the next grant of the slot would be
        at the same generation, so a store of this engine still waiting for it (a client
        that handed back a slot it used) would write another engine's slot."""
        if slot not in self.earmarks:
            return False
        self.withdraw(slot, tell=False)
        return True

    def claim_earmark(self, ns: Namespace, key: bytes, slot: int, gen: int, end_token: int,
                      tail: bool, holder: object, owner: int, stamp: float) -> bool | None:
        """``key`` into an earmarked slot: True (its block evicted, the handover queued), None
        (refused: not ``holder``'s earmark at ``gen``; or burnt: pinned, past the stamp's
        deadline, or ``key`` stored meanwhile -- refused rather than ``exists``, which would
        keep the slot the engine's for its next store, and a burnt one is not).
        A claim that returns True leaves ``key`` PENDING in ``slot``: a deadline can only pass
        later, in ``_finish_handover`` / ``expire_handovers``, which tell ``on_cancel``."""
        if self.earmarks.get(slot) is not holder or gen != (self.gen[slot] + 1) & si.GEN_MASK:
            return None
        now = time.monotonic()
        start = stamp if math.isfinite(stamp) and 0 < stamp <= now else now
        late = now > start + si.HANDOVER_S  # its workers may give up before any handover
        if self.pins[slot] or key in ns.keys or late:  # (a pin withdraws it first)
            self.withdraw(slot)
            return None
        del self.earmarks[slot]
        old_ns, old_key = self.namespaces[self.ns_of[slot]], self.slot_key[slot]
        assert old_key is not None
        for listener in self.on_evict:  # a lower tier copies the bytes out first
            listener(old_ns, old_key, slot)
        for listener in self.on_drop:
            listener(old_ns, old_key, slot)
        del old_ns.keys[old_key]
        self.n_ready -= 1
        # The new key reads PENDING at the old generation: no worker writes before the
        # generation moves, and no reader loads a PENDING key.
        self._occupy(ns, key, slot, SlotState.PENDING, end_token, tail, owner)
        if self.reclaimer.readers:
            self.handovers[slot] = Handover(holder, start + si.HANDOVER_S)
            self.reclaimer.retire(slot, self.epoch)  # readers may still load the old block
            if self.on_handover_queued is not None:
                self.on_handover_queued()
        else:  # nobody can load the old block: the writer's now, within its deadline
            self._bump(slot)
            self.publish(slot)
        return True

    def _finish_handover(self, slot: int) -> None:
        """No reader or pin can reach the evicted block any more (reclaim): the slot goes to
        its writer, unless the claim's deadline passed (then it is burnt and freed)."""
        h = self.handovers.pop(slot)
        if time.monotonic() > h.deadline:
            self._cancel(slot, h, SlotState.FREE)
            self._free(slot)
            return
        self._bump(slot)
        self.publish(slot)

    def cancel_handover(self, slot: int) -> bool:
        """A claimed earmark's writer went away before its handover: the new key is aborted
        and the grant burnt; the slot stays retired until readers are past its old block."""
        h = self.handovers.pop(slot, None)
        if h is None:
            return False
        self._cancel(slot, h, SlotState.RETIRED)
        return True

    def _cancel(self, slot: int, h: Handover, state: SlotState) -> None:
        """Abort the new key, leave the slot in ``state`` and burn the grant (published)."""
        key = self.slot_key[slot]
        ns = self.namespaces[self.ns_of[slot]]
        if key is not None and ns.keys.get(key) == slot:
            for listener in self.on_abort:
                listener(ns, key, slot)
            del ns.keys[key]
            self.n_pending -= 1
        self.slot_key[slot] = None
        self.state[slot] = state
        self._resolve(slot, False)
        self._burn(slot)
        for cancel in self.on_cancel:
            cancel(h.holder, slot)

    def expire_handovers(self) -> int:
        """Burn claimed earmarks whose deadline passed while readers still held them back:
        their writers stop waiting (the slots stay retired until the readers move on)."""
        if not self.handovers:
            return 0
        now = time.monotonic()
        late = [s for s, h in self.handovers.items() if now > h.deadline]
        for slot in late:
            self.cancel_handover(slot)
        return len(late)
