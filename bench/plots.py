"""PNG plots of a ``kvoffload bench`` report, where a picture says more than the table.

Optional: needs matplotlib (the ``bench`` extra; ``scripts/setup.sh`` installs it). Each plot
is drawn only when its suite is in the report, so ``--suite NAME`` runs still get theirs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_LATENCY_ROWS = ("vllm", "ours_single", "ours_single_big", "ours_batched_per_request")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legends outside the axes included
    plt.close(fig)
    return path


def _legend(ax: Any) -> None:
    """Beside the axes, never over the bars (inside, the tallest bar would hide under it)."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)


def _bars(ax: Any, labels: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [x + i * width for x in range(len(labels))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    _legend(ax)


def _hybrid_chat(plt: Any, suite: dict[str, Any], out: Path) -> list[Path]:
    variants: dict[str, dict[str, Any]] = suite.get("variants") or {}
    if not variants:
        return []
    names = list(variants)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    _bars(ax1, names, {q: [variants[n].get(f"ttft_ms_{q}", 0.0) for n in names]
                       for q in ("mean", "p50", "p99")}, "simulated TTFT (ms)")
    ax1.set_title("hybrid chat: time to first token")
    chunks = [variants[n].get("served_chunk_tokens", 0) for n in names]
    tails = [variants[n].get("served_tail_tokens", 0) for n in names]
    recomputed = [variants[n].get("recomputed_tokens", 0) for n in names]
    ax2.bar(names, chunks, label="served: complete chunks")
    ax2.bar(names, tails, bottom=chunks, label="served: partial tails")
    ax2.bar(names, recomputed, bottom=[c + t for c, t in zip(chunks, tails, strict=True)],
            label="recomputed")
    ax2.set_xticks(range(len(names)))
    ax2.set_xticklabels(names, rotation=20, ha="right")
    ax2.set_ylabel("prompt tokens")
    ax2.set_title("hybrid chat: where prompt tokens come from")
    _legend(ax2)
    return [_save(plt, fig, out / "hybrid_chat.png")]


def _lookup(plt: Any, suite: dict[str, Any], out: Path) -> list[Path]:
    rows = [r for r in _LATENCY_ROWS if isinstance(suite.get(r), dict)]
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.2))
    _bars(ax, rows, {q: [suite[r].get(f"{q}_us", 0.0) for r in rows] for q in ("p50", "p99")},
          "microseconds per request")
    ax.set_title(f"lookup of a {suite.get('prompt_tokens', '?')}-token prompt")
    return [_save(plt, fig, out / "lookup_latency.png")]


def _tiers(plt: Any, suite: dict[str, Any], out: Path) -> list[Path]:
    pairs: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    variants = suite.get("variants") or {}
    if "ours_small_pool" in variants and "ours_disk_tier" in variants:
        pairs.append(("disk tier", variants["ours_small_pool"], variants["ours_disk_tier"]))
    shared = suite.get("shared_tier") or {}
    if isinstance(shared.get("pool_only"), dict) and isinstance(shared.get("shared"), dict):
        pairs.append(("shared tier (2 nodes)", shared["pool_only"], shared["shared"]))
    if not pairs:
        return []
    labels = [p[0] for p in pairs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    _bars(ax1, labels, {"pool only": [p[1].get("served_tokens", 0) for p in pairs],
                        "with the tier": [p[2].get("served_tokens", 0) for p in pairs]},
          "prompt tokens served")
    _bars(ax2, labels, {"pool only": [p[1].get("ttft_ms_mean", 0.0) for p in pairs],
                        "with the tier": [p[2].get("ttft_ms_mean", 0.0) for p in pairs]},
          "mean simulated TTFT (ms)")
    fig.suptitle("tiers below a small pool")
    return [_save(plt, fig, out / "tiers.png")]


def _sharing(plt: Any, suite: dict[str, Any], out: Path) -> list[Path]:
    rows = sorted((k for k, v in suite.items() if k.startswith("engines_") and isinstance(
        v, dict) and isinstance(v.get("ours"), dict)), key=lambda k: int(k.split("_")[1]))
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = [f"{k.split('_')[1]} engines" for k in rows]
    _bars(ax, labels, {
        "one shared daemon (ours)": [suite[k]["ours"].get("offload_hit_tokens", 0) for k in rows],
        "per-engine vLLM offload, 1/N memory": [
            suite[k]["vllm"].get("offload_hit_tokens", 0) for k in rows]},
        "prompt tokens served by offload")
    ax.set_title("one cache for every engine (round-robin routing)")
    return [_save(plt, fig, out / "sharing.png")]


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    """Write the report's PNGs into ``out``; returns their paths ([] without matplotlib)."""
    try:
        plt = _pyplot()
    except ImportError:
        return []
    suites: dict[str, Any] = report.get("suites", {})
    paths: list[Path] = []
    if isinstance(suites.get("hybrid_chat"), dict):
        paths += _hybrid_chat(plt, suites["hybrid_chat"], out)
        paths += _tiers(plt, suites["hybrid_chat"], out)
    if isinstance(suites.get("lookup"), dict):
        paths += _lookup(plt, suites["lookup"], out)
    if isinstance(suites.get("sharing"), dict):
        paths += _sharing(plt, suites["sharing"], out)
    return paths
