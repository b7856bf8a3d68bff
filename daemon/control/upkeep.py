"""What ``Service`` does between requests: expire leases, release what departed clients
held, keep the pool gauges, answer ``Stats``.

A mixin of ``service.Service`` (split out to keep each module readable).
"""

from __future__ import annotations

import logging
from collections import Counter

from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.control.leases import ClientState, Leases
from kvoffload.daemon.control.steps import StepHandler
from kvoffload.daemon.ops.metrics import DaemonMetrics
from kvoffload.daemon.store.index import BlockIndex, SlotState

log = logging.getLogger("kvoffload.daemon")


class ServiceUpkeep:
    # Set by Service.__init__ (declared here for the methods below).
    index: BlockIndex
    metrics: DaemonMetrics
    leases: Leases
    steps: StepHandler
    totals: Counter[str]
    daemon_id: str
    http_url: str
    _pending_owner: dict[int, ClientState]

    # -- housekeeping -----------------------------------------------------------------

    def expire_leases(self, now: float | None = None) -> int:
        """Release what clients whose lease ran out by ``now`` (time.monotonic(), default
        the present) still hold; returns how many expired."""
        gone = self.leases.expired(now)
        for client in gone:
            pins, pending = sum(client.pins.values()), len(client.pending)
            self.metrics.pins_released.inc(pins)
            self.metrics.stores.labels("expired").inc(self._release_client(client) - pins)
            if pins or pending:
                log.info("lease of client %r expired: released %d pins, %d pending stores",
                         client.name, pins, pending)
        if gone:
            self.metrics.leases_expired.inc(len(gone))
            self.metrics.clients.set(len(self.leases))
        if self.index.previous is not None:  # a previous daemon's sessions: removed once free
            self.index.previous.gone()
        if self.index.reclaimer.quarantined:  # writers may have gone since the last step
            self.index.reclaim()
        if gone or self.index.reclaimer.quarantined:
            self._update_pool_gauges()
        return len(gone)

    def _release_client(self, client: ClientState, fence: bool = True) -> int:
        """Drop a departing client's pins and abort its pending stores; returns how many."""
        released = 0
        for slot, n in client.pins.items():
            for _ in range(n):
                self.index.unpin(slot)
            released += n
        client.pins.clear()
        # Its workers may still be writing what it held: those slots get a new generation and
        # are quarantined until its writers' lock is free (a client that takes the lock), or
        # wait a lease before reuse (one that does not, unless it said goodbye).
        fence_s = client.lease_ms / 1000 if fence else 0.0
        writers = client.session if client.writer_lock else None
        for slot in list(client.pending):
            key = self.index.slot_key[slot]
            if key is not None and self.index.state[slot] == SlotState.PENDING:
                self.index.abort(self.index.namespaces[self.index.ns_of[slot]], key,
                                 fence_s=fence_s, writers=writers)
                released += 1
            self._pending_owner.pop(slot, None)
        client.pending.clear()
        released += self.steps.release_client(client, fence_s)
        session, client.session = client.session, None
        client.reads_index = False
        if session is not None:
            session.unlink()  # nobody opens it any more; an open descriptor still locks it
            if not self.index.reclaimer.holds(session):
                session.close()
        self.index.reclaim()
        self._update_pool_gauges()
        return released

    def _handover_cancelled(self, holder: object, slot: int) -> None:
        """A claimed earmark burnt before its handover (deadline, or its client left): the
        store is gone from its client's books (a late commit is refused)."""
        if isinstance(holder, ClientState):
            holder.pending.discard(slot)
        if self._pending_owner.get(slot) is holder:
            del self._pending_owner[slot]
        self.metrics.stores.labels("burnt").inc()

    def close_sessions(self) -> None:
        """At shutdown: remove every session file (after the index is superseded, so no
        engine trusts what it read). A previous daemon's file whose writer still holds its
        lock is left for the next daemon to wait on."""
        for client in self.leases.clients.values():
            if client.session is not None:
                client.session.close()
                client.session = None
        self.index.reclaimer.close_quarantine()
        if self.index.previous is not None:
            self.index.previous.gone()

    def _update_pool_gauges(self) -> None:
        idx, pool, m = self.index, self.index.pool, self.metrics
        ready, pending = idx.count(SlotState.READY), idx.count(SlotState.PENDING)
        m.pool_slots.labels("total").set(pool.num_slots)
        m.pool_slots.labels("ready").set(ready)
        m.pool_slots.labels("pending").set(pending)
        m.pool_slots.labels("free").set(pool.free_slots)
        # Revoked grants whose writers may still copy (reclaim.py): back once they are gone.
        m.pool_slots.labels("quarantined").set(idx.reclaimer.quarantined)
        # READY blocks granted for engines' next stores (earmarks.py): counted in "ready" too.
        m.pool_slots.labels("earmarked").set(len(idx.earmarks))
        m.pool_bytes.labels("total").set(pool.pool_bytes)
        m.pool_bytes.labels("used").set((ready + pending) * pool.slot_bytes)
        m.pool_bytes.labels("pending").set(pending * pool.slot_bytes)
        m.pool_bytes.labels("free").set(pool.pool_bytes - (ready + pending) * pool.slot_bytes)
        m.pinned_slots.set(idx.n_pinned)

    def stats(self, client: ClientState, msg: p.Stats) -> p.StatsReply:
        idx, pool = self.index, self.index.pool
        return p.StatsReply(rid=msg.rid, stats={
            "daemon_id": self.daemon_id, "clients": len(self.leases),
            "namespaces": len(idx.namespaces), "num_slots": pool.num_slots,
            "slot_bytes": pool.slot_bytes, "free_slots": pool.free_slots,
            "ready": idx.count(SlotState.READY), "pending": idx.count(SlotState.PENDING),
            "pinned": idx.n_pinned, "policy": idx.policy.name, "http": self.http_url,
            "quarantined": idx.reclaimer.quarantined,
            "readers_passed_over": idx.reclaimer.passed_over,
            "earmarked": len(idx.earmarks), "handovers": len(idx.handovers),
            "earmarks_burnt": idx.burnt, "reserved": len(idx.reserved_by),
            **self.totals,
        })
