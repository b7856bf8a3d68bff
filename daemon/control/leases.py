"""Clients, their leases, and what each one holds (pins, pending stores).

Every message renews its sender's lease, and so does the heartbeat an index-reading engine's
background thread stamps into its session file (vLLM does not step an idle engine: an idle
engine is alive, and keeps what it was granted). A sweeper (``expired``) runs a few times per
lease period; a client whose lease ran out loses its pins and its pending stores, so a killed
or frozen engine never strands pinned or half-written slots.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvoffload.daemon.store.index import BlockIndex
    from kvoffload.daemon.store.session_file import SessionFile


@dataclass(slots=True)
class ClientState:
    identity: bytes
    name: str = ""
    lease_ms: int = 10_000
    last_seen: float = field(default_factory=time.monotonic)
    pins: Counter[int] = field(default_factory=Counter)  # slot -> pins held by this client
    pending: set[int] = field(default_factory=set)  # slots this client prepared, not closed
    reserved: set[int] = field(default_factory=set)  # empty slots held for its next stores
    engines: set[int] = field(default_factory=set)  # namespaces it registered (its handles)
    owner: int = 0  # its engine instance's owner id (who stored a block)
    reads_index: bool = False
    # Its session file (reader record, heartbeat, its writers' lock), while it reads the index.
    session: SessionFile | None = None
    writer_lock: bool = False  # its workers hold the session's lock while they copy
    peer: str = ""  # who connected (CURVE key or tcp address; "" on ipc): identities per peer

    def expires_at(self) -> float:
        return self.last_seen + self.lease_ms / 1000


def take_pin(index: BlockIndex, client: ClientState, slot: int) -> None:
    """Pin a slot for a load on behalf of ``client`` (released on completion or expiry)."""
    index.pin(slot)
    client.pins[slot] += 1


def drop_pin(index: BlockIndex, client: ClientState, slot: int) -> bool:
    """Release one of ``client``'s pins on ``slot``; False when it held none."""
    if client.pins[slot] <= 0:
        client.pins.pop(slot, None)
        return False
    client.pins[slot] -= 1
    if not client.pins[slot]:
        del client.pins[slot]
    index.unpin(slot)
    return True


class Leases:
    def __init__(self, default_lease_ms: int, max_clients: int,
                 max_per_peer: int | None = None) -> None:
        self.default_lease_ms = default_lease_ms
        self.max_clients = max_clients
        # One peer (a CURVE key, a tcp address) may not take every identity: others must
        # still get in. Peers on ipc ("") are the daemon's own user and are not limited.
        self.max_per_peer = max_clients if max_per_peer is None else max_per_peer
        self.clients: dict[bytes, ClientState] = {}
        self.per_peer: Counter[str] = Counter()
        self.refusal = ""  # why the last ``seen`` returned None: "clients" or "peer"

    def seen(self, identity: bytes, peer: str = "") -> ClientState | None:
        """Renew and return the sender's state; None when a new client would exceed a cap
        (``refusal`` says which)."""
        state = self.clients.get(identity)
        if state is None:
            if len(self.clients) >= self.max_clients:
                self.refusal = "clients"
                return None
            if peer and self.per_peer[peer] >= self.max_per_peer:
                self.refusal = "peer"
                return None
            state = self.clients[identity] = ClientState(identity, lease_ms=self.default_lease_ms,
                                                         peer=peer)
            if peer:
                self.per_peer[peer] += 1
        else:
            state.last_seen = time.monotonic()
        return state

    def remove(self, client: ClientState) -> None:
        if self.clients.pop(client.identity, None) is not None and client.peer:
            self.per_peer[client.peer] -= 1
            if self.per_peer[client.peer] <= 0:
                del self.per_peer[client.peer]

    def expired(self, now: float | None = None) -> list[ClientState]:
        """Remove and return every client whose lease ran out."""
        now = time.monotonic() if now is None else now
        gone = []
        for c in self.clients.values():
            if c.expires_at() > now:
                continue
            if c.session is not None and now - c.session.heartbeat_ns() / 1e9 < c.lease_ms / 1000:
                c.last_seen = now  # silent but alive: its heartbeat is fresh
                continue
            gone.append(c)
        for c in gone:
            self.remove(c)
        return gone

    def __len__(self) -> int:
        return len(self.clients)
