"""What one scheduler step of the manager sends in its ``Step`` (``manager.py``)."""

from __future__ import annotations

import time
from typing import Any

from kvoffload.daemon.control import protocol as p


class StepBatch:
    """What the next ``Step`` carries. ``lookups`` holds ``LookupReport``s or the arguments
    of one (``KVOffloadConnector``'s, built into a report when the message is built)."""

    __slots__ = ("pins", "releases", "claims", "commits", "aborts", "finds", "lookups",
                 "touches", "stamp")

    def __init__(self) -> None:
        self.pins: list[p.SlotRef] = []
        self.releases: list[p.SlotRef] = []
        self.claims: list[p.StoreClaim] = []
        self.commits: list[p.SlotRef] = []
        self.aborts: list[p.SlotRef] = []
        self.finds: list[bytes] = []
        self.lookups: list[Any] = []
        self.touches: list[bytes] = []  # READY keys offered again: reused, most recent now
        # time.monotonic() of the first claim: its slots' specs carry it too (earmarks.py)
        self.stamp = 0.0

    def __bool__(self) -> bool:
        return bool(self.pins or self.releases or self.claims or self.commits or self.aborts
                    or self.finds or self.lookups or self.touches)

    def claim_stamp(self) -> float:
        """The stamp of this Step's claims: when the first of them took its slots."""
        if not self.claims:
            self.stamp = time.monotonic()
        return self.stamp

    def step(self, rid: int, engine: int, epoch: int, unreserve: list[p.SlotRef],
             reserve: int, lookups: list[p.LookupReport]) -> p.Step:
        return p.Step(rid=rid, engine=engine, epoch=epoch, pins=self.pins,
                      releases=self.releases, claims=self.claims, commits=self.commits,
                      aborts=self.aborts, unreserve=unreserve, reserve=reserve,
                      finds=self.finds, lookups=lookups, touches=self.touches,
                      stamp=self.stamp)

    def urgent(self) -> bool:
        """Pins (ahead of the epoch that could free their slots), claims (our own commits
        are loadable once the index holds them), finds (a tier answers a step later)."""
        return bool(self.pins or self.claims or self.finds)
