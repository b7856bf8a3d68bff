"""Warm restart, crash consistency and kill -9 with clients attached (real daemon processes).

Block contents derive from the key (``bench.demo.block_content``), so every byte a client
reads after a restart is checked: "served intact or not at all".
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
from kvoffload.bench.demo import block_content
from kvoffload.connector.client import DaemonClient, DaemonUnavailable
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec, KeyStatus, make_key
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.state import snapshot as js

from tests.daemon_helpers import DaemonHandle, run_daemon


def demo(control: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvoffload", "demo", "--json", "--connect",
                          control, *args], capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def metric(d: DaemonHandle, outcome: str) -> float:
    text = urllib.request.urlopen(f"{d.http_url}/metrics", timeout=5).read().decode()
    line = f'kvoffload_recovery_blocks_total{{outcome="{outcome}"}} '
    return next(float(x[len(line):]) for x in text.splitlines() if x.startswith(line))


def committed(state_dir: Path) -> tuple[dict[int, Geometry], js.State]:
    state = js.load_state(state_dir)
    geoms = {ns: js._geom_dec.decode(g) for ns, g in state.geometries.items()}
    return geoms, state


def wait_flushed(d: DaemonHandle, seconds: float = 0.3) -> None:
    time.sleep(seconds)  # > flush_ms: the journal writer has written what was committed


def test_sigterm_warm_restart_keeps_99_percent(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    with run_daemon(tmp_path, "--state-dir", str(state_dir), pool_bytes=16 << 20) as d:
        first = demo(d.control, "--requests", "150")
        assert first["verify_failures"] == 0 and first["evicted_keys"] > 0  # drops journaled
        c = DaemonClient(d.control)
        ready_before = c.stats()["ready"]
        c.close()
        assert d.stop() == 0
        assert Path(d.pool_path).exists()  # kept with a state dir
        geoms, state = committed(state_dir)
        assert len(state.live) == ready_before
        d.start()
        assert metric(d, "recovered") >= 0.99 * ready_before
        # Probe every committed key: at least 99 % still hit.
        hits = 0
        for ns, geom in geoms.items():
            keys = [k for (n, k) in state.live if n == ns]
            c = DaemonClient(d.control)
            c.register(geom)
            hits += sum(s == KeyStatus.HIT for s in c.probe(keys))
            c.close()
        assert hits >= 0.99 * ready_before, (hits, ready_before)
        print(f"restart hit ratio {hits}/{ready_before} = {hits / ready_before:.4f}")
        again = demo(d.control, "--requests", "150")
        assert again["verify_failures"] == 0 and again["errors"] == 0
        assert again["hit_tokens"] > first["hit_tokens"]  # the first turns hit now too


def test_kill9_restart_serves_nothing_wrong_and_drops_corrupt_slot(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    with run_daemon(tmp_path, "--state-dir", str(state_dir), pool_bytes=16 << 20) as d:
        assert demo(d.control, "--requests", "80")["verify_failures"] == 0
        wait_flushed(d)
        d.kill()
        _, state = committed(state_dir)
        assert len(state.live) > 100
        # Corrupt one committed block's bytes in the pool file between the runs.
        (_, victim), entry = next(iter(state.live.items()))
        with open(d.pool_path, "r+b") as f:
            f.seek(entry.slot * state.slot_bytes + 7)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x5A]))
        d.start()
        assert metric(d, "discarded") == 1
        assert metric(d, "recovered") == len(state.live) - 1
        geoms, _ = committed(state_dir)  # the new epoch's snapshot, written at start
        c = DaemonClient(d.control)
        c.register(next(iter(geoms.values())))
        assert c.probe([victim]) == [KeyStatus.MISS]
        c.close()
        again = demo(d.control, "--requests", "80")
        assert again["verify_failures"] == 0 and again["errors"] == 0


def test_kill9_during_demo_run(tmp_path: Path) -> None:
    """A crash in the middle of a run: nothing half-written is served after the restart."""
    state_dir = tmp_path / "state"
    with run_daemon(tmp_path, "--state-dir", str(state_dir), pool_bytes=16 << 20) as d:
        run = subprocess.Popen([sys.executable, "-m", "kvoffload", "demo", "--json",
                                "--connect", d.control, "--requests", "400"],
                               stdout=subprocess.PIPE, text=True)
        time.sleep(1.5)
        d.kill()
        d.start()  # the same endpoint: the running demo's socket reconnects by itself
        out, _ = run.communicate(timeout=120)
        during = json.loads(out.strip().splitlines()[-1])
        assert during["verify_failures"] == 0
        after = demo(d.control, "--requests", "150")
        assert after["verify_failures"] == 0 and after["errors"] == 0
        assert after["hit_tokens"] > 0


# -- several engine-side clients while the daemon is killed and restarted --------------

SLOT = 16 << 10
GEOM = Geometry(namespace="crash-test", groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16, SLOT),),
                tokens_per_hash=16)
TIMEOUT_MS = 300


class Worker(threading.Thread):
    """Lookup-load-verify or store-commit over its own keys, forever; counts everything."""

    def __init__(self, control: str, idx: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.client = DaemonClient(control, timeout_ms=TIMEOUT_MS, name=f"worker {idx}")
        # 4 x 100 keys < 512 slots: an LRU pool cycled by more keys than it holds never hits.
        self.keys = [make_key(f"w{idx}-{i}".encode().ljust(16, b"."), 0) for i in range(100)]
        self.stop = stop
        self.counts: Counter[str] = Counter()
        self.longest_call = 0.0
        self.phase = "up"

    def _pool(self) -> np.ndarray:
        reg = self.client.registered
        assert reg is not None
        with open(reg.pool_path, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), 0)
        return np.frombuffer(self._mm, dtype=np.uint8)

    def step(self, pool: np.ndarray, key: bytes) -> None:
        slots = self.client.pin_load([key])
        if slots[0] >= 0:
            got = pool[slots[0] * SLOT:(slots[0] + 1) * SLOT]
            ok = np.array_equal(got, block_content(key, 0, SLOT))
            self.counts["hit" if ok else "wrong"] += 1
            self.counts[f"hit_{self.phase}"] += 1
            self.client.complete_load([key])
            return
        self.counts["miss"] += 1
        grant = self.client.prepare_store([p.StoreItem(key=key, end_token=16)])
        if grant.outcomes[0] == p.StoreOutcome.GRANTED:
            s = grant.slots[0]
            pool[s * SLOT:(s + 1) * SLOT] = block_content(key, 0, SLOT)
            self.client.commit_store([key])

    def run(self) -> None:
        self.client.register(GEOM)
        pool = self._pool()
        i = 0
        while not self.stop.is_set():
            key = self.keys[i % len(self.keys)]
            i += 1
            started = time.monotonic()
            try:
                self.step(pool, key)
            except DaemonUnavailable:
                self.counts["unavailable"] += 1  # the engine treats it as a miss
                self.counts[f"unavailable_{self.phase}"] += 1
            except p.ProtocolError as exc:
                self.counts[f"error_{exc.code}"] += 1
            self.longest_call = max(self.longest_call, time.monotonic() - started)
        self.client.close()


def test_kill9_with_concurrent_clients(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    with run_daemon(tmp_path, "--state-dir", str(state_dir), pool_bytes=8 << 20,
                    slot_bytes=SLOT) as d:
        stop = threading.Event()
        workers = [Worker(d.control, i, stop) for i in range(4)]
        for w in workers:
            w.start()
        time.sleep(2.0)
        for w in workers:
            w.phase = "down"
        d.kill()
        time.sleep(1.5)
        for w in workers:
            w.phase = "back"
        d.start()
        time.sleep(2.5)
        stop.set()
        for w in workers:
            w.join(10)
        total = sum((w.counts for w in workers), Counter())
        assert total["wrong"] == 0, total
        assert total["hit_up"] > 0 and total["unavailable_down"] > 0, total
        assert total["hit_back"] > 0, total  # reconnected by themselves; hits resumed
        assert metric(d, "recovered") > 0  # blocks committed before the crash came back
        # A step is at most 4 calls; each is bounded by the client's timeout.
        assert max(w.longest_call for w in workers) < 4 * TIMEOUT_MS / 1000 + 0.5


def test_recovered_blocks_wait_for_a_payload_instead_of_a_placeholder(tmp_path: Path) -> None:
    """After a restart the old event stream is gone; recovered blocks are announced again only
    with their real payload (from an engine stream), never as placeholders: until then they
    wait, counted."""
    state_dir = tmp_path / "state"
    with run_daemon(tmp_path, "--state-dir", str(state_dir), "--events", "tcp://127.0.0.1:*",
                    "--events-replay", "tcp://127.0.0.1:*", pool_bytes=16 << 20) as d:
        demo(d.control, "--requests", "40")
        c = DaemonClient(d.control)
        ready = c.stats()["ready"]
        c.close()
        assert d.stop() == 0
        d.start()
        text = urllib.request.urlopen(f"{d.http_url}/metrics", timeout=5).read().decode()
        waiting = next(float(x.split()[-1]) for x in text.splitlines()
                       if x.startswith("kvoffload_events_awaiting_payload "))
        recovered = metric(d, "recovered")
        assert ready > 0 and waiting == recovered >= 0.99 * ready
        assert 'kvoffload_events_incomplete_total{reason="recovered"}' in text


# -- the pool file engines map is never made smaller in place (issue 23 item 5) ----------

# Maps the pool file as an engine's worker does, writes into its last page, then (told to on
# stdin) reads it back: a file truncated under the mapping kills it with SIGBUS (rc -7).
MAPPER = r"""
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
size = int(sys.argv[2])
mm = mmap.mmap(fd, size)
os.close(fd)
mm[size - 4096:size - 4091] = b"hello"
print("mapped", flush=True)
sys.stdin.readline()
print(bytes(mm[size - 4096:size - 4091]).decode(), flush=True)
"""


def _map_pool(path: str, size: int) -> subprocess.Popen[str]:
    mapper = subprocess.Popen([sys.executable, "-c", MAPPER, path, str(size)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert mapper.stdout is not None and mapper.stdout.readline().strip() == "mapped"
    return mapper


def test_a_smaller_pool_after_kill9_leaves_old_mappings_readable(tmp_path: Path) -> None:
    from kvoffload.daemon.store.private_files import MARK_BYTES

    with run_daemon(tmp_path, pool_bytes=16 << 20) as d:
        old = os.stat(d.pool_path)
        mapper = _map_pool(d.pool_path, 16 << 20)
        d.kill()
        d.pool_bytes = 8 << 20
        d.start()
        out, _ = mapper.communicate("\n", timeout=60)
        assert mapper.returncode == 0, mapper.returncode  # -7: SIGBUS
        assert out.split() == ["hello"]  # the old file, intact under its mapping
        new = os.stat(d.pool_path)
        assert new.st_ino != old.st_ino and new.st_size == (8 << 20) + MARK_BYTES
        assert "never made smaller" in d.log()
        after = demo(d.control, "--requests", "20")
        assert after["verify_failures"] == 0 and after["errors"] == 0


def test_a_larger_pool_grows_the_same_file(tmp_path: Path) -> None:
    """Growing in place is safe for old mappings and keeps the inode (a warm restart's
    blocks, engines' mappings)."""
    with run_daemon(tmp_path, pool_bytes=8 << 20) as d:
        old = os.stat(d.pool_path)
        mapper = _map_pool(d.pool_path, 8 << 20)
        d.kill()
        d.pool_bytes = 16 << 20
        d.start()
        out, _ = mapper.communicate("\n", timeout=60)
        assert mapper.returncode == 0 and out.split() == ["hello"]
        assert os.stat(d.pool_path).st_ino == old.st_ino
