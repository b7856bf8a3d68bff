"""`kvoffload bench` plots: one PNG per picture, drawn from the suites present in a report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvoffload.bench.plots import write_plots

PNG = b"\x89PNG\r\n\x1a\n"


def variant(served: int, ttft: float) -> dict[str, float]:
    return {"served_chunk_tokens": served * 0.8, "served_tail_tokens": served * 0.2,
            "recomputed_tokens": 1000 - served, "served_tokens": served, "ttft_ms_mean": ttft,
            "ttft_ms_p50": ttft * 0.8, "ttft_ms_p99": ttft * 3}


def test_each_suite_gets_its_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need the bench extra (matplotlib)")
    report = {"suites": {
        "hybrid_chat": {"variants": {"no_offload": variant(0, 100.0), "ours": variant(800, 20.0),
                                     "ours_small_pool": variant(300, 60.0),
                                     "ours_disk_tier": variant(700, 30.0)},
                        "shared_tier": {"pool_only": variant(300, 70.0),
                                        "shared": variant(650, 35.0)}},
        "lookup": {"prompt_tokens": 32768, "vllm": {"p50_us": 120.0, "p99_us": 300.0},
                   "ours_single": {"p50_us": 280.0, "p99_us": 1000.0}},
    }}
    paths = write_plots(report, tmp_path)
    assert sorted(p.name for p in paths) == ["hybrid_chat.png", "lookup_latency.png",
                                             "tiers.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 5_000
    # A report without those suites draws nothing (and does not fail).
    assert write_plots({"suites": {"events": {"ratio": 4.0}}}, tmp_path / "none") == []


def test_bench_cli_links_its_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib", reason="plots need the bench extra (matplotlib)")
    from kvoffload.bench import runner as cli

    def fake_suite(quick: bool) -> dict:
        return {"ratio": 0.5, "target": 0.9, "meets": True,
                "variants": {"ours": variant(800, 20.0), "no_offload": variant(0, 100.0)}}

    monkeypatch.setattr(cli, "_suite", lambda name: fake_suite)
    out = tmp_path / "out"
    from kvoffload.cli import main

    rc = main(["bench", "--suite", "hybrid_chat", "--out", str(out)])
    assert rc == 0
    assert (out / "hybrid_chat.png").exists()
    assert "![hybrid_chat](hybrid_chat.png)" in (out / "bench.md").read_text()
    assert json.loads((out / "bench.json").read_text())["suites"]["hybrid_chat"]["meets"]


def test_legends_do_not_cover_bars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every legend's box on the canvas is clear of every bar of its figure."""
    pytest.importorskip("matplotlib", reason="plots need the bench extra (matplotlib)")
    from kvoffload.bench import plots

    checked: list[int] = []
    real_save = plots._save

    def save(plt, fig, path):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is None:
                continue
            box = legend.get_window_extent(renderer)
            for other in fig.axes:
                for bar in other.patches:
                    if bar.get_height():
                        assert not box.overlaps(bar.get_window_extent(renderer)), path.name
            checked.append(1)
        return real_save(plt, fig, path)

    monkeypatch.setattr(plots, "_save", save)
    tall = variant(1000, 500.0)  # the tallest bars reach the top, where legends used to sit
    report = {"suites": {
        "hybrid_chat": {"variants": {"no_offload": variant(0, 100.0), "ours": tall,
                                     "ours_small_pool": variant(300, 60.0),
                                     "ours_disk_tier": tall},
                        "shared_tier": {"pool_only": variant(300, 70.0), "shared": tall}},
        "lookup": {"prompt_tokens": 32768, "vllm": {"p50_us": 120.0, "p99_us": 300.0},
                   "ours_single": {"p50_us": 280.0, "p99_us": 1000.0}},
        "sharing": {"engines_2": {"ours": {"offload_hit_tokens": 900},
                                  "vllm": {"offload_hit_tokens": 400}},
                    "engines_4": {"ours": {"offload_hit_tokens": 950},
                                  "vllm": {"offload_hit_tokens": 30}}},
    }}
    paths = plots.write_plots(report, tmp_path)
    assert "sharing.png" in [p.name for p in paths]
    assert len(checked) >= 5  # hybrid_chat x2, tiers x2, lookup, sharing
