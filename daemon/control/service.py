"""Request handlers: translate control messages into calls on the index and back.

Handlers are plain methods on plain state; the server owns the sockets. A handler either
returns its reply (almost all of them) or, for a lookup that may wait on pending keys, a
coroutine the server runs as a task. Anything a client sends that does not make sense is
answered with ``RequestError`` (a typed ``Error`` reply) before any state is changed.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from kvoffload.daemon.base import KeyStatus
from kvoffload.daemon.config import Config
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.control.errors import MAX_KEY_BYTES, RequestError
from kvoffload.daemon.control.errors import bad_request as _bad
from kvoffload.daemon.control.leases import ClientState, Leases, drop_pin, take_pin
from kvoffload.daemon.control.quotas import Quotas
from kvoffload.daemon.control.registration import (  # noqa: F401 - re-exported: callers use service.X
    MAX_NAMESPACES,
    MAX_SLOTS,
    MIN_SLOTS,
    size_pool,
    validate_geometry,
)
from kvoffload.daemon.control.steps import MAX_ITEM_TOKENS, StepHandler
from kvoffload.daemon.control.upkeep import ServiceUpkeep
from kvoffload.daemon.lookup.cost import TailCost, TimeModel
from kvoffload.daemon.lookup.handler import LookupHandler
from kvoffload.daemon.ops.metrics import DaemonMetrics
from kvoffload.daemon.store.index import BlockIndex, Namespace
from kvoffload.daemon.store.session_file import SessionFile
from kvoffload.daemon.store.shared_index import index_path_for
from kvoffload.daemon.streams.publish import DaemonEvents

log = logging.getLogger("kvoffload.daemon")

class Service(ServiceUpkeep):
    def __init__(self, config: Config, index: BlockIndex, metrics: DaemonMetrics,
                 events: DaemonEvents) -> None:
        self.config = config
        self.index = index
        self.metrics = metrics
        self.events = events
        index.on_ready.append(events.stored)
        index.on_drop.append(events.dropped)
        index.on_abort.append(lambda ns, key, slot: events.forget(slot))
        index.on_cancel.append(self._handover_cancelled)
        self.leases = Leases(config.lease_ms, config.max_clients, config.max_clients_per_peer)
        self.quotas = Quotas(config, index, metrics)
        self.daemon_id = uuid.uuid4().hex
        self.draining = False
        self._pending_owner: dict[int, ClientState] = {}
        self.totals: Counter[str] = Counter()  # lifetime counters for the Stats reply
        self.lookups = LookupHandler(index, metrics, events, self.totals)
        self.steps = StepHandler(index, metrics, events, self.totals, config.max_reserved_slots)
        self.steps.pending_owner = self._pending_owner
        self.steps.quotas = self.lookups.quotas = self.quotas
        if config.shared_index:
            index.share(str(index_path_for(index.pool.path)), self.daemon_id)
        self.http_url = ""
        index.on_ready.append(self._block_added)
        index.on_drop.append(self._block_removed)
        self.handlers: dict[type, Callable[[ClientState, Any], Any]] = {
            p.Hello: self.hello, p.Register: self.register, p.Lookup: self._lookup,
            p.Probe: self.probe, p.PrepareStore: self.prepare_store,
            p.CommitStore: self.commit_store, p.PinLoad: self.pin_load,
            p.CompleteLoad: self.complete_load, p.Touch: self.touch,
            p.Heartbeat: self.heartbeat, p.Stats: self.stats, p.Reset: self.reset,
            p.Bye: self.bye, p.Step: self.step,
        }

    # -- dispatch ---------------------------------------------------------------------

    def handle(self, identity: bytes, msg: p._Msg,
               peer: str = "") -> p._Msg | Awaitable[p._Msg]:
        """Answer one decoded request; raises RequestError for a typed error reply.
        ``peer``: who connected (CURVE key or tcp address), for the identities-per-peer cap."""
        self.metrics.requests.labels(type(msg).__name__.lower()).inc()
        if self.draining and not isinstance(msg, (p.CommitStore, p.CompleteLoad, p.Heartbeat,
                                                  p.Bye, p.Step)):
            raise RequestError(p.ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        client = self.leases.seen(identity, peer)
        if client is None:
            if self.leases.refusal == "peer":
                self.metrics.refused.labels("peer_identities").inc()
                raise RequestError(p.ErrorCode.TOO_LARGE, "this peer holds "
                                   f"{self.config.max_clients_per_peer} client identities "
                                   "already (max_clients_per_peer)")
            raise RequestError(p.ErrorCode.TOO_LARGE,
                               f"client limit reached ({self.config.max_clients})")
        for field in ("keys", "items", "queries", "pins", "releases", "claims", "commits",
                      "aborts", "unreserve", "finds", "lookups"):
            n = len(getattr(msg, field, ()))
            if n > self.config.max_keys_per_request:
                raise RequestError(p.ErrorCode.TOO_LARGE, f"{n} {field} in one request; the "
                                   f"limit is {self.config.max_keys_per_request}")
        engine = getattr(msg, "engine", None)
        if engine is not None and engine not in client.engines:
            # Handles are per client and per daemon run: after a restart an old handle may
            # name another namespace, so nobody may use one it did not get from Register.
            raise RequestError(p.ErrorCode.NOT_REGISTERED,
                               f"engine {engine} is not registered by this client with daemon "
                               f"{self.daemon_id}")
        return self.handlers[type(msg)](client, msg)

    def _ns(self, engine: int) -> Namespace:
        if not 0 <= engine < len(self.index.namespaces):
            raise RequestError(p.ErrorCode.NOT_REGISTERED,
                               f"engine {engine} is not registered with daemon {self.daemon_id}")
        return self.index.namespaces[engine]

    def _check_keys(self, ns: Namespace, keys: Sequence[bytes]) -> None:
        g = ns.geometry
        for key in keys:
            try:
                if not 4 < len(key) <= MAX_KEY_BYTES:
                    raise ValueError
                g.group_pos(key)
            except ValueError:
                raise _bad(f"key {key[:8].hex()}... is not a block hash plus one of this "
                           f"engine's {len(g.groups)} group ids") from None

    # -- session ----------------------------------------------------------------------

    def hello(self, client: ClientState, msg: p.Hello) -> p.Welcome:
        if msg.version != p.PROTOCOL_VERSION:
            raise RequestError(p.ErrorCode.UNSUPPORTED_VERSION,
                               f"protocol {msg.version} unsupported; this daemon speaks "
                               f"{p.PROTOCOL_VERSION}")
        client.name = msg.client[:200]
        if msg.lease_ms is not None:
            client.lease_ms = max(100, min(msg.lease_ms, 10 * self.config.lease_ms))
        self.metrics.clients.set(len(self.leases))
        return p.Welcome(rid=msg.rid, version=p.PROTOCOL_VERSION, daemon_id=self.daemon_id,
                         lease_ms=client.lease_ms, pool_path=str(self.index.pool.path),
                         pool_bytes=self.index.pool.pool_bytes,
                         max_keys_per_request=self.config.max_keys_per_request)

    def register(self, client: ClientState, msg: p.Register) -> p.Registered:
        """Answer a Register, timed refusals included: the first one sizes the pool's slots
        and publishes the shared index, the wait an engine's attach must outlast."""
        started = time.perf_counter()
        try:
            return self._register(client, msg)
        finally:
            self.metrics.register_seconds.observe(time.perf_counter() - started)

    def _register(self, client: ClientState, msg: p.Register) -> p.Registered:
        g = msg.geometry
        validate_geometry(g, msg.rank)
        rates = (msg.prefill_tokens_per_s, msg.copy_bytes_per_s)
        if not all(0 <= r < float("inf") for r in rates):  # NaN fails both comparisons
            raise _bad("prefill_tokens_per_s and copy_bytes_per_s must be finite and >= 0")
        if msg.data_parallel_rank is not None and not 0 <= msg.data_parallel_rank < 1 << 16:
            raise _bad("data_parallel_rank must be 0..65535")
        pool = self.index.pool
        if not pool.configured:
            size_pool(self.index, g, self.config.slot_bytes)
        if g.slot_bytes() > pool.slot_bytes:
            raise RequestError(p.ErrorCode.GEOMETRY_MISMATCH,
                               f"one block of this engine needs {g.slot_bytes()} bytes; pool "
                               f"slots hold {pool.slot_bytes} (set slot_bytes for the largest "
                               "engine on this node)")
        if pool.slot_bytes % g.tp_world_size:
            # Each rank copies its page at rank * (slot // world): the workers refuse a slot
            # that does not split evenly, so refuse the engine here, before its first step.
            raise RequestError(p.ErrorCode.GEOMETRY_MISMATCH,
                               f"pool slots of {pool.slot_bytes} bytes do not split into "
                               f"{g.tp_world_size} equal rank pages (set slot_bytes to a "
                               "multiple of every tensor-parallel size on this node)")
        if g.namespace not in self.index.names and len(self.index.namespaces) >= MAX_NAMESPACES:
            raise RequestError(p.ErrorCode.TOO_LARGE, f"{MAX_NAMESPACES} namespaces are "
                               "registered already; engines must share namespaces")
        try:
            ns = self.index.namespace(g)
        except ValueError as exc:
            raise RequestError(p.ErrorCode.GEOMETRY_MISMATCH, str(exc)) from None
        if all(rates):  # the latest engine's time model serves its namespace
            ns.cost = TailCost(g, TimeModel(*rates))
            self.index.republish(ns)
        client.engines.add(ns.id)
        client.owner = self.index.owner_id(msg.instance)
        shared = self.index.shared
        if msg.supersedes:
            self._supersede_session(client, msg.supersedes)
        if msg.reads_index and shared is not None and not client.reads_index:
            try:
                client.session = SessionFile(shared.path)
            except OSError as exc:
                raise RequestError(p.ErrorCode.INTERNAL,
                                   f"cannot create this engine's session file: {exc}") from None
            client.reads_index = True
            client.writer_lock = msg.writer_lock
            self.index.reclaimer.add_reader(client.identity, self.index.epoch, client.session)
        self.metrics.engines.set(len(self.index.namespaces))
        self._update_pool_gauges()
        self.events.engine_registered(msg.data_parallel_rank, msg.instance)  # its event view
        return p.Registered(
            rid=msg.rid, engine=ns.id, slot_bytes=pool.slot_bytes,
            rank_bytes=pool.slot_bytes // g.tp_world_size, num_slots=pool.num_slots,
            pool_path=str(pool.path), daemon_id=self.daemon_id,
            index_path=str(shared.path) if shared is not None else "",
            readers_path=str(client.session.path) if client.session is not None else "",
            reader_record=0 if client.session is not None else -1, epoch=self.index.epoch,
            has_tiers=self.lookups.tiers is not None)

    def _supersede_session(self, client: ClientState, old_path: str) -> None:
        """The same engine re-attached: its earlier session releases what it held now, not
        after its lease (its grants revoked and quarantined while its workers may copy).
        Named by its session file's path, which only that engine was told."""
        old = next((c for c in self.leases.clients.values() if c is not client
                    and c.session is not None and str(c.session.path) == old_path), None)
        if old is None:
            return
        released = self._release_client(old)
        self.leases.remove(old)
        self.totals["sessions_superseded"] += 1
        log.info("engine %r re-attached: its earlier session released %d pins and stores",
                 client.name, released)

    def heartbeat(self, client: ClientState, msg: p.Heartbeat) -> p.Ack:
        return p.Ack(rid=msg.rid)

    def bye(self, client: ClientState, msg: p.Bye) -> p.Ack:
        """A clean goodbye: release what the client holds now, not after its lease."""
        pending = len(client.pending)
        released = self._release_client(client, fence=False)
        self.metrics.stores.labels("aborted").inc(pending)
        self.leases.remove(client)
        self.metrics.clients.set(len(self.leases))
        return p.Ack(rid=msg.rid, count=released)

    def _block_added(self, ns: Namespace, key: bytes, slot: int) -> None:
        kind = ns.geometry.groups[ns.geometry.group_pos(key)].kind.value
        self.metrics.blocks.labels(kind, "cpu").inc()

    def _block_removed(self, ns: Namespace, key: bytes, slot: int) -> None:
        kind = ns.geometry.groups[ns.geometry.group_pos(key)].kind.value
        self.metrics.blocks.labels(kind, "cpu").dec()

    # -- lookups ----------------------------------------------------------------------

    def _lookup(self, client: ClientState, msg: p.Lookup) -> p._Msg | Awaitable[p._Msg]:
        return self.lookups.lookup(client, self._ns(msg.engine), msg)

    def probe(self, client: ClientState, msg: p.Probe) -> p.ProbeReply:
        ns = self._ns(msg.engine)
        self._check_keys(ns, msg.keys)
        # list[int]: the wire type (a KeyStatus is an int; list[KeyStatus] is not list[int]).
        statuses: list[int] = [self.index.status(ns, k) for k in msg.keys]
        if self.lookups.tiers is not None:  # keys a lower tier holds: promotion starts
            statuses = [self.lookups.tiers.probe(ns, k) if s is KeyStatus.MISS else s
                        for k, s in zip(msg.keys, statuses, strict=True)]
        return p.ProbeReply(rid=msg.rid, statuses=statuses)

    # -- stores -----------------------------------------------------------------------

    def prepare_store(self, client: ClientState, msg: p.PrepareStore) -> p.StoreGrant:
        ns = self._ns(msg.engine)
        self._check_keys(ns, [it.key for it in msg.items])
        if any(not 0 <= it.end_token < 1 << 32 for it in msg.items):  # index stores uint32
            raise _bad("end_token must be in 0..2**32-1")
        if any(it.token_ids and len(it.token_ids) > MAX_ITEM_TOKENS for it in msg.items):
            self.metrics.refused.labels("token_ids").inc()  # kept to the commit: as in a Step
            raise _bad(f"a store item has over {MAX_ITEM_TOKENS} token ids; that is the limit")
        outcomes: list[p.StoreOutcome] = []
        slots: list[int] = []
        evicted: list[bytes] = []
        room = self.quotas.room_pending(client)
        for item in msg.items:
            if item.tail and ns.cost is not None and not ns.cost.admit_tail(item.end_token):
                # A later hit on this tail would cost more to load than to recompute.
                outcomes.append(p.StoreOutcome.NOT_WORTH)
                slots.append(-1)
                self.metrics.stores.labels("not_worth").inc()
                self.metrics.tails_declined.labels("store").inc()
                continue
            if room <= 0 and self.index.status(ns, item.key) is KeyStatus.MISS:
                # This client holds its share already: refused and counted, never granted.
                outcomes.append(p.StoreOutcome.QUOTA)
                slots.append(-1)
                self.metrics.stores.labels("quota").inc()
                self.quotas.refused("pending")
                continue
            got = self.index.prepare(ns, item.key, item.end_token, item.tail, client.owner)
            evicted.extend(key for victim_ns, key, _ in got.evicted if victim_ns is ns)
            if got.evicted:
                self.metrics.evictions.labels(self.index.policy.name, "capacity").inc(
                    len(got.evicted))
            if got.slot is not None:
                outcome = p.StoreOutcome.GRANTED
                self.events.remember(got.slot, item)
                client.pending.add(got.slot)
                self._pending_owner[got.slot] = client
                room -= 1
            else:
                outcome = p.StoreOutcome.EXISTS if got.exists else p.StoreOutcome.NO_SPACE
            outcomes.append(outcome)
            slots.append(-1 if got.slot is None else got.slot)
            self.metrics.stores.labels(outcome.value).inc()
        self._update_pool_gauges()
        return p.StoreGrant(rid=msg.rid, outcomes=outcomes, slots=slots, evicted=evicted)

    def _close_pending(self, slot: int) -> None:
        owner = self._pending_owner.pop(slot, None)
        if owner is not None:
            owner.pending.discard(slot)

    def commit_store(self, client: ClientState, msg: p.CommitStore) -> p.Ack:
        ns = self._ns(msg.engine)
        self._check_keys(ns, msg.keys)
        done = 0
        for key in msg.keys:
            slot = ns.keys.get(key)
            if slot is None or slot not in client.pending:
                continue  # not a store of this client's: not its to close
            ok = self.index.commit(ns, key) if msg.ok else self.index.abort(ns, key)
            if ok:
                done += 1
                self._close_pending(slot)
        self.metrics.stores.labels("committed" if msg.ok else "aborted").inc(done)
        if msg.ok:
            self.metrics.stored_bytes.inc(done * self.index.pool.slot_bytes)
        self._update_pool_gauges()
        return p.Ack(rid=msg.rid, count=done)

    # -- loads ------------------------------------------------------------------------

    def pin_load(self, client: ClientState, msg: p.PinLoad) -> p.LoadGrant:
        ns = self._ns(msg.engine)
        self._check_keys(ns, msg.keys)
        slots = []
        room = self.quotas.room_pins(client)
        for key in msg.keys:
            slot = self.index.ready_slot(ns, key)
            if slot is None:
                slots.append(-1)
                self.metrics.loads.labels("missing").inc()
                continue
            if room <= 0:  # its pins hold its share of the pool: not pinned, counted
                slots.append(-1)
                self.metrics.loads.labels("quota").inc()
                self.quotas.refused("pins")
                continue
            room -= 1
            take_pin(self.index, client, slot)
            self.index.touch(slot)
            slots.append(slot)
            self.metrics.loads.labels("pinned").inc()
            self.metrics.loaded_bytes.inc(self.index.pool.slot_bytes)
        self._update_pool_gauges()
        return p.LoadGrant(rid=msg.rid, slots=slots)

    def complete_load(self, client: ClientState, msg: p.CompleteLoad) -> p.Ack:
        ns = self._ns(msg.engine)
        self._check_keys(ns, msg.keys)
        done = 0
        for key in msg.keys:
            slot = ns.keys.get(key)
            if slot is not None and drop_pin(self.index, client, slot):
                self.index.touch(slot)  # the block was just reused: most recent now
                done += 1
        self.metrics.loads.labels("completed").inc(done)
        self._update_pool_gauges()
        return p.Ack(rid=msg.rid, count=done)

    def touch(self, client: ClientState, msg: p.Touch) -> p.Ack:
        ns = self._ns(msg.engine)
        self._check_keys(ns, msg.keys)
        slots = [s for s in (self.index.ready_slot(ns, k) for k in msg.keys) if s is not None]
        for slot in slots:
            self.index.touch(slot)
        return p.Ack(rid=msg.rid, count=len(slots))

    def step(self, client: ClientState, msg: p.Step) -> p.StepReply:
        ns = self._ns(msg.engine)
        # Every key it names, checked before anything changes (a bad one refuses the step).
        self._check_keys(ns, [r.key for refs in (msg.pins, msg.releases, msg.commits,
                                                 msg.aborts) for r in refs]
                         + [c.item.key for c in msg.claims] + list(msg.finds)
                         + list(msg.touches))
        if self.draining:
            # Its releases, commits, aborts and unreserves still apply (the drain waits for
            # pins to go); nothing new is pinned, claimed, reserved or fetched.
            lost, refused = [r.key for r in msg.pins], [c.item.key for c in msg.claims]
            msg = msgspec.structs.replace(msg, pins=[], claims=[], reserve=0, finds=[])
        reply = self.steps.handle(client, ns, msg)
        if self.draining:
            reply.lost += lost
            reply.refused += refused
        self._update_pool_gauges()
        return reply

    def reset(self, client: ClientState, msg: p.Reset) -> p.Ack:
        if msg.scope not in ("namespace", "own"):
            raise _bad("scope must be 'namespace' or 'own'")
        ns = self._ns(msg.engine)
        # Other engines' blocks need their consent or the operator. A client that named no
        # engine instance (owner 0) shares "own" with every other anonymous one: same rule.
        if msg.scope == "namespace" or client.owner == 0:
            self.quotas.check_reset(client, ns, self.leases, msg.credential)
        owner = client.owner if msg.scope == "own" else None
        count = self.index.reset(ns, owner)
        self.metrics.evictions.labels(self.index.policy.name, "reset").inc(count)
        self._update_pool_gauges()
        return p.Ack(rid=msg.rid, count=count)

