"""vLLM's cache reset, for the manager (``manager.py``): what the daemon granted goes back.

vLLM resets between steps, while its workers may still read pinned slots and write claimed
ones; it calls ``on_reset_flushed`` once every job in flight has reported back. So the reset
sends its ``Reset`` at once, keeps the pins and grants aside, and releases and aborts them only
after the flush. Commits not sent yet are dropped with the rest (the reset goes out first).
"""

from __future__ import annotations

from kvoffload.connector.session import IndexSession
from kvoffload.connector.vllm.batch import StepBatch
from kvoffload.connector.vllm.own_stores import OwnStores
from kvoffload.connector.vllm.settings import ManagerSettings
from kvoffload.daemon.control import protocol as p


class CacheReset:
    """``reset_cache`` / ``on_reset_flushed`` of ``DaemonOffloadingManager``."""

    session: IndexSession
    settings: ManagerSettings
    own: OwnStores
    _batch: StepBatch
    _loads: dict[str, list[p.SlotRef]]
    _busy: bool
    # What waits for the workers' flush: the pins of loads in flight (released) and our
    # claimed stores (aborted).
    _after_reset: tuple[list[p.SlotRef], list[p.SlotRef]] | None = None

    def reset_cache(self) -> None:
        pins = [ref for refs in self._loads.values() for ref in refs]
        grants = [p.SlotRef(k, slot, gen) for k, slot, gen in self.own.grants()]
        self._after_reset = (pins, grants)
        self._loads.clear()
        self._batch.commits.clear()
        self.own.clear()
        scope = self.settings.reset_scope
        if scope != "none":
            self.session.post(lambda rid, engine: p.Reset(rid=rid, engine=engine, scope=scope))

    def on_reset_flushed(self) -> None:
        after, self._after_reset = self._after_reset, None
        if after is None:
            return
        pins, grants = after
        if pins or grants:
            self.session.send(lambda rid, engine, epoch: p.Step(
                rid=rid, engine=engine, epoch=epoch, releases=pins, aborts=grants),
                end_of_step=not self._busy)
