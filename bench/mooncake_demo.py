"""Two daemons on one real ``mooncake_master`` running the same seeded ``kvoffload demo``.

Daemon A runs the demo first and pushes every committed block to the shared Mooncake Store
(``--mooncake-put commit``). Daemon B starts with an empty pool and runs the same seeded demo:
what its pool misses, it asks the store for, and the demo (which asks a deferred answer again a
step later, as an engine does) gets those blocks promoted. So B serves more than A: the
difference is what the shared tier served. ``meets``: B's hit tokens > A's, no verify failure.

Run: ``python -m kvoffload.bench.mooncake_demo [--requests N] [--seed S] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from kvoffload.bench.proc import daemon_process
from kvoffload.bench.suites.load import metric_sum, scrape_metrics

POOL_BYTES = 64 << 20  # the demo's default pool
SEGMENT = "128MiB"  # each daemon lends this to the store: room for A's every block
READY_S = 30.0


def _mooncake_ok(http: str) -> bool:
    try:
        with urllib.request.urlopen(f"{http}/readyz", timeout=5) as resp:
            body = json.loads(resp.read())
    except OSError as exc:  # 503 while a check is not ok: the body says which
        body = json.loads(getattr(exc, "read", lambda: b"{}")() or b"{}")
    return bool(body.get("checks", {}).get("mooncake") == "ok")


def _wait(cond: Any, what: str, seconds: float = READY_S) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not within {seconds:.0f} s")
        time.sleep(0.1)


def _settled_writes(http: str) -> float:
    """Wait until the daemon's pushes to the store stop (its last commits landed)."""
    last = -1.0
    for _ in range(int(READY_S / 0.3)):
        now = metric_sum(scrape_metrics(http), "kvoffload_tier_ops_total", tier="mooncake",
                         op="write")
        if now == last:
            return now
        last = now
        time.sleep(0.3)
    return last


@contextlib.contextmanager
def _node(master: Any) -> Iterator[dict[str, Any]]:
    args = ("--mooncake-master", f"127.0.0.1:{master.rpc}",
            "--mooncake-metadata", f"http://127.0.0.1:{master.http}/metadata",
            "--mooncake-local-hostname", "127.0.0.1", "--mooncake-put", "commit",
            "--mooncake-segment-bytes", SEGMENT, "--mooncake-buffer-bytes", "16MiB")
    with daemon_process(*args, pool_bytes=POOL_BYTES, slot_bytes=0) as (_proc, ready):
        _wait(lambda: _mooncake_ok(ready["http"]), "the daemon's mooncake tier ready")
        yield ready


def _demo(control: str, requests: int, seed: int) -> dict[str, Any]:
    from kvoffload.bench.demo import run_demo

    args = argparse.Namespace(preset="qwen3.6-27b-tp1", scale=1 / 1024, requests=requests,
                              seed=seed, connect=control, pool_bytes=str(POOL_BYTES))
    return asdict(asyncio.run(run_demo(args)))


def run_demo_shared(requests: int = 100, seed: int = 0) -> dict[str, Any]:
    from kvoffload.bench.quiet import quiet_libraries

    with quiet_libraries(verbose=False):  # the store client's glog, in the daemons it starts
        return _run(requests, seed)


def _run(requests: int, seed: int) -> dict[str, Any]:
    from kvoffload.bench.mooncake_run import MooncakeMaster, mooncake_unavailable

    reason = mooncake_unavailable()
    if reason is not None:
        return {"meets": False, "not_run": reason}
    keys = ("hit_tokens", "chunk_hit_tokens", "tail_hit_tokens", "recomputed_tokens",
            "deferred_steps", "gave_up", "verify_failures", "errors")
    out: dict[str, Any] = {"requests": requests, "seed": seed}
    with MooncakeMaster() as master, _node(master) as a, _node(master) as b:
        first = _demo(a["control"], requests, seed)
        out["a_store_writes"] = _settled_writes(a["http"])
        second = _demo(b["control"], requests, seed)
        m = scrape_metrics(b["http"])
        out["b_promotions_ok"] = metric_sum(m, "kvoffload_tier_promotions_total",
                                            tier="mooncake", outcome="ok")
    out["a"] = {k: first[k] for k in keys}
    out["b"] = {k: second[k] for k in keys}
    out["tier_served_tokens"] = second["hit_tokens"] - first["hit_tokens"]
    bad = first["verify_failures"] + second["verify_failures"] + first["errors"] + second[
        "errors"]
    out["meets"] = second["hit_tokens"] > first["hit_tokens"] and bad == 0
    out["reason"] = ("all sub-targets met" if out["meets"] else
                     f"B served {second['hit_tokens']:,} tokens vs A {first['hit_tokens']:,}; "
                     f"{bad} verify failures or errors")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvoffload.bench.mooncake_demo",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = run_demo_shared(args.requests, args.seed)
    if args.json or "not_run" in r:
        print(json.dumps(r, indent=None if args.json else 2))
    else:
        a, b = r["a"], r["b"]
        print(f"two daemons on one mooncake_master, the same demo ({args.requests} requests, "
              f"seed {args.seed}):\n  daemon A served {a['hit_tokens']:>9,} tokens "
              f"(first, pushes every block to the store: {r['a_store_writes']:.0f} writes)\n"
              f"  daemon B served {b['hit_tokens']:>9,} tokens "
              f"({r['b_promotions_ok']:.0f} blocks promoted from the store, "
              f"{b['deferred_steps']} deferred steps asked again)\n  meets: {r['meets']} "
              f"({r['reason']})")
    return 0 if r.get("meets") else 1


if __name__ == "__main__":
    sys.exit(main())
