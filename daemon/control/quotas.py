"""Per-client quotas and the namespace-reset rule (docs/security.md, "Quotas").

A quota is counted per *client group*, not per connection, so that opening more connections
gets a process no more of the pool: the clients of one engine (``Register.instance``: its
sessions across re-attaches) form one group, else the clients of one process (on ipc, the
pid libzmq reads from the socket's SO_PEERCRED), else one connection is its own group (tcp,
or an ipc peer in another pid namespace). One group may hold at once at most:

* ``pending``: slots it prepared or claimed and has not committed, plus its reservation
  (``client_max_pending``; 0: the pool share's number of slots);
* ``pins``: load pins (``client_max_pins``; 0: the share's number);
* together, slots held as pins, pending stores or reservations: ``client_pool_share_pct`` of
  the pool's slots (never fewer than 64 slots, or the whole of a smaller pool), so one
  heart-beating client cannot hold the pool and starve the others. A share that is the whole
  pool is no quota (the pool's own ``no_space`` answers).

A refusal is never silent: a store gets ``StoreOutcome.QUOTA`` (or a shorter reservation), a
pin is answered as not pinned (``-1`` / ``lost``), and each is counted in
``kvoffload_refused_total{reason="quota_pending"|"quota_pins"}``.
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from collections.abc import Container, Sized
from typing import Protocol

from kvoffload.daemon.config import Config
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.control.errors import RequestError
from kvoffload.daemon.control.leases import ClientState, Leases
from kvoffload.daemon.ops.metrics import DaemonMetrics
from kvoffload.daemon.store.index import BlockIndex, Namespace

log = logging.getLogger("kvoffload.daemon")

# A share is never smaller than this many slots (or the whole pool, when it has fewer): a small
# pool is not split below what one long request stores or loads at once.
FLOOR_SLOTS = 64
UNLIMITED = 1 << 62

GroupKey = tuple[str, int | bytes]


class _Live(Container[bytes], Sized, Protocol):
    """The identities of the clients with a lease (``Leases.clients``)."""


def read_operator_token(path: str | None) -> str | None:
    """The operator credential, from a file only its owner can read (like a secret key)."""
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ValueError(f"operator_token_file {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise ValueError(f"operator_token_file {path}: must be a regular file readable by "
                             "its owner only (chmod 600)")
        token = os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)
    if len(token) < 16:
        raise ValueError(f"operator_token_file {path}: the credential must be at least 16 "
                         "characters")
    return token


class Quotas:
    def __init__(self, config: Config, index: BlockIndex, metrics: DaemonMetrics) -> None:
        self.config = config
        self.index = index
        self.metrics = metrics
        self.operator_token = read_operator_token(config.operator_token_file)
        for reason in ("quota_pending", "quota_pins", "peer_identities", "reset_forbidden"):
            metrics.refused.labels(reason)
        self._pid: dict[bytes, int] = {}  # identity -> the pid behind its ipc connection
        self._group_of: dict[bytes, GroupKey] = {}
        self._groups: dict[GroupKey, dict[bytes, ClientState]] = {}

    def note_client(self, identity: bytes, pid: int, live: _Live) -> None:
        """A frame of an identity without a lease: the pid of its connection (0: unknown).
        Forgets identities gone from ``live`` once there are twice as many (amortized)."""
        if pid > 0:
            self._pid[identity] = pid
        if len(self._group_of) + len(self._pid) > 4 * len(live) + 256:
            self._pid = {i: v for i, v in self._pid.items() if i in live}
            for ident in [i for i in self._group_of if i not in live]:
                self._leave(ident)

    def group(self, client: ClientState) -> GroupKey:
        if client.owner:  # the engine it registered as, in every session of it
            return ("engine", client.owner)
        pid = self._pid.get(client.identity)
        return ("process", pid) if pid else ("client", client.identity)

    def _leave(self, identity: bytes) -> None:
        key = self._group_of.pop(identity, None)
        if key is None:
            return
        members = self._groups.get(key, {})
        members.pop(identity, None)
        if not members:
            self._groups.pop(key, None)

    def members(self, client: ClientState) -> list[ClientState]:
        """The clients that share ``client``'s quotas, itself included. A member holding
        nothing is dropped (it counts nothing); it joins again when it asks for room, which
        every path that takes a slot or a pin does first."""
        key = self.group(client)
        if self._group_of.get(client.identity) != key:  # new, or registered since
            self._leave(client.identity)
            self._group_of[client.identity] = key
        group = self._groups.setdefault(key, {})
        group[client.identity] = client  # the live state (a new one after a Bye)
        for ident, other in list(group.items()):
            if other is not client and not self.held(other):
                del group[ident]
                self._group_of.pop(ident, None)
        return list(group.values())

    def _share(self) -> int:
        n = self.index.pool.num_slots
        return max(min(FLOOR_SLOTS, n), n * self.config.client_pool_share_pct // 100)

    @staticmethod
    def held(client: ClientState) -> int:
        """Slots this client keeps from everyone else now."""
        return len(client.pins) + len(client.pending) + len(client.reserved)

    def _limit(self) -> int | None:
        """Slots one group may hold; None when that is the whole pool (then the pool's own
        ``no_space`` answers, not a quota)."""
        share = self._share()
        return None if share >= self.index.pool.num_slots else share

    def room_pending(self, client: ClientState) -> int:
        """How many more slots this client may prepare, claim or reserve now."""
        group = self.members(client)
        limit = self._limit()
        cap = self.config.client_max_pending or limit or UNLIMITED
        room = cap - sum(len(c.pending) + len(c.reserved) for c in group)
        if limit is not None:
            room = min(room, limit - sum(map(self.held, group)))
        return max(0, room)

    def room_pins(self, client: ClientState) -> int:
        """How many more pins this client may take now (a second pin of a slot counts too)."""
        group = self.members(client)
        limit = self._limit()
        cap = self.config.client_max_pins or limit or UNLIMITED
        room = cap - sum(sum(c.pins.values()) for c in group)
        if limit is not None:
            room = min(room, limit - sum(map(self.held, group)))
        return max(0, room)

    def refused(self, kind: str, n: int = 1) -> None:
        if n > 0:
            self.metrics.refused.labels(f"quota_{kind}").inc(n)

    def check_reset(self, client: ClientState, ns: Namespace, leases: Leases,
                    credential: str) -> None:
        """Refuse (``forbidden``) a namespace reset the policy does not allow."""
        rule = self.config.reset_namespace
        if rule == "any":
            return
        token = self.operator_token
        if token is not None and credential and hmac.compare_digest(
                credential.encode(), token.encode()):
            return
        others = sum(1 for c in leases.clients.values()
                     if c is not client and ns.id in c.engines)
        if rule == "sole" and others == 0:
            return
        self.metrics.refused.labels("reset_forbidden").inc()
        why = ("only the operator credential allows it" if rule == "operator" else
               f"{others} other client(s) registered namespace {ns.geometry.namespace!r}; "
               "only its sole client or the operator credential may drop it")
        raise RequestError(p.ErrorCode.FORBIDDEN, f"Reset(scope='namespace') refused: {why}; "
                           "scope='own' drops this engine's own blocks")
