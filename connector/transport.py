"""The control socket's transport, shared by both clients (``client.py``): the DEALER and its
options, the scheduler-side context, the endpoint check, the errors a caller catches.

Split from ``client.py`` for size; ``client.py`` re-exports every public name.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, TypeVar

import zmq
from kvoffload.daemon.control import protocol as p
from kvoffload.daemon.control.security import CurveClientKeys

__all__ = ["BadEndpoint", "DaemonUnavailable", "background_context", "check_endpoint"]

R = TypeVar("R", bound=p._Msg)


class DaemonUnavailable(ConnectionError):
    """The daemon did not answer in time or cannot be reached."""


class BadEndpoint(ValueError):
    """A control endpoint a client cannot connect to (no ipc:// or tcp://, no port)."""


def check_endpoint(endpoint: str, what: str = "control endpoint") -> str:
    """``endpoint`` if a DEALER can connect to it, else ``BadEndpoint`` in one line.

    libzmq answers a bad one with a bare "Invalid argument" from inside ``connect``; this
    says what was given and what to give instead."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    ok = bool(sep) and bool(rest) and (
        scheme in ("ipc", "inproc") or (scheme == "tcp" and bool(colon) and bool(host)
                                        and port.isdigit() and 0 < int(port) < 65536))
    if ok:
        return endpoint
    example = (f"ipc://{endpoint}" if endpoint.startswith("/")
               else "ipc:///run/kvoffload/control.sock")
    raise BadEndpoint(f"{what} {endpoint!r} is not a ZMQ endpoint: give ipc://PATH or "
                      f"tcp://HOST:PORT (e.g. {example})")


def _expect(reply: p._Msg, kind: type[R]) -> R:
    if isinstance(reply, p.Error):
        raise p.ProtocolError(reply.code, reply.message)
    if not isinstance(reply, kind):
        raise p.ProtocolError(p.ErrorCode.MALFORMED, f"expected {kind.__name__}, got {reply!r}")
    return reply


_background: dict[tuple[int, bool], zmq.Context[Any]] = {}


def background_context(sched_batch: bool = False) -> zmq.Context[Any]:
    """This process's context for the scheduler-side session (its own, so vLLM's sockets in
    the same process keep theirs; one per process and policy, re-made after a fork).

    ``sched_batch`` (the plugin's ``kvoffload_io_sched_batch``, off by default) runs its I/O
    thread in SCHED_BATCH. Every send wakes that thread, and a woken thread of the default
    policy preempts the thread that woke it: on a busy host the engine's scheduler then waits,
    mid-step, for the I/O thread and whatever runs after it (measured: ~100-200 us of a ~10 us
    send; scheduler time per step 1.4-1.55x vLLM's with it, 2.0-2.4x without). The price: a
    SCHED_BATCH thread runs only on an idle core or once the scheduler thread blocks or uses
    up its slice, so on a host without an idle core the daemon's replies (a tier's answers
    among them) are read later: measured, a test engine spinning its steps waited 7-160 ms
    for one, and missed its 200-step bound in 8 of 14 runs at load 1-2."""
    key = (os.getpid(), sched_batch)
    ctx = _background.get(key)
    if ctx is None:
        if any(pid != key[0] for pid, _ in _background):
            _background.clear()  # a forked child: its parent's contexts are not its own
        ctx = zmq.Context()
        policy = getattr(os, "SCHED_BATCH", None)  # Linux only
        if policy is not None and sched_batch:
            with contextlib.suppress(zmq.ZMQError, AttributeError):  # older libzmq
                ctx.set(zmq.THREAD_SCHED_POLICY, policy)  # no priority: libzmq leaves nice
        _background[key] = ctx
    return ctx


def _make_socket(ctx: zmq.Context[Any], endpoint: str,
                 curve: CurveClientKeys | None = None) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    curve = curve or CurveClientKeys.from_settings()  # KVOFFLOAD_CURVE_* environment
    if curve is not None:
        curve.apply(sock)
    sock.setsockopt(zmq.LINGER, 0)
    # IMMEDIATE: queue nothing for a daemon that is not connected, so a send while it is
    # down fails at once instead of being delivered minutes later to a restarted daemon.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, 50)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.connect(endpoint)
    return sock
