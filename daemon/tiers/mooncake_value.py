"""Mooncake Store values and client loading: the checked value format, the client class.

A value is ``header | meta | data``; the header carries the lengths and a crc32 of meta + data,
checked on every get, so a torn or foreign object is a counted miss, never served.
"""

from __future__ import annotations

import os
import socket
import struct
import zlib
from typing import Any

from kvoffload.daemon.tiers.base import BlockMeta
from kvoffload.daemon.tiers.diskfmt import decode_meta

MAGIC = b"KVOM"
VERSION = 1
HEAD = struct.Struct("<4sHHIQI")  # magic, version, pad, meta_len, data_len, crc32(meta+data)


def load_store_class() -> Any:
    """Mooncake's client class; raises ImportError/OSError when the wheel or its shared
    libraries (libibverbs1, librdmacm1, libnuma1) are missing."""
    os.environ.setdefault("GLOG_minloglevel", "1")  # the C++ side logs every op at INFO
    from mooncake.store import MooncakeDistributedStore
    return MooncakeDistributedStore


def _reachable(addr: str, timeout: float = 1.0) -> bool:
    host, _, port = addr.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout).close()
        return True
    except (OSError, ValueError):
        return False


def encode_value(data: bytes, blob: bytes) -> bytes:
    """``blob``: the block's encoded meta (``diskfmt.encode_meta``)."""
    crc = zlib.crc32(data, zlib.crc32(blob))
    return HEAD.pack(MAGIC, VERSION, 0, len(blob), len(data), crc) + blob + data


def decode_into(value: bytes, buf: memoryview) -> BlockMeta | None:
    """Check ``value`` and copy its data into ``buf``; None when it fails a check."""
    if len(value) < HEAD.size:
        return None
    magic, ver, _, mlen, dlen, crc = HEAD.unpack_from(value)
    body = memoryview(value)[HEAD.size:]
    if (magic != MAGIC or ver != VERSION or len(body) != mlen + dlen or dlen > len(buf)
            or zlib.crc32(body) != crc):
        return None
    meta = decode_meta(bytes(body[:mlen]))
    buf[:dlen] = body[mlen:]
    return meta
