"""On-disk format of the disk tier's block files (see ``disk.py`` for the layout).

The blocking functions here run in the tier's threads, never on the event loop.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from array import array
from typing import Any

import msgspec
from kvoffload.daemon.tiers.base import BlockMeta
from kvoffload.events.hub import StoredRecord

MAGIC = b"KVOB"
VERSION = 1
# magic, version, key_len, meta_len, ns_hash, data_len, data_crc, header_crc
HEAD = struct.Struct("<4sHHI16sQII")


class CorruptBlock(ValueError):
    """A file failed a header, length or checksum check."""


class _Meta(msgspec.Struct, array_like=True):
    end_token: int
    tail: bool
    record: dict[str, Any] | None = None


_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(_Meta)


def _record_to_dict(rec: StoredRecord) -> dict[str, Any]:
    return {"hashes": list(rec.hashes), "parent": rec.parent, "tokens": rec.tokens.tolist(),
            "block_size": rec.block_size, "group_idx": rec.group_idx, "kind": rec.kind,
            "sliding_window": rec.sliding_window, "lora_name": rec.lora_name,
            "extra_keys": None if rec.extra_keys is None else list(rec.extra_keys),
            "locality": rec.locality}


def _record_from_dict(d: dict[str, Any]) -> StoredRecord:
    extra = d.get("extra_keys")
    return StoredRecord(hashes=tuple(d["hashes"]), parent=d.get("parent"),
                        tokens=array("I", d.get("tokens") or ()), block_size=d["block_size"],
                        medium="STORAGE", group_idx=d.get("group_idx"), kind=d.get("kind"),
                        sliding_window=d.get("sliding_window"), lora_name=d.get("lora_name"),
                        extra_keys=None if extra is None else tuple(
                            None if e is None else tuple(e) for e in extra),
                        locality=d.get("locality"))


def encode_meta(meta: BlockMeta) -> bytes:
    rec = None if meta.record is None else _record_to_dict(meta.record)
    return _meta_encoder.encode(_Meta(meta.end_token, meta.tail, rec))


def decode_meta(blob: bytes) -> BlockMeta:
    m = _meta_decoder.decode(blob)
    return BlockMeta(m.end_token, m.tail, None if m.record is None else _record_from_dict(m.record))


def parse_head(head: bytes, key: bytes | None, nsh: bytes | None
                ) -> tuple[int, int, bytes, int, int, int]:
    if len(head) < HEAD.size:
        raise CorruptBlock("truncated header")
    magic, ver, klen, mlen, fnsh, dlen, dcrc, hcrc = HEAD.unpack_from(head)
    if magic != MAGIC or ver != VERSION:
        raise CorruptBlock(f"bad magic/version {magic!r}/{ver}")
    if nsh is not None and fnsh != nsh:
        raise CorruptBlock("namespace hash mismatch")
    return klen, mlen, fnsh, dlen, dcrc, hcrc


def read_prefix(f: Any, path: str, key: bytes | None, nsh: bytes | None
                 ) -> tuple[bytes, bytes, BlockMeta, int, int]:
    """Header, key and meta of an open file, checked. Returns (nsh, key, meta, dlen, dcrc)."""
    head = f.read(HEAD.size)
    klen, mlen, fnsh, dlen, dcrc, hcrc = parse_head(head, key, nsh)
    rest = f.read(klen + mlen)
    if len(rest) != klen + mlen:
        raise CorruptBlock("truncated key/meta")
    if zlib.crc32(rest, zlib.crc32(head[:HEAD.size - 4])) != hcrc:
        raise CorruptBlock("header checksum mismatch")
    fkey = rest[:klen]
    if key is not None and fkey != key:
        raise CorruptBlock("key mismatch")
    if os.fstat(f.fileno()).st_size != HEAD.size + klen + mlen + dlen:
        raise CorruptBlock("file length does not match its header")
    try:
        meta = decode_meta(rest[klen:])
    except (msgspec.DecodeError, msgspec.ValidationError, KeyError) as exc:
        raise CorruptBlock(f"bad meta: {exc}") from None
    return fnsh, fkey, meta, dlen, dcrc


def write_file(path: str, nsh: bytes, key: bytes, blob: bytes, data: bytes) -> None:
    head = HEAD.pack(MAGIC, VERSION, len(key), len(blob), nsh, len(data),
                      zlib.crc32(data), 0)[:HEAD.size - 4]
    hcrc = zlib.crc32(key + blob, zlib.crc32(head))
    tmp = f"{path}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(head + struct.pack("<I", hcrc) + key + blob)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_file(path: str, nsh: bytes, key: bytes, buf: memoryview) -> BlockMeta:
    with open(path, "rb", buffering=0) as f:
        _, _, meta, dlen, dcrc = read_prefix(f, path, key, nsh)
        if dlen != len(buf):
            raise CorruptBlock("data length changed")
        got = 0
        while got < dlen:
            n = f.readinto(buf[got:])
            if not n:
                raise CorruptBlock("truncated data")
            got += n
    if zlib.crc32(buf) != dcrc:
        raise CorruptBlock("data checksum mismatch")
    return meta
