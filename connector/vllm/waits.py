"""What a lookup may wait for, and how long: another engine's PENDING key, a tier's find.

vLLM defers a request while any of its keys answers HIT_PENDING or RETRY and asks again next
step. Both are waits on something this engine does not control: another engine's store (a
frozen writer's claims stay PENDING until its lease ends, seconds) or a disk / Mooncake tier's
answer. ``Waits`` bounds each key's wait to ``pending_wait_ms`` from the first lookup that
waited on it; past that the lookup answers MISS and vLLM computes what it would have loaded.
The clock is read once per step (``start_step``), never per lookup.

``Finds`` is the tier side: a key missing from the pool is asked of the daemon's tiers once
(the step's ``finds``), answered RETRY until the tier answers; a key no tier holds is not asked
again for ``ttl_steps``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection

PRUNE_STEPS = 64  # how often waits on keys that are no longer waited on are forgotten


class Waits:
    def __init__(self, wait_ms: int, counters: Counter[str]) -> None:
        self.wait_s = wait_ms / 1000
        self.counters = counters
        self._since: dict[bytes, float] = {}  # key -> the step a lookup first waited on it
        self._now = 0.0

    def start_step(self, step: int, still: Collection[bytes], finding: Collection[bytes]
                   ) -> None:
        self._now = time.monotonic()
        if self._since and step % PRUNE_STEPS == 0:  # keys neither PENDING nor asked any more
            self._since = {k: t for k, t in self._since.items() if k in still or k in finding}

    def may_wait(self, key: bytes) -> bool:
        """Whether a lookup may still defer its request on ``key``."""
        first = self._since.setdefault(key, self._now)
        if self._now - first <= self.wait_s:
            return True
        self.counters["waits_given_up"] += 1
        return False

    def forget(self, key: bytes) -> None:
        self._since.pop(key, None)

    def clear(self) -> None:
        self._since.clear()


class Finds:
    def __init__(self, ttl_steps: int) -> None:
        self.ttl_steps = ttl_steps
        self.asking: set[bytes] = set()  # asked of the tiers, not answered yet
        self._not_found: dict[bytes, int] = {}  # key -> the step no tier had it

    def worth_asking(self, key: bytes, step: int) -> bool:
        seen = self._not_found.get(key)
        return seen is None or step - seen > self.ttl_steps

    def ask(self, key: bytes) -> bool:
        """True when the key is to be asked now (not already on its way)."""
        if key in self.asking:
            return False
        self.asking.add(key)
        return True

    def give_up(self, key: bytes, step: int) -> None:
        self.asking.discard(key)
        self._not_found[key] = step

    def stored(self, keys: Collection[bytes]) -> None:
        """This engine stores these keys now: once the pool evicts them a tier may hold
        them, so an earlier "no tier has it" no longer says anything."""
        not_found = self._not_found
        if not_found:
            for key in keys:
                not_found.pop(key, None)

    def answered(self, found: Collection[bytes], not_found: Collection[bytes], step: int
                 ) -> None:
        self.asking.difference_update(found)
        for key in not_found:
            self.give_up(key, step)

    def clear(self) -> None:
        self.asking.clear()
        self._not_found.clear()
