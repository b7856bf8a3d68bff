"""What ``kvoffload bench`` adds to a suite's result: a reason when it misses, and the spread
over seeds when it ran more than once.

A reason names the sub-target that missed and by how much. Suites that know their sub-targets
write ``reason`` themselves; for the others it follows from ``ratio`` against ``target`` in the
suite's direction (``DIRECTION``, or the suite's own ``direction`` field).
"""

from __future__ import annotations

import statistics
from typing import Any

MET = "all sub-targets met"


def reason_of(missed: list[str]) -> str:
    """A suite's ``reason``: every missed sub-target with its numbers, or that all were met."""
    return "; ".join(missed) if missed else MET
# ">=": ours must reach the target (higher is better); "<=": must stay under it.
DIRECTION = {"events": ">=", "copy": ">=", "sharing": ">=", "lookup": "<=", "memory": "<=",
             "load": "<=", "hybrid_chat": "<=", "engine_chat": "<="}


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def generic_reason(name: str, r: dict[str, Any]) -> str:
    """Why ``r`` is (not) met, from its ratio and target alone."""
    if r.get("not_run") or r.get("error"):
        # The last line of what went wrong (a daemon's traceback ends with the exception).
        text = str(r.get("not_run") or r.get("error")).replace("\\n", "\n").strip()
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() not in ("", "')", '")')]
        last = lines[-1] if lines else "?"
        return f"not run: {last[:300]}"
    ratio, target = r.get("ratio"), r.get("target")
    direction = r.get("direction") or DIRECTION.get(name)
    if r.get("meets") is True:
        return MET
    if ratio is None:
        return "no ratio measured"
    if not (_is_num(ratio) and _is_num(target)) or direction not in (">=", "<="):
        return f"ratio {ratio} vs target {target!r} not met (the suite names no sub-target)"
    ok = ratio >= target if direction == ">=" else ratio <= target
    if ok:  # the headline holds, so something else the suite checks did not
        return (f"ratio {ratio} meets {direction} {target}, but another check of the suite "
                "failed (it names none: see its fields)")
    off = abs(ratio - target) / abs(target) * 100 if target else float("inf")
    word = "below" if direction == ">=" else "above"
    return f"ratio {ratio} is {off:.1f} % {word} the target ({direction} {target})"


def fill_reason(name: str, r: dict[str, Any]) -> dict[str, Any]:
    """``r`` with a ``reason``; a suite's own reason is kept."""
    if not r.get("reason"):
        r["reason"] = generic_reason(name, r)
    return r


def _ratio_keys(results: list[dict[str, Any]]) -> list[str]:
    """Headline numbers to spread: ``ratio`` and any other top-level ``ratio*`` number."""
    keys = {k for r in results for k, v in r.items() if k.startswith("ratio") and _is_num(v)}
    return sorted(keys, key=lambda k: (k != "ratio", k))


def aggregate_seeds(runs: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """One result from per-seed results: the first seed's details, the median ratio, ``meets``
    only if every seed met, and ``seeds`` with min / median / max and per-seed values."""
    results = [r for _, r in runs]
    out = dict(results[0])
    seeds: dict[str, Any] = {"n": len(runs), "per_seed": []}
    for key in _ratio_keys(results):
        values = [r[key] for r in results if _is_num(r.get(key))]
        spread = {"min": min(values), "median": statistics.median(values), "max": max(values)}
        if key == "ratio":
            seeds.update(spread)
            out["ratio"] = spread["median"]
        else:
            seeds[key] = spread
            out[key] = spread["median"]
    if "min" not in seeds:
        seeds.update({"min": None, "median": None, "max": None})
    for seed, r in runs:
        row = {"seed": seed, "meets": r.get("meets")}
        row.update({k: r[k] for k in _ratio_keys([r])})
        if r.get("meets") is not True and r.get("reason"):
            row["reason"] = r["reason"]
        if r.get("error"):
            row["error"] = r["error"]
        seeds["per_seed"].append(row)
    out["seeds"] = seeds
    out["meets"] = all(r.get("meets") is True for r in results)
    missed = [f"seed {row['seed']}: {row.get('reason') or row.get('error') or 'not met'}"
              for row in seeds["per_seed"] if row["meets"] is not True]
    out["reason"] = reason_of(missed)
    return out
