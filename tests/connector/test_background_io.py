"""The scheduler-side session's ZMQ context: with ``kvoffload_io_sched_batch``, I/O threads that
never preempt the engine's step; by default, as any other context's.

Checked in a fresh interpreter, so the threads are told apart by when they started."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling only")

PROBE = r"""
import json, os, time
import zmq

def threads():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            out[int(tid)] = (f.read().strip(), os.sched_getscheduler(int(tid)))
    return out

from kvoffload.connector.client import DaemonClient, background_context
from kvoffload.daemon.base import Geometry, GroupKind, GroupSpec
from kvoffload.connector.session import IndexSession

before = threads()
shared = zmq.Context.instance().socket(zmq.DEALER)  # what vLLM's own sockets may use
time.sleep(0.05)
after_shared = threads()
geo = Geometry("probe", (GroupSpec(GroupKind.FULL_ATTENTION, 16, 64),), 16)
plain = IndexSession("ipc:///nonexistent-kvoffload-probe", geo)  # the default: no change
plain_sock = plain.client.socket()
time.sleep(0.05)
after_plain = threads()
session = IndexSession("ipc:///nonexistent-kvoffload-probe", geo, io_sched_batch=True)
sock = session.client.socket()  # the socket its Steps go out on
time.sleep(0.05)
after_session = threads()
print(json.dumps({
    "main": os.sched_getscheduler(0),
    "shared": [v for k, v in after_shared.items() if k not in before],
    "plain": [v for k, v in after_plain.items() if k not in after_shared],
    "session": [v for k, v in after_session.items() if k not in after_plain],
    "same_context": sock.context is background_context(True) and background_context(True) is not zmq.Context.instance(),
    "plain_client_shared": DaemonClient("ipc:///x").socket().context is zmq.Context.instance(),
    "batch": os.SCHED_BATCH, "other": os.SCHED_OTHER,
}))
sock.close(0); plain_sock.close(0); shared.close(0)
"""


def test_session_io_threads_run_batch_when_asked_and_nothing_else_changes() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=60, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    batch, other = got["batch"], got["other"]
    assert got["main"] == other  # the engine's own thread keeps its policy
    session_io = [policy for name, policy in got["session"] if "ZMQbg/IO" in name]
    assert session_io and all(policy == batch for policy in session_io)
    plain_io = [policy for name, policy in got["plain"] if "ZMQbg/IO" in name]
    assert plain_io and all(policy == other for policy in plain_io)  # off by default
    shared_io = [policy for name, policy in got["shared"] if "ZMQbg/IO" in name]
    assert shared_io and all(policy == other for policy in shared_io)  # vLLM's context: as was
    assert got["same_context"] and got["plain_client_shared"]
