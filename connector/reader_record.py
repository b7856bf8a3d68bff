"""This engine's reader record in its session file (``daemon/store/session_file.py``).

Written by the scheduler thread under the record's sequence lock (busy, epoch applied, messages
sent: what lets the daemon reclaim retired slots, ``daemon/store/reclaim.py``), and stamped by
the session's heartbeat thread in its own aligned word (an idle engine keeps its lease).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading

import numpy as np
from kvoffload.connector.index_view import IndexGone
from kvoffload.daemon.store import fence, session_file
from kvoffload.daemon.store import shared_index as si

_FIELDS = struct.Struct("<IQQ")  # busy, epoch, sent: the record after its sequence word


class ReaderRecord:
    """This engine's record in its session file (written here, read by the daemon)."""

    def __init__(self, path: str, record: int = 0) -> None:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            self._mm = mmap.mmap(fd, 0, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        if record != 0 or len(self._mm) < session_file.FILE_BYTES:
            self._mm.close()
            raise IndexGone(f"{path} is not a session file (record {record})")
        self._u32 = np.frombuffer(self._mm, dtype="<u4", count=2)
        self._u64 = np.frombuffer(self._mm, dtype="<u8", count=4)
        self._seq = int(self._u32[0]) & ~1
        self._lock = threading.Lock()  # the heartbeat thread vs close()

    def write(self, busy: bool, epoch: int, sent: int) -> None:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        self._u32[0] = self._seq  # odd: the daemon retries
        fence.store_store()
        _FIELDS.pack_into(self._mm, 4, int(busy), epoch, sent)
        fence.store_store()
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        self._u32[0] = self._seq

    def stamp(self) -> None:
        """The heartbeat: its own aligned word, so it needs no sequence lock."""
        with self._lock:
            if self._mm is not None:
                self._u64[session_file.HEARTBEAT_OFFSET // 8] = si.now_ns()

    def close(self) -> None:
        with self._lock:
            if self._mm is not None:
                del self._u32, self._u64
                self._mm.close()
                self._mm = None  # type: ignore[assignment]
