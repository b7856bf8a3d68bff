"""The hybrid-chat ``shared_tier`` run: two nodes (two embedded daemons, separate pools of the
same small size) behind a load balancer without prefix affinity, sharing one real Mooncake
Store (a ``mooncake_master`` this module starts on free ports and kills at the end).

Each turn goes to a node picked at random (seeded), so about half the turns of a conversation
land on the node that did not serve its previous turn. Pool only: the same split, each node
sees only its own stores. Shared: both daemons run the Mooncake tier (``mooncake_put``
"commit": every committed block is pushed, so the other node can use it at once); a pool miss
asks the store, and the lookup parks (``wait_ms``) on the check and the promotion.

Simulated TTFT = the time model + each block fetched from the store at its full size over an
assumed network rate (``NETWORK_BYTES_PER_S``), serially before the load.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvoffload.bench.sim import EmbeddedDaemon, OursEngine, Totals
from kvoffload.bench.workload import PRESETS, Turn
from kvoffload.daemon.lookup.cost import TailCost

__all__ = ["NETWORK_BYTES_PER_S", "mooncake_unavailable", "run_shared_tier"]

# Assumption, not measured: what one node pulls from another over a 100 Gb/s NIC (12.5 GB/s
# line rate, no protocol overhead, no contention). The bench moves 64-byte blocks over
# loopback TCP, so a block fetched from the store costs its full-size bytes at this rate.
NETWORK_BYTES_PER_S = 12.5e9
# Memory each daemon lends to the store (the store's capacity is the sum of both): room for
# every block of the full run (~150 B each at this scale), so the store never evicts.
SEGMENT_BYTES = 64 << 20
BUFFER_BYTES = 16 << 20  # client staging buffer; bounds one put batch
WAIT_MS = 10_000  # lookups park on store checks and promotions; never reached here
CONNECT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _master_binary() -> Path | None:
    here = Path(sys.executable).parent / "mooncake_master"
    found = shutil.which("mooncake_master")
    return here if here.exists() else Path(found) if found else None


def mooncake_unavailable() -> str | None:
    """Why the shared-tier run cannot happen here, or None."""
    from kvoffload.daemon.tiers.mooncake.values import load_store_class

    try:
        load_store_class()
    except (ImportError, OSError) as exc:  # the wheel, or libibverbs1 / librdmacm1 / libnuma1
        return f"mooncake store client cannot load: {exc}"
    if _master_binary() is None:
        return "mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)"
    return None


class MooncakeMaster:
    """A ``mooncake_master`` with its built-in HTTP metadata server, on free local ports."""

    def __init__(self) -> None:
        self.rpc, self.http = _free_port(), _free_port()
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in __exit__
            prefix="kvo-mc-master-", suffix=".log")
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> MooncakeMaster:
        binary = _master_binary()
        assert binary is not None
        self.proc = subprocess.Popen(
            [str(binary), f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http}", f"--metrics_port={_free_port()}"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + CONNECT_S
        while True:
            if self.proc.poll() is not None:
                self._log.seek(0)
                raise RuntimeError(f"mooncake_master exited: {self._log.read()[-2000:]!r}")
            try:
                for port in (self.rpc, self.http):
                    socket.create_connection(("127.0.0.1", port), 0.2).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError("mooncake_master did not listen in time") from None
                time.sleep(0.05)

    def config(self) -> dict[str, Any]:
        """The daemon Config fields of a node against this master."""
        return {"mooncake_master": f"127.0.0.1:{self.rpc}",
                "mooncake_metadata": f"http://127.0.0.1:{self.http}/metadata",
                "mooncake_local_hostname": "127.0.0.1", "mooncake_put": "commit",
                "mooncake_segment_bytes": SEGMENT_BYTES, "mooncake_buffer_bytes": BUFFER_BYTES}

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def _connected(d: EmbeddedDaemon) -> None:
    """Wait until the node's tier is connected and healthy (setup runs in its own thread)."""
    deadline = time.monotonic() + CONNECT_S
    while d.call(lambda s: s.mooncake.degraded):
        if time.monotonic() > deadline:
            raise RuntimeError("daemon's mooncake tier did not connect in time")
        time.sleep(0.05)


def route(turns: list[Turn], seed: int) -> tuple[list[int], list[bool]]:
    """A node (0 or 1) per turn, at random: a load balancer without prefix affinity. Also
    returns, per turn, whether it lands on another node than its conversation's previous
    turn (where only the store can serve the history)."""
    rng = random.Random(f"shared-tier-{seed}")
    nodes = [rng.randrange(2) for _ in turns]
    last: dict[int, int] = {}
    switched = []
    for turn, node in zip(turns, nodes, strict=True):
        switched.append(last.get(turn.conversation, node) != node)
        last[turn.conversation] = node
    return nodes, switched


def _two_nodes(turns: list[Turn], nodes: list[int], slots: int, cost: TailCost, preset: str,
               scale: float, master: MooncakeMaster | None,
               tier_stats: list[dict[str, int]]) -> Totals:
    """Both nodes' turns in workload order; one Totals for the pair (TTFT charges fetched
    bytes at the network rate)."""
    geometry = PRESETS[preset].geometry(scale)
    extra = master.config() if master is not None else None
    totals = Totals(cost.model, disk_read_bytes_per_s=NETWORK_BYTES_PER_S)
    with EmbeddedDaemon(slots * geometry.slot_bytes(), slot_bytes=geometry.slot_bytes(),
                        extra=extra) as a, \
            EmbeddedDaemon(slots * geometry.slot_bytes(), slot_bytes=geometry.slot_bytes(),
                           extra=extra) as b:
        daemons = (a, b)
        clients = [d.client() for d in daemons]
        try:
            if master is not None:
                for d in daemons:
                    _connected(d)
            engines = []
            for d, client in zip(daemons, clients, strict=True):
                client.register(geometry)
                engines.append(OursEngine(client, geometry, cost, tails=True, cost_aware=True,
                                          wait_ms=WAIT_MS if master else 0,
                                          promoted_keys=d.promoted_keys if master else None))
            for turn, node in zip(turns, nodes, strict=True):
                totals.add(engines[node].run_turn(turn))
                if master is not None:
                    daemons[node].disk_reads()  # its pushes land before the next request
            if master is not None:
                tier_stats += [d.call(lambda s: dataclasses.asdict(s.mooncake.stats))
                               for d in daemons]
        finally:
            for client in clients:
                client.close()
    return totals


def _variant(totals: Totals, slot_bytes: int, switched: list[bool]) -> dict[str, Any]:
    s = totals.summary()
    # Split: the store serves a node its own evicted blocks too (like a disk tier would).
    s["served_tokens_on_other_node_turns"] = sum(
        t.hit_tokens for t, sw in zip(totals.turns, switched, strict=True) if sw)
    s["fetched_bytes_waited"] = s.pop("disk_bytes_waited")  # from the store, not a disk
    s["fetched_bytes"] = s["promotions"] * slot_bytes
    return s


def run_shared_tier(turns: list[Turn], cost: TailCost, pool_bytes: int, *, preset: str,
                    scale: float, seed: int = 0) -> dict[str, Any]:
    """Pool only vs shared tier, two nodes each: the ``shared_tier`` result (``not_run`` with
    the reason when Mooncake cannot run here)."""
    # The store client logs every metadata lookup at INFO through glog; its MC_LOG_LEVEL is
    # what it honours (not GLOG_minloglevel); errors still show.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    reason = mooncake_unavailable()
    if reason is not None:
        return {"not_run": f"shared tier not run: {reason}"}
    full = cost.geometry
    slots = pool_bytes // full.slot_bytes()
    nodes, switched = route(turns, seed)
    stats: list[dict[str, int]] = []
    pool_only = _two_nodes(turns, nodes, slots, cost, preset, scale, None, stats)
    try:
        with MooncakeMaster() as master:
            shared = _two_nodes(turns, nodes, slots, cost, preset, scale, master, stats)
    except RuntimeError as exc:
        return {"not_run": f"shared tier not run: {exc}"}
    po = _variant(pool_only, full.slot_bytes(), switched)
    sh = _variant(shared, full.slot_bytes(), switched)
    return {
        "nodes": 2, "pool_bytes_full_scale_per_node": slots * full.slot_bytes(),
        "pool_slots_per_node": slots, "routing": "random node per turn (seeded), no affinity",
        "turns_on_other_node": sum(switched), "turns_per_node": [nodes.count(0), nodes.count(1)],
        "mooncake_put": "commit", "segment_bytes_per_node": SEGMENT_BYTES,
        "network_bytes_per_s": NETWORK_BYTES_PER_S,
        "pool_only": po, "shared": sh,
        "served_gain": round(sh["served_tokens"] / max(1, po["served_tokens"]) - 1, 4),
        "ttft_gain": round(1 - sh["ttft_ms_mean"] / max(1e-9, po["ttft_ms_mean"]), 4),
        # Each daemon's Mooncake tier counters (writes: blocks pushed; reads: blocks fetched).
        "tier": [{k: st.get(k, 0) for k in ("writes", "writes_skipped", "write_errors",
                                            "reads", "read_errors", "corrupt")}
                 for st in stats],
    }
