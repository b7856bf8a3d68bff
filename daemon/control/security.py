"""CURVE authentication for the control socket: key files, the ZAP allow-list, client keys.

Server side (``CurveGuard``): the control ROUTER becomes a CURVE server with the daemon's key
pair, and a ZAP handler (RFC 27, bound in the daemon's own ZMQ context) admits only clients
whose public key is on the allow-list. ``zap_enforce_domain`` makes the socket fail closed: if
the ZAP handler is missing, nobody gets in. Rejections are counted in
``kvoffload_auth_rejected_total{reason}``:

- ``unknown_key``: a CURVE client whose public key is not allowed (counted by the ZAP handler);
- ``handshake``: a peer that failed the handshake before ZAP (a plain NULL-mechanism client,
  garbage on the port, a client holding the wrong server key), seen by a socket monitor.

Key files (see docs/security.md):

- a *secret* key file is a ``zmq.auth`` certificate (``NAME.key_secret``, as written by
  ``kvoffload keys`` or ``zmq.auth.create_certificates``) or a file holding only the 40-char
  z85 secret key; it must not be readable by group or others;
- a *public* key is a ``NAME.key`` certificate, a file holding one z85 key, or the z85 text;
- the allow-list is a directory (every file in it except ``*.key_secret`` is read) or one
  file; each file is a ``zmq.auth`` public certificate or z85 public keys, one per line
  (the first word of a line; the rest is a label; a line starting with ``#`` that is not a
  key is a comment). It is re-read when it changes, so revoking a key needs no restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from prometheus_client import CollectorRegistry, Counter
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("kvoffload.daemon")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27: libzmq asks ZAP here
ZAP_DOMAIN = b"kvoffload"
EVENTS_ZAP_DOMAIN = b"kvoffload-events"  # the event sockets (events_curve): same allow-list


def curve_server_options(sock: Any, server: KeyPair, domain: bytes = ZAP_DOMAIN) -> None:
    """Make ``sock`` a CURVE server that fails closed; call before it binds."""
    sock.curve_server = True
    sock.curve_secretkey = server.secret
    sock.curve_publickey = server.public
    sock.zap_domain = domain
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler -> nobody is admitted
# Client-side environment variables (not daemon settings: config.load_config must skip them).
ENV_CLIENT_KEY = "KVOFFLOAD_CURVE_CLIENT_KEY"
ENV_SERVER_PUBLIC_KEY = "KVOFFLOAD_CURVE_SERVER_PUBLIC_KEY"
CLIENT_ENV_VARS = frozenset({ENV_CLIENT_KEY, ENV_SERVER_PUBLIC_KEY})


class SecurityConfigError(ValueError):
    """A key file or allow-list is missing, unreadable, too open or not a CURVE key."""


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # z85, 40 bytes
    secret: bytes


def _z85_key(text: bytes | str, where: str) -> bytes:
    key = text.encode() if isinstance(text, str) else text
    key = key.strip()
    try:
        ok = len(key) == 40 and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):  # z85 raises KeyError on a bad character
        ok = False
    if not ok:
        raise SecurityConfigError(f"{where}: not a 40-character z85 CURVE key")
    return key


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"cannot read key file {path}: {exc}") from None


def load_keypair(path: str | os.PathLike[str]) -> KeyPair:
    """A secret key file (certificate or plain z85) -> the pair; refuses a file others read."""
    p = Path(path)
    data = _read(p)
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecurityConfigError(f"secret key file {p} is accessible by group or others "
                                  f"(mode {stat.S_IMODE(mode):04o}); chmod 600 it")
    if b"secret-key" in data:
        public, secret = zmq.auth.load_certificate(p)
        if secret is None:  # pragma: no cover - guarded by the b"secret-key" test above
            raise SecurityConfigError(f"{p}: no secret-key in the certificate")
        secret = _z85_key(secret, str(p))
        return KeyPair(public=_z85_key(public, str(p)), secret=secret)
    if b"public-key" in data:
        raise SecurityConfigError(f"{p} is a public certificate; a secret key is needed here "
                                  "(the NAME.key_secret file)")
    secret = _z85_key(data, str(p))
    return KeyPair(public=zmq.curve_public(secret), secret=secret)


def _public_keys_in(path: Path) -> set[bytes]:
    data = _read(path)
    if b"public-key" in data:
        try:
            public, _ = zmq.auth.load_certificate(path)
        except ValueError as exc:
            raise SecurityConfigError(f"{path}: {exc}") from None
        return {_z85_key(public, str(path))}
    keys = set()
    for n, raw in enumerate(data.splitlines(), 1):
        words = raw.split()
        if not words:
            continue
        # '#' is a z85 character: a line is a key if its first word is one, else a comment
        # when it starts with '#'. Anything after the key is a free-text label.
        if words[0].startswith(b"#") and len(words[0]) != 40:
            continue
        keys.add(_z85_key(words[0], f"{path} line {n}"))
    return keys


def load_public_key(value: str | os.PathLike[str]) -> bytes:
    """A public key given as z85 text, a ``NAME.key`` certificate or a plain z85 file."""
    text = os.fspath(value)
    if len(text.strip()) == 40 and not os.path.exists(text):
        return _z85_key(text, "public key")
    keys = _public_keys_in(Path(text))
    if len(keys) != 1:
        raise SecurityConfigError(f"{text}: expected exactly one public key, found {len(keys)}")
    return keys.pop()


def load_allow_list(path: str | os.PathLike[str]) -> set[bytes]:
    """Every allowed client public key (z85) in a directory of key files or in one file."""
    p = Path(path)
    if p.is_dir():
        keys: set[bytes] = set()
        for f in sorted(p.iterdir()):
            if f.is_file() and not f.name.endswith(".key_secret") and not f.name.startswith("."):
                keys |= _public_keys_in(f)
        return keys
    if not p.exists():
        raise SecurityConfigError(f"client allow-list {p} does not exist")
    return _public_keys_in(p)


class AllowList:
    """The allowed keys, re-read when the file or directory changes (revocation, additions).

    Fails closed: when the list cannot be read whole (deleted, unreadable, one bad file), no
    key is admitted until it can, and the log says so once per change. Keeping the last good
    list would keep a revoked key admitted by deleting or breaking the list."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp = self._mtime()
        self.keys = load_allow_list(self.path)
        self.failed: str | None = None  # why the list is denying everyone, if it is

    def _mtime(self) -> tuple[tuple[str, int, int], ...] | None:
        """Name, mtime and size of the list and every file in it; None if unreadable."""
        p = self.path
        try:
            files = [p] + (sorted(p.iterdir()) if p.is_dir() else [])
            stamps = []
            for f in files:
                st = f.stat()
                stamps.append((f.name, st.st_mtime_ns, st.st_size))
            return tuple(stamps)
        except OSError:
            return None

    def _reload(self) -> None:
        try:
            keys = load_allow_list(self.path)
        except (SecurityConfigError, OSError) as exc:
            self.keys, self.failed = set(), str(exc)
            log.error("client allow-list %s cannot be read (%s): refusing every client until "
                      "it can", self.path, exc)
            return
        self.keys, self.failed = keys, None
        log.info("client allow-list %s reloaded: %d keys", self.path, len(keys))

    def allowed(self, key: bytes) -> bool:
        stamp = self._mtime()
        if stamp is None:
            if self.failed is None or self._stamp is not None:
                self.keys, self.failed = set(), f"{self.path} is missing or unreadable"
                log.error("client allow-list %s is missing or unreadable: refusing every "
                          "client until it is back", self.path)
            self._stamp = None
        elif stamp != self._stamp:
            self._stamp = stamp
            self._reload()
        return key in self.keys


class CurveGuard:
    """Makes a ROUTER a CURVE server that admits only allow-listed clients, and counts the rest."""

    def __init__(self, ctx: zmq.asyncio.Context, server: KeyPair, allow: AllowList,
                 registry: CollectorRegistry | None = None) -> None:
        self.ctx = ctx
        self.server = server
        self.allow = allow
        self.rejected = Counter("kvoffload_auth_rejected_total",
                                "Control connections refused by CURVE authentication, by reason "
                                "(unknown_key, handshake).", ["reason"], registry=registry)
        self.accepted = Counter("kvoffload_auth_accepted_total",
                                "Control connections admitted by CURVE authentication.",
                                registry=registry)
        for reason in ("unknown_key", "handshake"):
            self.rejected.labels(reason)
        self._zap: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._extra_zaps: list[zmq.asyncio.Socket] = []  # handlers in other contexts

    @classmethod
    def from_files(cls, server_key: str | None, client_keys: str | None,
                   ctx: zmq.asyncio.Context,
                   registry: CollectorRegistry | None = None) -> CurveGuard | None:
        """None when CURVE is off (no server key); both settings are needed to turn it on."""
        if not server_key and not client_keys:
            return None
        if not server_key or not client_keys:
            raise SecurityConfigError("CURVE needs both curve_server_key and curve_client_keys")
        if not zmq.has("curve"):
            raise SecurityConfigError("this libzmq was built without CURVE support")
        return cls(ctx, load_keypair(server_key), AllowList(client_keys), registry)

    def configure(self, sock: zmq.asyncio.Socket) -> None:
        """Call before ``sock.bind``, from inside the running event loop."""
        curve_server_options(sock, self.server)
        zap = self.ctx.socket(zmq.ROUTER)
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind(ZAP_ENDPOINT)
        self._zap = zap
        # Failures before ZAP (mechanism mismatch, bad hello) only show up as monitor events.
        mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                      | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self._monitor = mon
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._serve_zap()), loop.create_task(self._watch())]

    def serve_context(self, ctx: zmq.Context[Any]) -> None:
        """Admit allow-listed keys on another context's CURVE sockets too (the event
        sockets, ``curve_server_options`` with EVENTS_ZAP_DOMAIN): a ZAP handler there with
        this allow-list and these counters. Until it runs, those sockets admit nobody."""
        zap = zmq.asyncio.Context.shadow(ctx.underlying).socket(zmq.ROUTER)
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind(ZAP_ENDPOINT)
        self._extra_zaps.append(zap)
        self._tasks.append(asyncio.get_running_loop().create_task(self._serve_zap(zap)))

    def decide(self, mechanism: bytes, credentials: list[bytes]) -> tuple[bytes, bytes]:
        """ZAP status code and text for one handshake."""
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            return b"400", b"CURVE required"
        if self.allow.allowed(z85.encode(credentials[0])):
            return b"200", b"OK"
        return b"400", b"client key not allowed"

    async def _serve_zap(self, zap: zmq.asyncio.Socket | None = None) -> None:
        zap = zap or self._zap
        assert zap is not None
        while True:
            frames = await zap.recv_multipart()
            # [peer, b"", version, request_id, domain, address, identity, mechanism, *creds]
            if len(frames) < 8 or frames[1] != b"" or frames[2] != b"1.0":
                log.warning("malformed ZAP request dropped")
                continue
            peer, request_id, address = frames[0], frames[3], frames[5]
            code, text = self.decide(frames[7], frames[8:])
            if code == b"200":
                self.accepted.inc()
                user = z85.encode(frames[8])
            else:
                self.rejected.labels("unknown_key").inc()
                user = b""
                log.warning("control connection from %s refused: %s", address.decode(
                    errors="replace"), text.decode())
            await zap.send_multipart([peer, b"", b"1.0", request_id, code, text, user, b""])

    async def _watch(self) -> None:
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            self.rejected.labels("handshake").inc()
            log.warning("control handshake failed from %s (event %s, value %s)",
                        event.get("endpoint"), event.get("event"), event.get("value"))

    async def aclose(self) -> None:
        """Stop the handler and the monitor; call before the context terminates."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for s in (self._zap, self._monitor, *self._extra_zaps):
            if s is not None:
                s.close(linger=0)
        self._zap = self._monitor = None
        self._extra_zaps = []


def insecure_endpoint_warning(endpoint: str, curve_on: bool) -> str | None:
    """A warning to log when the control socket is reachable over the network unauthenticated."""
    if endpoint.startswith("tcp://") and not curve_on:
        return (f"control endpoint {endpoint} is tcp without CURVE: any process that can reach "
                "it can read and drop cached blocks (set curve_server_key and "
                "curve_client_keys; see docs/security.md)")
    return None


# ---------------------------------------------------------------------------- client side


@dataclass(frozen=True)
class CurveClientKeys:
    """What a DEALER needs to talk to a CURVE daemon: its own pair and the daemon's public key."""

    client: KeyPair
    server_public: bytes

    @classmethod
    def from_files(cls, client_key: str | os.PathLike[str],
                   server_public_key: str | os.PathLike[str]) -> CurveClientKeys:
        return cls(load_keypair(client_key), load_public_key(server_public_key))

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any] | None = None,
                      env: Mapping[str, str] | None = None) -> CurveClientKeys | None:
        """From ``kvoffload_curve_client_key`` / ``kvoffload_curve_server_public_key`` settings
        (vLLM's kv_connector_extra_config), else the environment; None when neither is set."""
        settings = settings or {}
        env = os.environ if env is None else env
        client = settings.get("kvoffload_curve_client_key") or env.get(ENV_CLIENT_KEY)
        server = (settings.get("kvoffload_curve_server_public_key")
                  or env.get(ENV_SERVER_PUBLIC_KEY))
        if not client and not server:
            return None
        if not client or not server:
            raise SecurityConfigError(f"a CURVE client needs both {ENV_CLIENT_KEY} and "
                                      f"{ENV_SERVER_PUBLIC_KEY} (or the kvoffload_curve_* "
                                      "settings)")
        return cls.from_files(str(client), str(server))

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Call before ``sock.connect``."""
        sock.curve_secretkey = self.client.secret
        sock.curve_publickey = self.client.public
        sock.curve_serverkey = self.server_public


_KEY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def generate_keypair(out: str | os.PathLike[str], name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Create one key pair; returns (public certificate, secret certificate)."""
    import zmq.auth

    if not _KEY_NAME.match(name):
        raise ValueError(f"key name {name!r}: use letters, digits, '.', '_' and '-'")
    directory = Path(out)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if not force and (public.exists() or secret.exists()):
        raise FileExistsError(f"{public} or {secret} exists (use --force to replace the pair)")
    old = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        made = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(made[1], 0o600)
    os.chmod(made[0], 0o644)  # public: readable by the daemon user and by operators
    return Path(made[0]), Path(made[1])
