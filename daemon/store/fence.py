"""Memory fences for the shared index, which other processes read while the daemon writes it.

Python, numpy and ``mmap`` promise no ordering between accesses to shared memory, and neither
do the CPUs we run on: x86-64 (TSO) may make a store visible after a later load of another
address; ARM64 (Grace GH200/GB200) may reorder loads with loads and stores with stores too. So
the index's protocols (a sequence lock per entry, the change ring, the readers' records; the
argument is in docs/architecture.md, "Memory ordering") put a fence where an order matters:

* ``full()``: a sequentially consistent fence (``mfence`` / ``dmb ish``). Needed on every CPU
  where a store must be visible before a later load (the reader record vs the daemon's
  retirement: Dekker's pattern).
* ``store_store()`` / ``load_load()``: needed where stores (loads) must stay in program order.
  x86-64 keeps those orders by itself (TSO), so there they cost nothing; elsewhere they are a
  full fence.

The fence is GCC's ``atomic_thread_fence`` from ``libatomic.so.1`` (part of every GCC runtime;
torch and most wheels already load it), called through ctypes: ~0.15-0.25 us a call, made once
per batch of entries, never per key. Without libatomic there is no fence: on x86-64 only the
``full()`` orders are then unprotected (logged once); on other CPUs the engine must not read the
index in place (``AVAILABLE`` says whether it may).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
from collections.abc import Callable

log = logging.getLogger("kvoffload.fence")

_SEQ_CST = 5  # memory_order_seq_cst in GCC's enum
TSO = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def _load() -> Callable[[], None] | None:
    for name in ("libatomic.so.1", ctypes.util.find_library("atomic")):
        if not name:
            continue
        try:
            fn = ctypes.CDLL(name).atomic_thread_fence
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = None
        return lambda: fn(_SEQ_CST)
    return None


_FENCE = _load()
KIND = "libatomic" if _FENCE is not None else "none"
# Whether in-place reads of the index are ordered on this CPU (the engine checks it).
AVAILABLE = _FENCE is not None or TSO
if _FENCE is None:
    log.warning("kvoffload: no memory fence available (libatomic.so.1 not found); %s",
                "store-load order is unprotected on this x86-64 host" if TSO else
                "engines on this CPU will not read the shared index in place")


def _nothing() -> None:
    return None


full: Callable[[], None] = _FENCE or _nothing
store_store: Callable[[], None] = _nothing if TSO else full
load_load: Callable[[], None] = _nothing if TSO else full
