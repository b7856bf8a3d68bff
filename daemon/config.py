"""One typed settings object: a TOML file, then KVOFFLOAD_* environment variables, then flags.

Each layer overrides the one before. Every value is validated once, here, into ``Config``;
a bad value fails with ``ConfigError`` naming the key, where it came from and why.
"""

from __future__ import annotations

import enum
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
from kvoffload.daemon.store.eviction import policy_names

ENV_PREFIX = "KVOFFLOAD_"

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20,
          "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


class ConfigError(ValueError):
    """A setting is missing, unknown or invalid; the message names it and its source."""


class LogFormat(enum.StrEnum):
    TEXT = "text"
    JSON = "json"


def parse_size(value: str | int) -> int:
    """``64GiB``, ``512M``, ``1.5gib`` or a plain integer -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE_RE.match(str(value))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (examples: 1073741824, 512MiB, 64GiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def default_runtime_dir() -> Path:
    """systemd's RuntimeDirectory, else XDG_RUNTIME_DIR, else a per-user /tmp folder."""
    for var in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        if os.environ.get(var):
            base = Path(os.environ[var].split(":")[0])
            return base if var == "RUNTIME_DIRECTORY" else base / "kvoffload"
    return Path(f"/tmp/kvoffload-{os.getuid()}")


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    control: str = ""  # "" -> ipc://<runtime dir>/control.sock
    events: str | None = None
    events_replay: str | None = None
    lookup_events: str | None = None
    engine_events: list[str] = []
    engine_events_max_tokens: int = 8 << 20  # token budget of the engines' GPU-block index
    hub: str | None = None  # node hub PUB: engines' GPU events + our CPU events, one stream
    hub_replay: str | None = None  # hub ROUTER: vLLM replay plus the snapshot request
    hub_buffer_batches: int = 0  # hub replay buffer: extra cap in batches (0: none)
    # Router-facing event streams (docs/events.md, docs/routers.md): profile, topic, batching,
    # replay buffer (events and bytes, for --events, --hub and every view), per-engine views.
    events_profile: str = "full"  # "full", "dynamo" or "llm-d"
    events_tails: bool | None = None  # partial tails on the stream (None: the profile's default)
    events_ownership: str = ""  # value of BlockStored/BlockRemoved.ownership ("": absent)
    events_topic: str | None = None  # topic template with {node}, {model} (None: profile's)
    events_node: str = ""  # {node} in the topic ("": this host's name)
    events_model: str = ""  # {model} in the topic: the served model name routers hash with
    events_batch_events: int = 256  # at most this many events per batch (1: one per batch)
    events_buffer_events: int = 128 * 1024  # replay buffer bound in events
    events_buffer_bytes: int = 256 << 20  # replay buffer bound in payload bytes
    engine_views: list[str] = []  # "rank=R,events=EP[,replay=EP][,engine=I][,namespace=NS]"
    # View opened for each engine that sends its DP rank on Register: "events=EP[,replay=EP]"
    # with {rank} and {index} (0, 1, ... in opening order) filled in ("": none); tcp port 0
    # picks one port per view.
    engine_views_auto: str = ""
    event_hashes: str = "int"  # "int": last 8 bytes big-endian (vLLM's default); "bytes": raw
    http: str = "127.0.0.1:9400"
    pool_path: str = "/dev/shm/kvoffload-pool"
    pool_bytes: int = 1 << 30
    slot_bytes: int = 0  # 0: taken from the first engine that registers
    prefault: bool = True
    state_dir: str | None = None
    # A state dir that cannot be used at start (not a folder, read-only, full): "cold" starts
    # without warm restart, loudly and with kvoffload_state_dir_faulty = 1; "refuse" stops.
    state_dir_errors: str = "cold"
    disk_dir: str | None = None  # local disk tier for blocks evicted from the pool
    disk_bytes: int = 0  # its size bound; must be > 0 with disk_dir
    # Read bandwidth of the disk tier, for keeping tails: with an engine time model, a tail
    # evicted from the pool goes to disk only if reading it back beats recomputing it.
    disk_read_bytes_per_s: float = 6e9
    # Shared tier on a Mooncake Store cluster (daemon/tiers/mooncake/tier.py, docs/tiers.md).
    mooncake_master: str | None = None  # HOST:PORT of mooncake_master; None: tier off
    mooncake_metadata: str = ""  # metadata server URL; "": http://<master host>:8080/metadata
    mooncake_local_hostname: str = ""  # address peers reach us on; "": this host's IP
    mooncake_protocol: str = "tcp"  # "tcp" or "rdma"
    mooncake_device: str = ""  # RDMA device names (rdma only)
    mooncake_segment_bytes: int = 1 << 30  # memory this daemon lends to the shared store
    mooncake_buffer_bytes: int = 256 << 20  # client staging buffer; bounds one put batch
    mooncake_put: str = "commit"  # push blocks on "commit" (shared at once) or on "evict"
    log_format: LogFormat = LogFormat.TEXT
    log_level: str = "info"
    policy: str = "lru"
    lease_ms: int = 10_000
    # SIGTERM waits at most this long for pinned loads to finish before the index is
    # superseded (which fails loads still copying); 0: do not wait.
    drain_ms: int = 5_000
    max_message_bytes: int = 8 << 20  # one client can make the daemon hold ~40x this (security.md)
    max_keys_per_request: int = 1 << 16
    max_clients: int = 1024
    # The index published in shared memory for engines to read in place (<pool_path>.index).
    shared_index: bool = True
    # Most empty slots one engine may hold for its next stores (prepare_store never waits);
    # 0: no fixed number, an eighth of the pool (engines size their reservation to their
    # prefill rate; per-client quotas bound it too).
    max_reserved_slots: int = 0
    # A full pool grants engines READY blocks for their next stores, evicted only when a
    # store claims them (daemon/store/earmarks.py), instead of slots it empties ahead.
    earmark_reservations: bool = True
    # Per-client quotas (docs/security.md "Quotas"): slots one client may hold at once as
    # pins, pending stores and reservations together, in percent of the pool's slots; pending
    # stores (with reservations) and pins each have their own cap too (0: the share's number).
    client_pool_share_pct: int = 50
    client_max_pending: int = 0
    client_max_pins: int = 0
    # Client identities one peer may hold (its CURVE key on a CURVE socket, else its tcp
    # address; ipc peers are all the daemon's own user and are not limited per peer).
    max_clients_per_peer: int = 256
    # Reset(scope="namespace"): "sole" = allowed when the caller is the only live client
    # registered in the namespace, or presents the operator credential; "operator" = only
    # with the credential; "any" = every registrant (the old rule). scope="own" always works.
    reset_namespace: str = "sole"
    operator_token_file: str | None = None  # a 0600 file holding the operator credential
    curve_server_key: str | None = None  # daemon secret key file: CURVE on the control socket
    curve_client_keys: str | None = None  # allow-list: dir of NAME.key files, or one file
    # CURVE on the event sockets too (PUB and replay ROUTER of --events, --lookup-events,
    # --hub, engine views): same server key and allow-list; needs curve_server_key.
    events_curve: bool = False

    def __post_init__(self) -> None:
        if not self.control:
            self.control = f"ipc://{default_runtime_dir() / 'control.sock'}"
        checks = [
            ("pool_bytes", self.pool_bytes > 0, "must be positive"),
            ("slot_bytes", self.slot_bytes >= 0, "must be >= 0"),
            ("slot_bytes", self.slot_bytes <= self.pool_bytes, "must be <= pool_bytes"),
            ("lease_ms", self.lease_ms >= 100, "must be at least 100 ms"),
            ("policy", self.policy.strip().lower() in policy_names(),
             f"must be one of {', '.join(policy_names())}"),
            ("state_dir_errors", self.state_dir_errors in ("cold", "refuse"),
             "must be cold or refuse"),
            ("max_message_bytes", self.max_message_bytes >= 1024, "must be >= 1024"),
            ("max_keys_per_request", self.max_keys_per_request > 0, "must be positive"),
            ("max_clients", self.max_clients > 0, "must be positive"),
            ("max_reserved_slots", self.max_reserved_slots >= 0, "must be >= 0"),
            ("client_pool_share_pct", 1 <= self.client_pool_share_pct <= 100,
             "must be 1..100"),
            ("client_max_pending", self.client_max_pending >= 0, "must be >= 0"),
            ("client_max_pins", self.client_max_pins >= 0, "must be >= 0"),
            ("max_clients_per_peer", self.max_clients_per_peer > 0, "must be positive"),
            ("reset_namespace", self.reset_namespace in ("sole", "operator", "any"),
             "must be sole, operator or any"),
            ("disk_read_bytes_per_s", self.disk_read_bytes_per_s > 0, "must be positive"),
            ("disk_bytes", self.disk_bytes >= 0 and
             (self.disk_dir is None or self.disk_bytes > 0),
             "must be positive when disk_dir is set"),
            ("mooncake_master", self.mooncake_master is None or
             ":" in self.mooncake_master, "must be HOST:PORT"),
            ("mooncake_protocol", self.mooncake_protocol in ("tcp", "rdma"),
             "must be tcp or rdma"),
            ("mooncake_put", self.mooncake_put in ("commit", "evict"), "must be commit or evict"),
            ("mooncake_segment_bytes", self.mooncake_segment_bytes > 0, "must be positive"),
            ("mooncake_buffer_bytes", self.mooncake_buffer_bytes >= 1 << 20,
             "must be at least 1MiB"),
            ("curve_client_keys", bool(self.curve_client_keys) == bool(self.curve_server_key),
             "and curve_server_key must be set together"),
            ("events_curve", not self.events_curve or bool(self.curve_server_key),
             "needs curve_server_key and curve_client_keys"),
            ("http", ":" in self.http, "must be HOST:PORT"),
            ("event_hashes", self.event_hashes in ("int", "bytes"), "must be int or bytes"),
            ("events_profile", self.events_profile in ("full", "dynamo", "llm-d"),
             "must be full, dynamo or llm-d"),
            ("events_batch_events", self.events_batch_events >= 1, "must be >= 1"),
            ("events_buffer_events", self.events_buffer_events >= 1, "must be >= 1"),
            ("events_buffer_bytes", self.events_buffer_bytes >= 1, "must be >= 1"),
            ("engine_views_auto", _auto_view_ok(self.engine_views_auto),
             "must be events=EP[,replay=EP][,engine=I][,namespace=NS][,topic=T], {rank} allowed"),
            ("events_ownership", not (self.events_ownership and self.events_profile == "dynamo"),
             "cannot be set with the dynamo profile (Dynamo 1.6.1 drops such events)"),
            ("control", "://" in self.control, "must be a ZMQ endpoint like ipc:///run/x.sock"),
            ("log_level", self.log_level.lower() in
             ("debug", "info", "warning", "error"), "must be debug, info, warning or error"),
        ]
        for key, ok, why in checks:
            if not ok:
                raise ValueError(f"{key} {why} (got {getattr(self, key)!r})")
        if clash := _auto_view_clash(self):
            raise ValueError(f"engine_views_auto {clash}")

    @property
    def http_host_port(self) -> tuple[str, int]:
        host, _, port = self.http.rpartition(":")
        return host.strip("[]") or "127.0.0.1", int(port)


def _auto_view_ok(template: str) -> bool:
    from kvoffload.events.profiles import auto_view_spec

    try:
        return not template or auto_view_spec(template, 0) is not None
    except ValueError:
        return False


_ANY_HOST = {"*", "0.0.0.0", "::", "[::]", ""}


def _bind_key(endpoint: str) -> tuple[str, str, int] | None:
    """("tcp", host, port) or ("ipc", path, 0) of an endpoint the daemon binds; None when it
    binds nothing that can clash (a connect:, tcp port 0 or *, an unknown scheme)."""
    if endpoint.startswith("connect:"):
        return None
    scheme, _, rest = endpoint.partition("://")
    if scheme == "ipc" and rest:
        return ("ipc", rest, 0)
    host, _, port = rest.rpartition(":")
    if scheme not in ("tcp", "http") or not port.isdigit() or int(port) == 0:
        return None
    return ("tcp", "127.0.0.1" if host == "localhost" else host, int(port))


def _clashes(a: tuple[str, str, int], b: tuple[str, str, int]) -> bool:
    if a[0] != b[0] or a[2] != b[2]:
        return False
    # A wildcard address holds the port on every interface.
    return a[1] == b[1] or (a[0] == "tcp" and (a[1] in _ANY_HOST or b[1] in _ANY_HOST))


def _auto_view_clash(cfg: Config) -> str | None:
    """Why a view the template would open binds an endpoint the daemon binds itself (its
    control socket, event streams, static views, HTTP), or None.

    Every view the template can make is checked ({index} 0..MAX_AUTO_VIEWS-1, {rank} the
    same range): a clash found when an engine registers would leave it without a view."""
    if not cfg.engine_views_auto:
        return None
    from kvoffload.daemon.streams.views import MAX_AUTO_VIEWS
    from kvoffload.events.profiles import auto_view_spec, parse_view_spec

    own: list[tuple[str, str | None]] = [
        ("--control", cfg.control), ("--events", cfg.events),
        ("--events-replay", cfg.events_replay), ("--lookup-events", cfg.lookup_events),
        ("--hub", cfg.hub), ("--hub-replay", cfg.hub_replay), ("--http", f"http://{cfg.http}")]
    for spec in cfg.engine_views:
        view = parse_view_spec(spec)
        own += [(f"--engine-view {spec}", view.endpoint), (f"--engine-view {spec}", view.replay)]
    taken = [(flag, ep.removeprefix("http://"), key) for flag, ep in own
             if ep and (key := _bind_key(ep)) is not None]
    ranks = range(MAX_AUTO_VIEWS) if "{rank}" in cfg.engine_views_auto else range(1)
    for index in range(MAX_AUTO_VIEWS if "{index}" in cfg.engine_views_auto else 1):
        for rank in ranks:
            view = auto_view_spec(cfg.engine_views_auto, rank, index)
            for ep in (view.endpoint, view.replay):
                mine = _bind_key(ep) if ep else None
                if mine is not None and mine[2] > 65535:
                    return (f"{cfg.engine_views_auto!r}: view {index} (DP rank {rank}) would "
                            f"bind {ep}, past port 65535")
                for flag, theirs, key in taken:
                    if mine is not None and _clashes(mine, key):
                        return (f"{cfg.engine_views_auto!r}: view {index} (DP rank {rank}) would "
                                f"bind {ep}, which {flag} {theirs} holds; give the views ports "
                                "of their own")
    return None


# KVOFFLOAD_* variables that are not daemon settings, so never an unknown-setting error: the
# config file's path, what clients read (connector), and the set-up and test switches the
# docs tell users to set (scripts/setup*.sh, the test suite, the vLLM plugin, the benches),
# which end up in the environment the daemon starts from. Any other KVOFFLOAD_* is a setting
# and a misspelt one is refused (tests/daemon/test_config.py checks every documented name).
NOT_SETTINGS_ENV = frozenset({
    "KVOFFLOAD_CONFIG",
    "KVOFFLOAD_CURVE_CLIENT_KEY", "KVOFFLOAD_CURVE_SERVER_PUBLIC_KEY",
    "KVOFFLOAD_ALLOW_UNTESTED_VLLM",  # connector/vllm/settings.py
    "KVOFFLOAD_BENCH_DIR",  # bench/copy_buffers.py
    "KVOFFLOAD_DYNAMO_VENV",  # scripts/setup_dynamo.sh, tests/dynamo_helpers.py
    # scripts/mutants.py sets both for the tests it runs, whose daemons inherit them.
    "KVOFFLOAD_MUTANT_ROOT", "KVOFFLOAD_STRESS_S",
})
# Set-up and test switches: every KVOFFLOAD_SKIP_* (SKIP_VLLM, SKIP_APT, SKIP_MOONCAKE,
# SKIP_PROMETHEUS, SKIP_DYNAMO and any later one); no setting starts with it.
NOT_SETTINGS_PREFIX = "KVOFFLOAD_SKIP_"
_SIZE_KEYS = {"pool_bytes", "slot_bytes", "max_message_bytes", "disk_bytes",
              "events_buffer_bytes",
              "mooncake_segment_bytes", "mooncake_buffer_bytes"}
_FIELDS = {f.name: f for f in msgspec.structs.fields(Config)}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _coerce(key: str, raw: Any, source: str) -> Any:
    if key not in _FIELDS:
        raise ConfigError(f"{source}: unknown setting {key!r} (known: {', '.join(sorted(_FIELDS))})")
    try:
        if key in _SIZE_KEYS:
            return parse_size(raw)
        if isinstance(raw, str) and source.startswith("environment"):
            # Environment values are strings: convert them the way the field expects.
            if key in ("engine_events", "engine_views"):
                # ";" or whitespace separates engines: "," already pairs EP,REPLAY_EP.
                return [e for e in re.split(r"[;\s]+", raw) if e]
            if _FIELDS[key].type in (bool, bool | None):
                word = raw.strip().lower()
                if word not in _TRUE + _FALSE:
                    raise ValueError(f"{raw!r} is not one of {', '.join(_TRUE + _FALSE)}")
                return word in _TRUE
            if _FIELDS[key].type in (int, "int"):
                return int(raw)
        return raw
    except ValueError as exc:
        raise ConfigError(f"{source}: setting {key!r}: {exc}") from None


def is_not_setting(name: str) -> bool:
    """A KVOFFLOAD_* environment variable that the daemon's settings loader leaves alone."""
    return name in NOT_SETTINGS_ENV or name.startswith(NOT_SETTINGS_PREFIX)


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Config:
    """Merge file, environment and flags (later wins) and validate into one ``Config``."""
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        for key, raw in data.get("kvoffload", data).items():
            merged[key] = _coerce(key, raw, f"config file {path}")
            sources[key] = f"config file {path}"
    for name, raw in (os.environ if env is None else env).items():
        if name.startswith(ENV_PREFIX) and not is_not_setting(name):
            key = name[len(ENV_PREFIX):].lower()
            merged[key] = _coerce(key, raw, f"environment {name}")
            sources[key] = f"environment {name}"
    for key, raw in (flags or {}).items():
        if raw is not None:
            merged[key] = _coerce(key, raw, f"flag --{key.replace('_', '-')}")
            sources[key] = f"flag --{key.replace('_', '-')}"
    try:
        return msgspec.convert(merged, Config)
    except msgspec.ValidationError as exc:
        text = str(exc)
        # "... at `$.key`" from msgspec, or "key must ..." from Config.__post_init__.
        m = re.search(r"\$\.(\w+)", text) or re.match(r"(\w+) ", text)
        key = m.group(1) if m and m.group(1) in _FIELDS else None
        where = sources.get(key, "settings") if key else "settings"
        raise ConfigError(f"{where}: {text}") from None
