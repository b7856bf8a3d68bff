"""Per-client quotas and the namespace-reset rule (docs/security.md, "Quotas").

One client (one DEALER identity) may hold at once at most:

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

    def _share(self) -> int:
        n = self.index.pool.num_slots
        return max(min(FLOOR_SLOTS, n), n * self.config.client_pool_share_pct // 100)

    @staticmethod
    def held(client: ClientState) -> int:
        """Slots this client keeps from everyone else now."""
        return len(client.pins) + len(client.pending) + len(client.reserved)

    def _limit(self) -> int | None:
        """Slots one client may hold; None when that is the whole pool (then the pool's own
        ``no_space`` answers, not a quota)."""
        share = self._share()
        return None if share >= self.index.pool.num_slots else share

    def room_pending(self, client: ClientState) -> int:
        """How many more slots this client may prepare, claim or reserve now."""
        limit = self._limit()
        cap = self.config.client_max_pending or limit or UNLIMITED
        room = cap - len(client.pending) - len(client.reserved)
        if limit is not None:
            room = min(room, limit - self.held(client))
        return max(0, room)

    def room_pins(self, client: ClientState) -> int:
        """How many more pins this client may take now (a second pin of a slot counts too)."""
        limit = self._limit()
        cap = self.config.client_max_pins or limit or UNLIMITED
        room = cap - sum(client.pins.values())
        if limit is not None:
            room = min(room, limit - self.held(client))
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
