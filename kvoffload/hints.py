"""One-line explanations for the client commands (``demo --connect``, ``stats``): what was
given, why it failed and what to do, instead of a ZMQ error or a traceback."""

from __future__ import annotations

import os

from kvoffload.daemon.control.security import ENV_CLIENT_KEY, ENV_SERVER_PUBLIC_KEY

SCHEMES = ("ipc://", "tcp://")


def bad_endpoint(flag: str, endpoint: str) -> str | None:
    """Why ``endpoint`` is not a control endpoint a client can connect to, or None."""
    if endpoint.startswith(SCHEMES) and len(endpoint) > len("ipc://"):
        return None
    example = f"ipc://{endpoint}" if endpoint.startswith("/") else "ipc:///run/kvoffload/control.sock"
    return (f"{flag} {endpoint}: not a ZMQ endpoint; give ipc://PATH or tcp://HOST:PORT "
            f"(e.g. {example})")


def unavailable(flag: str, endpoint: str) -> str:
    """The daemon at ``endpoint`` did not answer: say the likely reason."""
    line = f"no kvoffload daemon answers at {flag} {endpoint}"
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not os.path.exists(path):
            return (f"{line}: {path} does not exist; start one with `kvoffload serve "
                    f"--control {endpoint}` or give the endpoint it serves")
        return f"{line}: is it running and is {path} its control socket?"
    if not (os.environ.get(ENV_CLIENT_KEY) or os.environ.get(ENV_SERVER_PUBLIC_KEY)):
        return (f"{line}: is it running on that address? If it uses CURVE "
                f"(--curve-server-key), this client needs keys: set {ENV_CLIENT_KEY} and "
                f"{ENV_SERVER_PUBLIC_KEY} (kvoffload keys; docs/security.md)")
    return (f"{line}: is it running, and is this client's key in its allow-list "
            f"(--curve-client-keys) and {ENV_SERVER_PUBLIC_KEY} its public key?")
