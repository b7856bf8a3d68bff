"""Distinct blocks resident: one shared daemon pool vs N per-engine vLLM CPU caches.

Issue 25's "duplicates across engines": under prefix-affine routing a popular prefix (a system
prompt, a shared document) reaches several engines, and each per-engine cache then holds its
own copy, so at equal memory fewer *distinct* blocks fit. This counts what is really held, from
the real data structures, never from a model of them:

* ours: the daemon's shared index (``<pool_path>.index``, ``daemon/store/shared_index.py``):
  every READY entry of the slot table, by namespace and key. A key READY in two slots would
  show as ``resident > distinct``; ``check`` compares the count with the daemon's own Stats
  (``ready`` over the control socket: the daemon's index, read through another path);
* vLLM: each engine's ``CPUOffloadingManager`` cache policy (LRU: ``chunks``; ARC: ``t1`` and
  ``t2``; for the tiering manager its CPU primary tier's), ready chunks only (a chunk whose
  store is in flight has ``ref_cnt == -1`` and serves nothing yet). ``sum`` adds each engine's
  count, ``union`` counts each key once: ``sum / union`` is the duplication factor.

``ResidencySampler`` takes a sample every ``every`` requests of a replay and once at its end.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kvoffload.daemon.store import shared_index as si

_ENTRY = np.dtype([("seq", "<u4"), ("ns", "<u2"), ("state", "u1"), ("flags", "u1"),
                   ("ident", "<u8"), ("keylen", "u1"), ("pad", "V7"), ("key", "V40")])
assert _ENTRY.itemsize == si.ENTRY_BYTES


def daemon_resident(pool_path: str) -> dict[str, int]:
    """READY and PENDING entries of the daemon's shared index, and the distinct READY keys.

    Read without the sequence locks: the bench samples between requests, when every engine is
    idle, and ``check`` confirms the count against the daemon's Stats."""
    path = si.index_path_for(pool_path)
    fd = os.open(path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            num_slots = si.HEADER.unpack_from(mm, 0)[3]
            table = np.frombuffer(mm, dtype=_ENTRY, count=num_slots,
                                  offset=si.HEADER_BYTES).copy()
    finally:
        os.close(fd)
    ready = table[(table["state"] == si.READY) & (table["keylen"] > 0)]
    keys = {(int(ns), bytes(k)[:n]) for ns, k, n in zip(
        ready["ns"].tolist(), ready["key"], ready["keylen"].tolist(), strict=True)}
    return {"resident": len(ready), "distinct": len({k for _, k in keys}),
            "namespaces": len({ns for ns, _ in keys}),
            "pending": int((table["state"] == si.PENDING).sum()), "slots": num_slots}


def cpu_policy(manager: Any) -> Any:
    """The cache policy of a vLLM offloading manager (the tiering manager's CPU primary
    tier's), or None for a manager that is not vLLM's (ours)."""
    policy = getattr(manager, "_policy", None)
    if policy is None and hasattr(manager, "primary_tier"):
        policy = manager.primary_tier._policy
    return policy


def vllm_resident_keys(manager: Any) -> set[bytes]:
    """Keys of the ready chunks in one engine's vLLM CPU cache."""
    policy = cpu_policy(manager)
    if policy is None:
        raise TypeError(f"{type(manager).__name__} is not a vLLM CPU offloading manager")
    if hasattr(policy, "chunks"):  # LRUCachePolicy
        tables: Iterable[dict[Any, Any]] = (policy.chunks,)
    elif hasattr(policy, "t1"):  # ARCCachePolicy: T1 and T2 hold chunks, B1/B2 only ghosts
        tables = (policy.t1, policy.t2)
    else:
        raise TypeError(f"unknown vLLM cache policy {type(policy).__name__}")
    return {bytes(k) for t in tables for k, chunk in t.items() if chunk.is_ready}


def vllm_resident(engines: Sequence[Any]) -> dict[str, Any]:
    per = [vllm_resident_keys(e.connector.connector_scheduler.manager) for e in engines]
    union = set().union(*per)
    return {"per_engine": [len(k) for k in per], "sum": sum(len(k) for k in per),
            "union": len(union)}


def check_against_stats(pool_path: str, control: str, tries: int = 20) -> dict[str, int]:
    """A sample of the index whose READY count the daemon's Stats confirm before and after
    it (engines are idle, but the daemon may still be applying a Step they sent last).
    ``reserved``: slots neither READY, PENDING, free nor quarantined, i.e. granted to engines
    for their next stores (``max_reserved_slots``): memory that holds no block."""
    from kvoffload.daemon.ops.stats import control_stats

    for _ in range(tries):
        before = control_stats(control, 5000)["ready"]
        got = daemon_resident(pool_path)
        stats = control_stats(control, 5000)
        if before == stats["ready"] == got["resident"]:
            break
        time.sleep(0.05)
    reserved = stats["num_slots"] - stats["ready"] - stats["pending"] - stats["free_slots"] \
        - stats["quarantined"]
    return {**got, "stats_ready": stats["ready"], "reserved": reserved}


@dataclass
class ResidencySampler:
    """Samples taken every ``every`` requests (``before(i)`` of a replay) and at the end."""

    take: Callable[[], dict[str, Any]]
    every: int = 100
    samples: list[dict[str, Any]] = field(default_factory=list)

    def before(self, i: int) -> None:
        if i and i % self.every == 0:
            self.samples.append({"request": i, **self.take()})

    def final(self, requests: int) -> None:
        self.samples.append({"request": requests, **self.take()})

    def summary(self, field_name: str) -> dict[str, Any]:
        values = [s[field_name] for s in self.samples]
        return {"mean": round(statistics.fmean(values), 1) if values else None,
                "final": values[-1] if values else None, "samples": len(values)}


def ours_summary(sampler: ResidencySampler) -> dict[str, Any]:
    s = sampler.samples
    return {"distinct": sampler.summary("distinct"), "resident": sampler.summary("resident"),
            "reserved": sampler.summary("reserved"),
            "stats_ready_final": s[-1].get("stats_ready") if s else None,
            "namespaces": max((x["namespaces"] for x in s), default=0),
            "every": sampler.every, "at": [x["request"] for x in s]}


def vllm_summary(sampler: ResidencySampler) -> dict[str, Any]:
    s = sampler.samples
    dup = [x["sum"] / x["union"] for x in s if x["union"]]
    return {"union": sampler.summary("union"), "sum": sampler.summary("sum"),
            "duplication": {"mean": round(statistics.fmean(dup), 3) if dup else None,
                            "final": round(s[-1]["sum"] / s[-1]["union"], 3)
                            if s and s[-1]["union"] else None},
            "per_engine_final": s[-1]["per_engine"] if s else None,
            "every": sampler.every, "at": [x["request"] for x in s]}


def capacity(ours: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    """Distinct blocks resident, ours / vLLM's union, mean over the samples and at the end."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return {"mean": ratio(ours["distinct"]["mean"], vllm["union"]["mean"]),
            "final": ratio(ours["distinct"]["final"], vllm["union"]["final"])}
