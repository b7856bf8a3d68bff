"""The store reservation: empty pool slots the daemon granted this engine ahead of its stores.

vLLM's ``prepare_store`` must answer at once, so slots are asked for a step ahead, in the
step's ``Step`` (``reserve``), never waited for. How many: what recent steps wanted, twice
over -- the refill asked at a step's end normally arrives before the next step stores, and
with twice the demand at hand one late reply still finds a whole step's worth. A prefill of
8,192 tokens in 16-token blocks wants 512 slots per step, a decode step none: the size follows
the demand of the last ``WINDOW`` steps (never under ``floor``: the operator's
``kvoffload_store_reserve``, by default ``auto_floor`` of the pool) and what exceeds twice the
target goes back to the pool, so an engine that stopped prefilling does not keep slots empty
that other blocks could use.

Every reserved slot is a slot the pool keeps no block in (the daemon counts reservations
toward what it keeps empty ahead of stores, ``BlockIndex.keep_free``, but they are empty all
the same): a fixed floor of 64 in a pool of 167 slots held 20 of them empty (the daemon's cap,
an eighth) and cost 2-3 % of the tokens vLLM's own manager served in the same memory (issue
24). So the default floor is a share of the pool, and demand above it is what sizes the rest.

With the daemon's earmarks a grant may be a READY block, evicted only when claimed; the
manager takes the newest grants first (oldest-first was measured too: hybrid_chat at equal
policy, seeds 0-3, served 0.9958 of vLLM's tokens on average, 0.990-1.001, against 0.9975,
0.9963-1.0003). Earmarks used meanwhile come back in ``withdrawn``.

The daemon bounds what it grants (a fraction of the pool, the client's quota); a reply that
grants less than asked says so (``short``), and the manager then knows a deferred store would
not find its slots next step.
"""

from __future__ import annotations

from collections import deque

WINDOW = 64  # steps of demand remembered: a burst keeps its slots this long
HEADROOM = 2  # target = HEADROOM x the peak demand: one late refill still covers a step
DEFAULT_FLOOR = 64  # kvoffload_store_reserve's default in a pool of 4,096 slots or more ...
POOL_SHARE = 64  # ... and 1/64 of the pool in a smaller one


def auto_floor(num_slots: int, groups: int) -> int:
    """The floor when the operator set none: ``DEFAULT_FLOOR``, at most 1/``POOL_SHARE`` of
    the pool's slots, but never less than a step's one-off offers can need: ``HEADROOM``
    keys per KV group (a finishing request's last block and state in each group, offered once
    and never again, are dropped if they find no slots)."""
    return max(HEADROOM * max(1, groups), min(DEFAULT_FLOOR, num_slots // POOL_SHARE))


class Reservation:
    def __init__(self, floor: int | None, groups: int = 1) -> None:
        self.auto = floor is None  # the operator set none: ``auto_floor`` of the pool
        self.floor = DEFAULT_FLOOR if floor is None else floor
        self.groups = groups  # KV groups a block stores a key in (auto_floor)
        self.slots: list[tuple[int, int]] = []  # (slot, generation), ours to claim
        self.asked = 0  # slots asked for whose reply is not in yet
        self._rids: dict[int, int] = {}  # rid -> slots that Step asked for
        self.no_space = False  # the latest answer: nothing could be granted, none coming
        self.short = False  # the latest answer granted less than asked ...
        self.ceiling = 0  # ... and what we held then: about the most the daemon lets us hold
        self.demand = 0  # slots this step's stores wanted (taken or deferred)
        self._recent: deque[int] = deque(maxlen=WINDOW)

    def __len__(self) -> int:
        return len(self.slots)

    def first(self, num_slots: int) -> int:
        """The first reservation's size in a pool of ``num_slots``, the floor from now on
        (called by the session's attach thread, at each attach: a new daemon's pool may
        differ)."""
        if self.auto:
            self.floor = auto_floor(num_slots, self.groups)
        return self.floor

    def target(self) -> int:
        peak = max(self.demand, max(self._recent, default=0))
        return max(self.floor, HEADROOM * peak)

    def covers(self, n: int) -> bool:
        """Whether ``n`` slots can be expected at hand next step: the refill this step asks
        for reaches the target, or, after a short answer, what the daemon let us hold."""
        return not self.no_space and n <= (self.ceiling if self.short else self.target())

    def end_step(self) -> int:
        """At the step's end: how many slots to ask for; the next step starts."""
        target = self.target()
        self._recent.append(self.demand)
        self.demand = 0
        return max(0, target - len(self.slots) - self.asked)

    def low(self) -> bool:
        """Fewer slots at hand than a step of the recent peak demand stores."""
        return len(self.slots) < self.target() // HEADROOM

    def needs_refill(self, want: int) -> bool:
        """Whether a refill is worth a message of its own: the daemon answered the last ask
        in full (a capped engine asks again with its next claims, not every step)."""
        return want > 0 and not self.short and not self.no_space

    def surplus(self) -> list[tuple[int, int]]:
        """Slots beyond twice the target, taken out to be handed back."""
        target = self.target()
        if len(self.slots) <= HEADROOM * target:
            return []
        back = self.slots[target:]
        del self.slots[target:]
        return back

    def sent(self, rid: int | None, n: int) -> None:
        if n and rid is not None:
            self.asked += n
            self._rids[rid] = n

    def answered(self, rid: int, granted: list[tuple[int, int]], no_space: bool) -> None:
        self.slots.extend(granted)
        asked = self._rids.pop(rid, 0)
        if asked:
            self.asked -= asked
            self.no_space = no_space
            self.short = len(granted) < asked
            self.ceiling = len(self.slots)

    def take(self, n: int, loading: set[int]) -> list[tuple[int, int]]:
        """``n`` slots for a store, newest grants first, slots this step loads from last: an
        earmarked block we load now is withdrawn by the daemon once our pin arrives, and a
        store into it would wait for that load's release, sent a step later."""
        if n <= 0:
            return []
        slots = self.slots
        if loading and any(s in loading for s, _ in slots[-n:]):
            slots.sort(key=lambda ref: ref[0] not in loading)  # stable: order kept otherwise
        out, slots[-n:] = slots[-n:], []
        return out

    def withdraw(self, slots: list[int]) -> int:
        """Earmarked blocks the daemon took back (used meanwhile, ``daemon/store/earmarks.py``):
        not ours to store into; returns how many."""
        if slots:
            gone = set(slots)
            self.slots[:] = [ref for ref in self.slots if ref[0] not in gone]
        return len(slots)

    def clear(self) -> None:
        """The daemon went away: nothing it granted is ours any more."""
        self.slots.clear()
        self.asked = 0
        self._rids.clear()
        self.no_space = self.short = False
