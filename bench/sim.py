"""A simulated engine over the daemon, plus the shared bits (store policy, per-variant totals,
an embedded daemon) the suites use. NOT our plugin in vLLM: hybrid_chat's headline runs the
plugin inside vLLM's scheduler (bench/suites/hybrid_chat.py); this engine is its ``sim_what_if``
(bench/what_if.py), since it stores what vLLM 0.33 lets no connector store (decode tokens,
turn-end tails).

The engine does what bench/demo.py's does, minus the bytes (slots are granted and committed,
nothing is copied: this measures cache decisions, the demo and the copy suite verify bytes):
one pinned ``Lookup`` per request, an optional cost-aware load decision (daemon/lookup/cost.py), the
load's pins released, then a ``PrepareStore`` of every complete chunk of every group over the
tokens computed (prompt and reply, REQUEST_LEVEL-like: the daemon answers EXISTS for what it
holds) plus the partial tails at the prompt's end and the turn's end, and a ``CommitStore``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import statistics
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvoffload.bench.workload import Turn, block_hashes
from kvoffload.connector.client import DaemonClient
from kvoffload.daemon.base import Geometry, make_key
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.lookup.cost import TailCost, TimeModel

T = TypeVar("T")

# Assumption, not measured: sequential read bandwidth of one datacenter NVMe drive (PCIe Gen4
# x4, ~6-7 GB/s). The bench moves no bytes, so a block promoted from the disk tier costs its
# full-size slot bytes at this rate in the simulated TTFT, on top of the time model's copy.
NVME_READ_BYTES_PER_S = 6e9


# ------------------------------------------------------------------------------ store policy


def tail_boundaries(n_prompt: int, n_computed: int, tokens_per_hash: int,
                    block: int) -> list[int]:
    """Where a state snapshot exists inside a block: the prefill's end (vLLM's checkpoint,
    ``round_down(n - 1, tokens_per_hash)``) and the turn's end (hash-aligned)."""
    ends = {(n_prompt - 1) // tokens_per_hash * tokens_per_hash,
            n_computed // tokens_per_hash * tokens_per_hash}
    return sorted(b for b in ends if b > 0 and b % block)


def store_items(geometry: Geometry, hashes: Sequence[bytes], n_prompt: int, *,
                tails: bool = True, admit: Callable[[int], bool] | None = None) -> list[p.StoreItem]:
    """Every complete chunk of every group covered by ``hashes`` (the computed tokens), then
    the tails (``admit`` may refuse a boundary: cost-aware admission)."""
    tph = geometry.tokens_per_hash
    n_computed = len(hashes) * tph
    items: list[p.StoreItem] = []
    for gi, grp in enumerate(geometry.groups):
        chunk = grp.tokens_per_block * geometry.blocks_per_chunk
        items += [p.StoreItem(key=make_key(hashes[end // tph - 1], gi), end_token=end)
                  for end in range(chunk, n_computed + 1, chunk)]
    if tails:
        block = geometry.groups[0].tokens_per_block
        for b in tail_boundaries(n_prompt, n_computed, tph, block):
            if admit is None or admit(b):
                items += [p.StoreItem(key=make_key(hashes[b // tph - 1], gi), end_token=b,
                                      tail=True) for gi in range(len(geometry.groups))]
    return items


# ------------------------------------------------------------------------------ totals


@dataclass
class TurnRecord:
    prompt_tokens: int
    hit_tokens: int
    chunk_tokens: int
    loaded_bytes: int
    stored_keys: int = 0
    stored_bytes: int = 0
    evicted: int = 0
    lookup_calls: int = 0
    round_trips: int = 0
    tail_declined: bool = False  # a tail hit that did not pay, loaded as its chunk hit
    promoted: int = 0  # blocks read back from the disk tier that this lookup waited for
    promoted_bytes: int = 0  # their full-size bytes (a disk tier stores whole slots)
    promoted_late: int = 0  # promotions it started but answered without (pending tails)


@dataclass
class Totals:
    """What workloads.md asks a run to report, for one variant."""

    model: TimeModel = field(default_factory=TimeModel)
    turns: list[TurnRecord] = field(default_factory=list)
    disk_read_bytes_per_s: float = NVME_READ_BYTES_PER_S

    def ttft_s(self, t: TurnRecord) -> float:
        # The lookup waits for its promotions (disk -> pool) before the load (pool -> GPU)
        # starts, so the disk read adds to the time model instead of overlapping it.
        return (self.model.ttft(t.prompt_tokens - t.hit_tokens, t.loaded_bytes)
                + t.promoted_bytes / self.disk_read_bytes_per_s)

    def add(self, rec: TurnRecord) -> None:
        self.turns.append(rec)

    def ttfts_ms(self) -> list[float]:
        return [1000 * self.ttft_s(t) for t in self.turns]

    def summary(self) -> dict[str, Any]:
        t = self.turns
        n = max(1, len(t))
        ttft = sorted(self.ttfts_ms()) or [0.0]
        prompt = sum(x.prompt_tokens for x in t)
        hit = sum(x.hit_tokens for x in t)
        chunk = sum(x.chunk_tokens for x in t)
        return {
            "requests": len(t), "prompt_tokens": prompt, "served_tokens": hit,
            "served_chunk_tokens": chunk, "served_tail_tokens": hit - chunk,
            "recomputed_tokens": prompt - hit, "served_share": round(hit / max(1, prompt), 4),
            "bytes_stored": sum(x.stored_bytes for x in t),
            "bytes_loaded": sum(x.loaded_bytes for x in t),
            "keys_stored": sum(x.stored_keys for x in t),
            "evictions": sum(x.evicted for x in t),
            "tails_declined": sum(x.tail_declined for x in t),
            "promotions": sum(x.promoted + x.promoted_late for x in t),
            "promotions_waited": sum(x.promoted for x in t),
            "disk_bytes_waited": sum(x.promoted_bytes for x in t),
            "lookup_calls_per_request": round(sum(x.lookup_calls for x in t) / n, 2),
            "round_trips_per_request": round(sum(x.round_trips for x in t) / n, 2),
            "ttft_ms_mean": round(statistics.fmean(ttft), 3),
            "ttft_ms_p50": round(percentile(ttft, 50), 3),
            "ttft_ms_p99": round(percentile(ttft, 99), 3),
        }


def percentile(sorted_values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, round(pct / 100 * (len(sorted_values) - 1))))
    return float(sorted_values[k])


# ------------------------------------------------------------------------------ our engine


class OursEngine:
    """A simulated engine over the daemon (see the module docstring).

    ``cost`` carries the full-size geometry (for bytes) and the time model; ``cost_aware``
    turns on tail admission and the load decision; ``tails=False`` is "complete chunks only".
    With a disk tier below the pool, ``wait_ms`` parks each lookup on its promotions (the
    plugin's behaviour) so they come back as hits, and ``promotions`` (a running count of the
    daemon's disk-tier reads, ``EmbeddedDaemon.disk_reads``) charges their bytes to the turn.
    """

    def __init__(self, client: DaemonClient, geometry: Geometry, cost: TailCost, *,
                 tails: bool = True, cost_aware: bool = False, wait_ms: int = 0,
                 promotions: Callable[[], int] | None = None,
                 promoted_keys: Callable[[], set[bytes]] | None = None) -> None:
        self.client = client
        self.geometry = geometry
        self.cost = cost
        self.tails = tails
        self.cost_aware = cost_aware
        self.wait_ms = wait_ms
        self.promotions = promotions
        # Exact accounting (``EmbeddedDaemon.promoted_keys``): a promotion was waited for iff
        # its key is loaded. Needed with the shared tier, where a pending key may be a store
        # check that finds nothing, so pending keys no longer count the unwaited promotions.
        self.promoted_keys = promoted_keys
        self._promoted = 0
        self.totals = Totals(cost.model)
        self._n = 0
        if cost_aware:
            # The daemon decides (daemon/lookup/cost.py, the product's own code path): register the
            # time model with the copy rate scaled like the daemon-side bytes, so its
            # decisions on scaled slots equal the full-size ones.
            scale = geometry.groups[0].bytes_per_block / cost.geometry.groups[0].bytes_per_block
            client.time_model = (cost.model.prefill_tokens_per_s,
                                 cost.model.copy_bytes_per_s * scale)
            client.register(geometry)

    def run_turn(self, turn: Turn) -> TurnRecord:
        g, client, cost = self.geometry, self.client, self.cost
        tph = g.tokens_per_hash
        n = len(turn.prompt)
        trips = client.round_trips
        # One chain for prompt and reply: the prompt's hashes are its prefix. The last reply
        # token is sampled, never computed, so it is not part of the computed tokens.
        hashes = block_hashes(turn.prompt + turn.reply[:-1], tph)
        prompt_hashes = hashes[:n // tph]
        self._n += 1
        query = p.LookupQuery(req_id=str(self._n), block_hashes=prompt_hashes, num_tokens=n,
                              num_prompt_tokens=n)
        ans = client.lookup([query], pin=True, wait_ms=self.wait_ms)[0]
        promoted = late = 0
        if self.promoted_keys is not None:
            new = self.promoted_keys()
            promoted = len(new & set(ans.load_keys)) if ans.hit_tokens else 0
            late = len(new) - promoted
        elif self.promotions is not None:
            # Every promotion this lookup started (the count waits for those in flight). The
            # answer waited for all but the keys it still reports pending: tails above a chunk
            # hit are answered without (lookup.py's vLLM rule), their reads run in background.
            seen, self._promoted = self._promoted, self.promotions()
            late = len(set(ans.pending_keys)) if ans.hit_tokens is not None else 0
            promoted = max(0, self._promoted - seen - late)
            late = self._promoted - seen - promoted
        hit, chunk, keys = ans.hit_tokens or 0, ans.chunk_tokens, list(ans.load_keys)
        if ans.load_keys:
            client.complete_load(ans.load_keys)  # "copied": release the pins
        declined = ans.miss_reason == "tail_below_threshold"
        rec = TurnRecord(n, hit, min(chunk, hit) if hit else 0, cost.load_bytes(keys),
                         lookup_calls=1, tail_declined=declined, promoted=promoted,
                         promoted_bytes=promoted * cost.geometry.slot_bytes(),
                         promoted_late=late)
        # Tails that cannot pay come back NOT_WORTH from the daemon when cost-aware.
        admit = None
        items = store_items(g, hashes, n, tails=self.tails, admit=admit)
        grant = client.prepare_store(items)
        written = [it.key for it, o in zip(items, grant.outcomes, strict=True)
                   if o == p.StoreOutcome.GRANTED]
        if written:
            client.commit_store(written)
        rec.stored_keys = len(written)
        rec.stored_bytes = cost.load_bytes(written)
        rec.evicted = len(grant.evicted)
        rec.round_trips = client.round_trips - trips
        self.totals.add(rec)
        return rec


# ------------------------------------------------------------------------------ daemon


class EmbeddedDaemon:
    """A daemon (``Server``) on its own event loop in a background thread of this process.

    ``call(fn)`` runs ``fn(server)`` on the daemon's loop thread (for cheap index fills)."""

    _count = 0

    def __init__(self, pool_bytes: int, *, slot_bytes: int = 0, policy: str = "lru",
                 prefault: bool = True, disk_bytes: int = 0,
                 extra: dict[str, Any] | None = None) -> None:
        EmbeddedDaemon._count += 1
        self._tmp = tempfile.mkdtemp(prefix="kvo-bench-")
        self.pool_path = f"/dev/shm/kvoffload-bench-{os.getpid()}-{EmbeddedDaemon._count}"
        self._kwargs = dict(control=f"ipc://{self._tmp}/control.sock", http="127.0.0.1:0",
                            pool_path=self.pool_path, pool_bytes=pool_bytes,
                            slot_bytes=slot_bytes, policy=policy, prefault=prefault,
                            lease_ms=600_000, max_message_bytes=256 << 20)
        if disk_bytes:  # a disk tier in the temp dir: removed with it on exit
            self._kwargs.update(disk_dir=f"{self._tmp}/disk", disk_bytes=disk_bytes)
        self._kwargs.update(extra or {})  # more Config fields (the shared tier's mooncake_*)
        self._promoted: set[bytes] = set()  # keys promoted into the pool, see promoted_keys
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.server: Any = None
        self.endpoint = ""

    def __enter__(self) -> EmbeddedDaemon:
        from kvoffload.daemon.config import Config
        from kvoffload.daemon.server import Server

        try:
            import uvloop

            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover
            loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="kvoffload-daemon",
                                        daemon=True)
        self._thread.start()

        async def start() -> None:
            self.server = Server(Config(**self._kwargs))  # type: ignore[arg-type]
            await self.server.start()

        asyncio.run_coroutine_threadsafe(start(), loop).result(60)
        if self.server.tiers is not None:
            self._record_promotions()
        self.endpoint = self.server.control_endpoint
        return self

    def call(self, fn: Callable[[Any], T], timeout: float = 600) -> T:
        assert self._loop is not None

        async def run() -> T:
            return fn(self.server)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def disk_stats(self) -> dict[str, int]:
        """The disk tier's counters (``TierStats``), or {} without one."""
        def get(server: Any) -> dict[str, int]:
            tiers = server.tiers.tiers if server.tiers is not None else []
            return dataclasses.asdict(tiers[0].stats) if tiers else {}

        return self.call(get)

    def disk_reads(self) -> int:
        """Blocks read back from the first tier below the pool so far (disk, or the shared
        tier without one: each one a promotion into the pool), counted once the promotions in
        flight are done: a read its lookup did not wait for then counts with the turn that
        started it, not with the next one. With the shared tier, its existence checks, gets and
        puts are waited for too: a node's pushes reach the store before the next request (in
        production, seconds of think time separate a conversation's turns)."""
        assert self._loop is not None

        async def settle() -> int:
            tiers = self.server.tiers
            if tiers is None:
                return 0
            shared = self.server.mooncake
            for _ in range(1000):  # a finished check may start a promotion, a commit a put
                # ``_tasks``: the running promotions / tier I/O, what their aclose waits on.
                pending = [*tiers._tasks, *(shared._tasks if shared is not None else ())]
                if pending:
                    await asyncio.wait(pending, timeout=60)
                elif shared is not None and (shared._flushing or shared._put_queue):
                    await asyncio.sleep(0)  # a batch scheduled with call_soon: let it start
                else:
                    break
            return int(tiers.tiers[0].stats.reads)

        return asyncio.run_coroutine_threadsafe(settle(), self._loop).result(120)

    def _record_promotions(self) -> None:
        """Wrap the Promoter's per-block task (on this instance only) to note each key that
        ends up committed in the pool."""
        from kvoffload.daemon.store.index import SlotState

        tiers, index = self.server.tiers, self.server.index
        original = tiers._promote

        async def promote(tier: Any, ns: Any, key: bytes, slot: int) -> None:
            await original(tier, ns, key, slot)
            if ns.keys.get(key) == slot and index.state[slot] == SlotState.READY:
                self._promoted.add(key)

        tiers._promote = promote

    def promoted_keys(self) -> set[bytes]:
        """Keys promoted into the pool since the last call, once those in flight are done
        (``disk_reads`` settles them)."""
        self.disk_reads()
        out, self._promoted = self._promoted, set()
        return out

    def client(self, name: str = "kvoffload bench") -> DaemonClient:
        return DaemonClient(self.endpoint, timeout_ms=60_000, name=name)

    def __exit__(self, *exc: object) -> None:
        loop = self._loop
        if loop is not None:
            if self.server is not None:
                asyncio.run_coroutine_threadsafe(self.server.shutdown(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(10)
            loop.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        if os.path.exists(self.pool_path):
            os.unlink(self.pool_path)
