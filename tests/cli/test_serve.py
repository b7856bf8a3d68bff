"""``kvoffload serve`` passes its flags on by name: every flag must be a setting."""

from __future__ import annotations

import argparse

from kvoffload.daemon.config import Config, load_config

from kvoffload.cli import build_parser
from kvoffload.cli.serve import _settings


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_serve_flag_names_a_setting() -> None:
    dests = {a.dest for a in _serve_parser()._actions} - {"help"}
    assert dests - set(Config.__struct_fields__) == {"config", "ready_file"}


def test_isolation_flags_reach_the_config() -> None:
    args = build_parser().parse_args([
        "serve", "--client-pool-share-pct", "30", "--client-max-pins", "7",
        "--reset-namespace", "operator", "--events-curve", "--curve-server-key", "/k/server", "--curve-client-keys", "/k/clients",
        "--max-clients-per-peer", "9"])
    config = load_config(None, env={}, flags=_settings(args))
    assert (config.client_pool_share_pct, config.client_max_pins, config.reset_namespace,
            config.events_curve, config.max_clients_per_peer) == (30, 7, "operator", True, 9)
    assert config.client_max_pending == 0  # not given: the default
