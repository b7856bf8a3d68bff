"""The ``kvoffload`` command: parses arguments, then delegates. Nothing else lives here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvoffload import __version__


def _add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("serve", help="run the offload daemon")
    s.add_argument("--config", help="TOML settings file (then KVOFFLOAD_* env, then flags)")
    s.add_argument("--control", help="control endpoint (default ipc://<runtime dir>/control.sock)")
    s.add_argument("--events", help="PUB endpoint for the daemon's KV events")
    s.add_argument("--events-replay", help="ROUTER endpoint for KV-event replay")
    s.add_argument("--lookup-events", help="PUB endpoint for lookup / miss-reason events")
    s.add_argument("--engine-events", action="append",
                   help="an engine's KV-event endpoint EP[,REPLAY_EP] (repeatable)")
    s.add_argument("--engine-events-max-tokens", type=int,
                   help="token budget of the engines' GPU-block index (8388608)")
    s.add_argument("--hub", help="PUB endpoint of the node event hub (engines' + daemon's events)")
    s.add_argument("--hub-replay", help="ROUTER endpoint of the hub: replay and snapshots")
    s.add_argument("--hub-buffer-batches", type=int,
                   help="extra cap on the hub replay buffer in batches (0: none)")
    s.add_argument("--events-profile", choices=["full", "dynamo", "llm-d"],
                   help="what the router-facing streams carry (docs/routers.md; full)")
    s.add_argument("--events-tails", action=argparse.BooleanOptionalAction, default=None,
                   help="partial tails on the stream (default: the profile's)")
    s.add_argument("--events-ownership", help="ownership value on stored/removed events")
    s.add_argument("--events-topic", help="topic template, {node} and {model} filled in")
    s.add_argument("--events-node", help="{node} of the topic (default: host name)")
    s.add_argument("--events-model", help="{model} of the topic: the served model name")
    s.add_argument("--events-batch-events", type=int,
                   help="most events per batch; events of one loop turn share a batch (256)")
    s.add_argument("--events-buffer-events", type=int, help="replay buffer in events (131072)")
    s.add_argument("--events-buffer-bytes", help="replay buffer in payload bytes (256MiB)")
    s.add_argument("--engine-view", dest="engine_views", action="append",
                   help="per-engine stream rank=R,events=EP[,replay=EP][,engine=I] (repeatable)")
    s.add_argument("--engine-views-auto",
                   help="view for each engine that sends its DP rank on Register: "
                        "events=EP[,replay=EP], {rank} and {index} filled in")
    s.add_argument("--event-hashes", choices=["int", "bytes"],
                   help="block hashes in events as integers (vLLM's default) or raw bytes")
    s.add_argument("--http", help="HOST:PORT for /healthz /readyz /metrics (127.0.0.1:9400)")
    s.add_argument("--pool-path", help="shared-memory pool file (/dev/shm/kvoffload-pool)")
    s.add_argument("--pool-bytes", help="pool size, e.g. 64GiB")
    s.add_argument("--slot-bytes", help="bytes per pool slot (default: first engine's block)")
    s.add_argument("--state-dir", help="directory for state that survives restarts")
    s.add_argument("--state-dir-errors", choices=["cold", "refuse"],
                   help="a state dir that cannot be used at start: start cold with a warning "
                        "(default) or refuse to start")
    s.add_argument("--disk-dir", help="local disk tier: directory for blocks evicted from "
                   "the pool")
    s.add_argument("--disk-bytes", help="size bound of the disk tier, e.g. 1TiB")
    s.add_argument("--disk-read-bytes-per-s", type=float,
                   help="disk read bandwidth for keeping tails worth it (default 6e9)")
    s.add_argument("--mooncake-master", help="shared tier: HOST:PORT of a mooncake_master "
                   "(docs/tiers.md)")
    s.add_argument("--mooncake-metadata", help="Mooncake metadata server URL "
                   "(http://<master host>:8080/metadata)")
    s.add_argument("--mooncake-local-hostname", help="address other nodes reach this "
                   "daemon's store segment on (this host's IP)")
    s.add_argument("--mooncake-protocol", choices=["tcp", "rdma"], help="transport (tcp)")
    s.add_argument("--mooncake-device", help="RDMA device names, e.g. mlx5_0 (rdma only)")
    s.add_argument("--mooncake-segment-bytes", help="memory lent to the shared store (1GiB)")
    s.add_argument("--mooncake-buffer-bytes", help="client staging buffer (256MiB)")
    s.add_argument("--mooncake-put", choices=["commit", "evict"],
                   help="push blocks to the store on commit (default) or on eviction")
    # No argparse choices: a bad value gets the same one line as from a file or the env.
    s.add_argument("--policy", help="eviction policy: lru (default) or arc")
    s.add_argument("--lease-ms", type=int, help="client lease in milliseconds (10000)")
    s.add_argument("--log-format", choices=["text", "json"])
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    s.add_argument("--curve-server-key", help="daemon secret key file: CURVE on the control "
                   "socket (see kvoffload keys, docs/security.md)")
    s.add_argument("--curve-client-keys", help="allowed client public keys: a directory of "
                   "NAME.key files or one file of z85 keys")
    s.add_argument("--ready-file", help="write {pid, control, http} as JSON here when ready")
    s.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    import os

    from kvoffload.daemon.config import ConfigError, load_config
    from kvoffload.daemon.logs import setup_logging
    from kvoffload.daemon.server import run
    from kvoffload.daemon.startup import StartFault

    keys = ["curve_server_key", "curve_client_keys", "control", "events", "events_replay", "lookup_events", "engine_events",
            "event_hashes", "http",
            "pool_path", "pool_bytes", "slot_bytes", "state_dir", "state_dir_errors", "policy", "lease_ms",
            "log_format", "log_level", "engine_events_max_tokens", "hub", "hub_replay",
            "hub_buffer_batches", "events_profile", "events_tails", "events_ownership",
            "events_topic", "events_node", "events_model", "events_batch_events",
            "events_buffer_events", "events_buffer_bytes", "engine_views", "engine_views_auto", "disk_dir", "disk_bytes", "disk_read_bytes_per_s", "mooncake_master",
            "mooncake_metadata", "mooncake_local_hostname", "mooncake_protocol",
            "mooncake_device", "mooncake_segment_bytes", "mooncake_buffer_bytes",
            "mooncake_put"]
    try:
        config = load_config(args.config or os.environ.get("KVOFFLOAD_CONFIG"),
                             flags={k: getattr(args, k) for k in keys})
    except ConfigError as exc:
        print(f"kvoffload: configuration error: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_format, config.log_level)
    try:
        return run(config, args.ready_file)
    except StartFault as exc:
        print(f"kvoffload: cannot start: {exc}", file=sys.stderr)
        return 1


def _add_demo(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    d = sub.add_parser("demo", help="a daemon plus a simulated hybrid-model engine")
    d.add_argument("--connect", help="use a running daemon's control endpoint")
    from kvoffload.bench.workload import PRESETS

    d.add_argument("--preset", default="qwen3.6-27b-tp1", metavar="NAME",
                   help=f"model geometry, one of: {', '.join(sorted(PRESETS))} "
                        "(default qwen3.6-27b-tp1)")
    d.add_argument("--scale", type=float, default=1 / 1024,
                   help="byte scale factor so the run fits this machine (default 1/1024)")
    d.add_argument("--requests", type=int, default=300, help="requests (turns) to simulate")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--pool-bytes", default="64MiB", help="pool size of the embedded daemon")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.add_argument("--daemon-wait", type=float, default=10.0, metavar="S",
                   help="how long to wait for a daemon that stopped answering (default 10 s)")
    d.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace) -> int:
    from kvoffload.bench.demo import main as demo_main

    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvoffload", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvoffload {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_demo(sub)
    from kvoffload.events.tail import add_events_parser

    add_events_parser(sub)
    from kvoffload.daemon.stats_cli import add_stats_parser

    add_stats_parser(sub)
    from kvoffload.daemon.keys_cli import add_keys_parser

    add_keys_parser(sub)
    try:
        from kvoffload.bench.cli import add_bench_parser
    except ImportError:  # the bench package is optional in minimal installs
        pass
    else:
        add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
