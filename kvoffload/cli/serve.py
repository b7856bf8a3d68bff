"""``kvoffload serve``: parse the daemon's flags, then run it (``kvoffload.daemon.server``)."""

from __future__ import annotations

import argparse
import os
import sys

# Parsed values that are not daemon settings: everything else on the namespace is one.
_NOT_SETTINGS = {"command", "handler", "config", "ready_file"}


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    s.add_argument("--drain-ms", type=int,
                   help="on SIGTERM, longest wait for loads in flight before stopping (5000)")
    s.add_argument("--log-format", choices=["text", "json"])
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    s.add_argument("--curve-server-key", help="daemon secret key file: CURVE on the control "
                   "socket (see kvoffload keys, docs/security.md)")
    s.add_argument("--curve-client-keys", help="allowed client public keys: a directory of "
                   "NAME.key files or one file of z85 keys")
    s.add_argument("--events-curve", action=argparse.BooleanOptionalAction, default=None,
                   help="CURVE on the event sockets too (the control socket's keys and "
                        "allow-list)")
    # Isolation between clients (docs/security.md, "Quotas"); no argparse choices, so a bad
    # value gets the same one line as from a file or the environment.
    s.add_argument("--reset-namespace", help="who may Reset a whole namespace: sole (default: "
                   "its only live client), operator (the credential only) or any")
    s.add_argument("--operator-token-file", help="0600 file holding the operator credential")
    s.add_argument("--client-pool-share-pct", type=int, help="most of the pool one client may hold in "
                   "pins, pending stores and reservations, in percent (50)")
    s.add_argument("--client-max-pending", type=int, help="pending stores per client (0: the share)")
    s.add_argument("--client-max-pins", type=int, help="pins per client (0: the share)")
    s.add_argument("--max-clients-per-peer", type=int, help="identities per CURVE key or tcp peer (256)")
    s.add_argument("--earmark-reservations", action=argparse.BooleanOptionalAction,
                   default=None, help="a full pool reserves READY blocks for engines' next "
                   "stores, evicted only when claimed, instead of emptying slots ahead")
    s.add_argument("--ready-file", help="write {pid, control, http} as JSON here when ready")
    s.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvoffload.daemon.config import ConfigError, load_config
    from kvoffload.daemon.logs import setup_logging
    from kvoffload.daemon.preflight import StartFault
    from kvoffload.daemon.server import run

    try:
        config = load_config(args.config or os.environ.get("KVOFFLOAD_CONFIG"),
                             flags=_settings(args))
    except ConfigError as exc:
        print(f"kvoffload: configuration error: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_format, config.log_level)
    try:
        return run(config, args.ready_file)
    except StartFault as exc:
        print(f"kvoffload: cannot start: {exc}", file=sys.stderr)
        return 1


def _settings(args: argparse.Namespace) -> dict[str, object]:
    """Every flag is a setting of the same name (so a new flag needs no list kept here)."""
    return {k: v for k, v in vars(args).items() if k not in _NOT_SETTINGS}
