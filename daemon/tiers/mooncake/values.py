"""Mooncake Store names, values and the client: the checked value format, connect and close.

Names: ``kvo/<geometry hash>/<offload key hex>``, the geometry hash being the disk tier's
``namespace_hash`` (engine name, groups, TP layout), so a block only ever reaches an engine
whose bytes it fits. A value is ``header | meta | data``; the header carries the lengths and a
crc32 of meta + data, checked on every get, so a torn or foreign object is a counted miss,
never served; meta is the disk tier's (end token, tail flag, the block's published event).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import zlib
from typing import Any
from urllib.parse import urlsplit

from kvoffload.daemon.tiers.base import BlockMeta
from kvoffload.daemon.tiers.disk.files import decode_meta

log = logging.getLogger("kvoffload.daemon")

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


def connect_store(cfg: Any, metadata: str) -> Any | None:
    """A connected store client, or None when the master (or the metadata server) does not
    answer yet or setup fails. Blocking: run it in a thread."""
    meta = urlsplit(metadata)
    if not _reachable(cfg.mooncake_master) or (
            meta.scheme == "http" and not _reachable(meta.netloc)):
        return None
    store = load_store_class()()
    host = cfg.mooncake_local_hostname or socket.gethostbyname(socket.gethostname())
    rc = store.setup(host, metadata, cfg.mooncake_segment_bytes, cfg.mooncake_buffer_bytes,
                     cfg.mooncake_protocol, cfg.mooncake_device, cfg.mooncake_master)
    if rc != 0:
        log.warning("mooncake tier: setup against %s failed (%d)", cfg.mooncake_master, rc)
        return None
    log.info("mooncake tier: connected to %s (metadata %s, %s as %s)", cfg.mooncake_master,
             metadata, cfg.mooncake_protocol, host)
    return store


def object_name(k: tuple[bytes, bytes]) -> str:
    """The store's name of a block: ``kvo/<namespace hash hex>/<offload key hex>``."""
    return f"kvo/{k[0].hex()}/{k[1].hex()}"


def close_store(store: Any, timeout: float) -> bool:
    """Unmount and close; False when it did not finish within ``timeout`` (a dead master:
    the client's C++ teardown then retries its unmount for ~20 s, and the master drops us
    after its client TTL anyway, so the process exits without it). Blocking."""
    t = threading.Thread(target=store.close, daemon=True, name="kvo-mc-close")
    t.start()
    t.join(timeout)
    return not t.is_alive()


def metadata_url(cfg: Any) -> str:
    """``mooncake_metadata``, or the master host's HTTP metadata server (port 8080)."""
    host = cfg.mooncake_master.rpartition(":")[0]
    return str(cfg.mooncake_metadata or f"http://{host}:8080/metadata")
