"""``kvoffload demo``: a daemon plus a simulated hybrid-model engine, with a readable summary.

The simulated engine does what a vLLM engine with our plugin does, minus the GPU: for each turn
of the multi-turn chat workload it hashes the prompt, asks the daemon for the longest hit
(complete chunks plus partial tail, pinned), copies the hit blocks out of the shared pool and
verifies every byte, "recomputes" the rest, then stores every new complete chunk and the
partial tails at the prompt end and at the turn end, writing real bytes into the pool for
every tensor-parallel rank. Block contents derive from the key, so any wrong byte is caught.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np
from kvoffload.bench.workload import PRESETS, Turn, block_hashes, chat_turns
from kvoffload.connector.client import AsyncDaemonClient
from kvoffload.connector.transport import R
from kvoffload.daemon.base import Geometry, PackedHashes, make_key
from kvoffload.daemon.config import Config, parse_size
from kvoffload.daemon.control import protocol as p

PREFILL_TOKENS_PER_S = 10_000  # hybrid 27B on one H200 (workloads.md time model)
COPY_BYTES_PER_S = 50e9  # pinned host-to-device over PCIe Gen5 x16
STEP_SECONDS = 0.02  # one engine step between two asks of a deferred request
MAX_REASKS = 50
DAEMON_WAIT_S = 10.0  # how long a run waits for a daemon that stopped answering to come back


@dataclass
class Summary:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    chunk_hit_tokens: int = 0
    tail_hit_tokens: int = 0
    recomputed_tokens: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    keys_stored: int = 0
    keys_refused: int = 0
    evicted_keys: int = 0
    verify_failures: int = 0  # loaded bytes that differ from what was stored for the key
    errors: int = 0
    deferred_steps: int = 0  # lookups answered "not yet" (pending or promoting) and asked again
    gave_up: int = 0  # requests still deferred after MAX_REASKS steps
    round_trips_per_request: float = 0.0
    simulated_ttft_ms_mean: float = 0.0
    simulated_ttft_ms_no_offload_mean: float = 0.0
    wall_seconds: float = 0.0
    daemon: str = ""  # which daemon served the run, and where (embedded or --connect)
    daemon_lost: str = ""  # set when the daemon stopped answering mid-run (the run ended)
    daemon_outages: int = 0  # times the daemon stopped answering and the demo waited for it
    daemon_restarts: int = 0  # times a restarted daemon was found (registered again)


def block_content(key: bytes, rank: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes of one rank's page of a key: what the engine 'computed'."""
    seed = int.from_bytes(key[-12:], "big") ^ (rank * 0x9E3779B97F4A7C15)
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class SimEngine:
    def __init__(self, client: AsyncDaemonClient, geometry: Geometry, scale: float, *,
                 instance: str = "", data_parallel_rank: int | None = None) -> None:
        self.client = client
        self.geometry = geometry
        self.scale = scale
        # The identity the vLLM plugin sends on Register (--instance, --data-parallel-rank).
        self.instance = instance
        self.data_parallel_rank = data_parallel_rank
        self.summary = Summary()
        self._ttft: list[float] = []
        self._ttft_none: list[float] = []
        self.pool: np.ndarray | None = None
        self.reg: p.Registered | None = None
        self._mm: mmap.mmap | None = None  # set by start(); close() must work without it
        self._mapped: tuple[int, int, int] | None = None  # (device, inode, size) mapped
        self._registrations = 0  # the client's count when this engine last looked

    async def start(self) -> None:
        await self.client.connect()
        await self.client.register(self.geometry, instance=self.instance,
                                   data_parallel_rank=self.data_parallel_rank)
        self._follow_registration()

    def _follow_registration(self) -> bool:
        """Take the client's latest registration; True if it changed since the last look.

        A restarted daemon may have made a new pool file (no --state-dir): a mapping of the
        old one would read and write bytes no one else sees, so the file the daemon names
        is mapped again unless it is the same file (same device, inode and size)."""
        if self.client.registrations == self._registrations:
            return False
        self._registrations = self.client.registrations
        self.reg = self.client.registered
        assert self.reg is not None
        fd = os.open(self.reg.pool_path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            if self._mm is None or self._mapped != (st.st_dev, st.st_ino, st.st_size):
                self.close()
                self._mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED)
                self._mapped = (st.st_dev, st.st_ino, st.st_size)
                self.pool = np.frombuffer(self._mm, dtype=np.uint8)
        finally:
            os.close(fd)
        return True

    async def _ask(self, build: Callable[[int], p._Msg], kind: type[R]) -> R:
        """One request naming the engine. The client registers again with a restarted daemon
        and resends; the pool is followed before any byte of the reply is used. The turn
        goes on: a load done or a commit for the old run's pins and grants counts 0 on the
        new one (nothing wrong is stored: those keys are just not stored), and every later
        request of the turn is the new run's."""
        reply = await self.client.call_engine(build, kind)
        if self._follow_registration():
            self.summary.daemon_restarts += 1
        return reply

    def close(self) -> None:
        self.pool = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None
            self._mapped = None

    def _page(self, slot: int, rank: int, nbytes: int) -> np.ndarray:
        assert self.pool is not None and self.reg is not None
        start = slot * self.reg.slot_bytes + rank * self.reg.rank_bytes
        return self.pool[start:start + nbytes]

    def _group_bytes(self, key: bytes) -> int:
        return self.geometry.groups[int.from_bytes(key[-4:], "big")].bytes_per_block

    async def run_turn_once(self, turn: Turn) -> None:
        """``run_turn``, counted only if it completes: a turn cut off by a lost daemon is
        taken back from the summary, so asking it again never counts it twice."""
        before = replace(self.summary)
        marks = len(self._ttft), len(self._ttft_none)
        try:
            await self.run_turn(turn)
        except BaseException:
            # Wrong bytes already seen stay counted: only the turn's totals are taken back.
            before.verify_failures = self.summary.verify_failures
            before.daemon_restarts = self.summary.daemon_restarts  # the pool was followed
            self.summary = before
            del self._ttft[marks[0]:], self._ttft_none[marks[1]:]
            raise

    async def run_turn(self, turn: Turn) -> None:
        g, s = self.geometry, self.summary
        hashes = block_hashes(turn.prompt, g.tokens_per_hash)
        n = len(turn.prompt)
        packed = PackedHashes.pack(hashes)
        query = p.LookupQuery(req_id=f"{turn.conversation}-{turn.index}", hash_blob=packed.blob,
                              hash_bytes=packed.width,
                              num_tokens=n, num_prompt_tokens=n)
        # As an engine does: a deferred answer (a key being written, or promoted from a slower
        # tier) is asked again on a later step, a bounded number of times.
        for _ in range(MAX_REASKS + 1):
            reply = await self._ask(lambda e: p.Lookup(rid=self.client.rid(), engine=e,
                                                       queries=[query], pin=True),
                                    p.LookupReply)
            ans = reply.answers[0]
            if ans.hit_tokens is not None:
                break
            s.deferred_steps += 1
            await asyncio.sleep(STEP_SECONDS)
        else:
            s.gave_up += 1  # still deferred: computed in full, as an engine would after a while
        hit = ans.hit_tokens or 0
        loaded = 0
        for key, slot in zip(ans.load_keys, ans.slots, strict=True):
            nbytes = self._group_bytes(key)
            for rank in range(g.tp_world_size):
                got = self._page(slot, rank, nbytes).copy()  # the "host-to-device" copy
                loaded += nbytes
                if not np.array_equal(got, block_content(key, rank, nbytes)):
                    s.verify_failures += 1
        if ans.load_keys:
            await self._ask(lambda e: p.CompleteLoad(rid=self.client.rid(), engine=e,
                                                     keys=ans.load_keys), p.Ack)
        s.requests += 1
        s.prompt_tokens += n
        s.hit_tokens += hit
        s.chunk_hit_tokens += ans.chunk_tokens if hit else 0
        s.tail_hit_tokens += hit - ans.chunk_tokens if hit else 0
        s.recomputed_tokens += n - hit
        s.bytes_loaded += loaded
        unscaled = loaded / self.scale
        self._ttft.append((n - hit) / PREFILL_TOKENS_PER_S + unscaled / COPY_BYTES_PER_S)
        self._ttft_none.append(n / PREFILL_TOKENS_PER_S)
        await self._store(turn, hashes)

    def _store_items(self, tokens: list[int], hashes: list[bytes],
                     boundaries: set[int]) -> list[p.StoreItem]:
        """Every complete chunk of every group, plus a tail at each boundary inside a block."""
        g = self.geometry
        items: list[p.StoreItem] = []
        tph = g.tokens_per_hash
        for gi, grp in enumerate(g.groups):
            block = grp.tokens_per_block
            ends = [b for b in range(block, len(hashes) * tph + 1, block)]
            ends += sorted(b for b in boundaries if b % block and b <= len(hashes) * tph)
            for end in ends:
                key = make_key(hashes[end // tph - 1], gi)
                start = end - block if end % block == 0 else end // block * block
                items.append(p.StoreItem(
                    key=key, end_token=end, tail=end % block != 0,
                    token_ids=tokens[start:end],
                    block_hashes=hashes[start // tph:end // tph],
                    parent_hash=hashes[start // tph - 1] if start else None))
        return items

    async def _store(self, turn: Turn, prompt_hashes: list[bytes]) -> None:
        g, s = self.geometry, self.summary
        tokens = turn.prompt + turn.reply
        hashes = block_hashes(tokens, g.tokens_per_hash)
        tph = g.tokens_per_hash
        # Tails where state exists: the prefill's end and the turn's end (both hash-aligned).
        prompt_end = (len(turn.prompt) - 1) // tph * tph
        boundaries = {prompt_end, len(hashes) * tph}
        items = self._store_items(tokens, hashes, {b for b in boundaries if b > 0})
        grant = await self._ask(lambda e: p.PrepareStore(rid=self.client.rid(), engine=e,
                                                         items=items), p.StoreGrant)
        written = []
        for item, outcome, slot in zip(items, grant.outcomes, grant.slots, strict=True):
            if outcome != p.StoreOutcome.GRANTED:
                s.keys_refused += outcome != p.StoreOutcome.EXISTS
                continue
            nbytes = self._group_bytes(item.key)
            for rank in range(g.tp_world_size):
                self._page(slot, rank, nbytes)[:] = block_content(item.key, rank, nbytes)
                s.bytes_stored += nbytes
            written.append(item.key)
        s.evicted_keys += len(grant.evicted)
        if written:
            ack = await self._ask(lambda e: p.CommitStore(rid=self.client.rid(), engine=e,
                                                          keys=written), p.Ack)
            s.keys_stored += ack.count

    def finish(self, wall: float) -> Summary:
        s = self.summary
        s.round_trips_per_request = self.client.round_trips / max(1, s.requests)
        s.simulated_ttft_ms_mean = 1000 * float(np.mean(self._ttft)) if self._ttft else 0.0
        s.simulated_ttft_ms_no_offload_mean = (1000 * float(np.mean(self._ttft_none))
                                               if self._ttft_none else 0.0)
        s.wall_seconds = wall
        return s


async def run_demo(args: argparse.Namespace) -> Summary:
    preset = PRESETS[args.preset]
    geometry = preset.geometry(args.scale)
    server = None
    tmp = None
    endpoint = args.connect
    if endpoint is None:
        from kvoffload.daemon.server import Server

        tmp = tempfile.mkdtemp(prefix="kvo-demo-")
        config = Config(control=f"ipc://{tmp}/control.sock", http="127.0.0.1:0",
                        pool_path=f"/dev/shm/kvoffload-demo-{os.getpid()}",
                        pool_bytes=parse_size(args.pool_bytes))
        server = Server(config)
        try:
            await server.start()
        except BaseException:  # nothing left behind: the pool file, sockets, the temp dir
            await server.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        endpoint = server.control_endpoint
    from kvoffload.connector.client import DaemonUnavailable

    client = AsyncDaemonClient(endpoint, name="kvoffload demo engine")
    engine = SimEngine(client, geometry, args.scale,
                       instance=getattr(args, "instance", "") or "",
                       data_parallel_rank=getattr(args, "data_parallel_rank", None))
    if server is not None:
        engine.summary.daemon = (f"started its own daemon in this process: control {endpoint}, "
                                 f"pool {server.config.pool_path} ({args.pool_bytes}); "
                                 "stopped and removed at the end")
    else:
        engine.summary.daemon = f"the running daemon at {endpoint} (--connect)"
    started = time.perf_counter()
    try:
        await engine.start()
        wait_s = float(getattr(args, "daemon_wait", DAEMON_WAIT_S))
        for turn in chat_turns(args.requests, args.seed):
            lost_at: float | None = None
            while True:
                try:
                    await engine.run_turn_once(turn)
                    break
                except DaemonUnavailable as exc:
                    # A daemon that died or froze: the turn is asked again (a restarted
                    # daemon on the same endpoint is found by the client's reconnect) until
                    # --daemon-wait has passed; then the run ends with one line.
                    now = time.monotonic()
                    if lost_at is None:
                        lost_at = now
                        engine.summary.daemon_outages += 1
                    if now - lost_at >= wait_s:
                        engine.summary.daemon_lost = (
                            f"the daemon stopped answering after {engine.summary.requests} of "
                            f"{args.requests} requests and did not come back within "
                            f"{wait_s:g} s ({exc})")
                        break
                except (p.ProtocolError, ConnectionError) as exc:
                    engine.summary.errors += 1
                    print(f"error: {exc}")
                    break
            if engine.summary.daemon_lost:
                break
        return engine.finish(time.perf_counter() - started)
    finally:
        engine.close()
        await client.close()
        if server is not None:
            await server.shutdown()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def scale_text(scale: float) -> str:
    """1/1024 rather than 0.000976562."""
    inv = 1 / scale if scale else 0
    return f"1/{round(inv)}" if scale < 1 and abs(inv - round(inv)) < 1e-6 else f"{scale:g}"


def render(s: Summary, preset: str, scale: float) -> str:
    pct = 100 * s.hit_tokens / max(1, s.prompt_tokens)
    x = scale_text(scale)
    return "\n".join([
        f"kvoffload demo: {s.requests} chat turns on {preset} (bytes x {x})",
        textwrap.fill(f"daemon: {s.daemon}", 96, initial_indent="  ", subsequent_indent="    ",
                      break_on_hyphens=False),
        f"  bytes x {x}: each KV block has {x} of its real size (--scale), so the run fits",
        "    here; token counts are real and the simulated TTFT charges full-size copies",
        f"  prompt tokens      {s.prompt_tokens:>12,}",
        f"  served from cache  {s.hit_tokens:>12,}  ({pct:.1f} %)",
        f"    complete chunks  {s.chunk_hit_tokens:>12,}",
        f"    partial tails    {s.tail_hit_tokens:>12,}",
        f"  recomputed         {s.recomputed_tokens:>12,}",
        f"  bytes stored       {s.bytes_stored:>12,}   loaded {s.bytes_loaded:,}",
        f"  keys stored        {s.keys_stored:>12,}   refused {s.keys_refused:,}"
        f"   evicted {s.evicted_keys:,}",
        f"  simulated TTFT     {s.simulated_ttft_ms_mean:>9.1f} ms  (no offload "
        f"{s.simulated_ttft_ms_no_offload_mean:.1f} ms)",
        f"  round trips/request {s.round_trips_per_request:>8.2f}   daemon requests per turn "
        "(lookup, load done, store, commit)",
        f"  deferred steps     {s.deferred_steps:>12,}   'not yet' answers asked again a step "
        f"later ({s.gave_up} gave up after {MAX_REASKS})",
        f"  verify failures    {s.verify_failures:>12}   loaded pages (every rank) whose bytes "
        "differ from what was stored",
        f"  errors             {s.errors:>12}",
        f"  daemon outages     {s.daemon_outages:>12}   times the daemon stopped answering and "
        "came back within --daemon-wait",
        f"  daemon restarts    {s.daemon_restarts:>12}   times a restarted daemon was found and "
        "the engine registered again",
        f"  wall time          {s.wall_seconds:>9.1f} s",
    ])


def main(args: argparse.Namespace) -> int:
    """Run the demo; a mistake (unknown preset, bad endpoint, no daemon) is one line, exit 2
    for a bad argument and 1 for a daemon that cannot be used."""
    from kvoffload.connector.client import DaemonUnavailable
    from kvoffload.daemon.preflight import StartFault

    from kvoffload.hints import bad_endpoint, unavailable

    def fail(line: str, code: int) -> int:
        print(f"kvoffload demo: {line}", file=sys.stderr)
        return code

    if args.preset not in PRESETS:
        return fail(f"--preset {args.preset}: unknown preset; choices: "
                    f"{', '.join(sorted(PRESETS))}", 2)
    if args.connect is not None and (why := bad_endpoint("--connect", args.connect)):
        return fail(why, 2)
    try:
        parse_size(args.pool_bytes)
    except ValueError as exc:
        return fail(f"--pool-bytes: {exc}", 2)
    try:
        summary = asyncio.run(run_demo(args))
    except DaemonUnavailable:
        return fail(unavailable("--connect", args.connect or "(embedded daemon)"), 1)
    except p.ProtocolError as exc:
        return fail(f"the daemon refused the demo engine: {exc}", 1)
    except StartFault as exc:  # the embedded daemon (no --connect) cannot start
        return fail(f"cannot start the embedded daemon: {exc}", 1)
    if summary.daemon_lost:
        return fail(f"{summary.daemon_lost}; the demo stopped", 1)
    if args.json:
        print(json.dumps(asdict(summary)))
    else:
        print(render(summary, args.preset, args.scale))
    return 0 if summary.verify_failures == 0 and summary.errors == 0 else 1
