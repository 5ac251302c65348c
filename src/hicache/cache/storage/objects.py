"""Stored page objects: a fixed 96-byte header followed by the page payload.

Header layout (little-endian, offsets in bytes)::

    0  magic        4s  b"HCKV"
    4  version      u16 FORMAT_VERSION
    6  header_len   u16 HEADER_SIZE (lets a later version grow the header)
    8  payload_len  u64 bytes of payload that follow the header
    16 crc32        u32 zlib.crc32 of the payload
    20 reserved     4 bytes, zero
    24 namespace    32s namespace digest (see keys.namespace_digest)
    56 page_hash    32s the page's chained hash (see keys.page_hashes)
    88 padding      8 bytes, zero -> payload starts 32-byte aligned within the blob

The reader verifies everything: a page is served only if magic, version, namespace, page
hash, length and checksum all match. crc32 is used because it runs at several GB/s
(a 368 KB page costs ~0.1 ms) and only has to catch accidental corruption; integrity
against a hostile store is out of scope (the key already names the prefix).
"""

from __future__ import annotations

import enum
import struct
import zlib

MAGIC = b"HCKV"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHHQI4x32s32s8x")
HEADER_SIZE = _HEADER.size  # 96
assert HEADER_SIZE == 96


class DecodeStatus(str, enum.Enum):
    """Why :func:`decode_checked` accepted or refused an object (compares equal to its
    string value, e.g. ``status == "checksum"``)."""

    OK = "ok"
    MISSING = "missing"  # no object (backend returned None)
    MAGIC = "magic"  # not a hicache page object
    VERSION = "version"  # written by an unknown format version
    NAMESPACE = "namespace"  # another model / salt / layout wrote it
    PAGE = "page"  # header names a different page than the key asked for
    SHORT = "short"  # fewer bytes than header + payload_len (truncated)
    LENGTH = "length"  # more bytes than header + payload_len
    CHECKSUM = "checksum"  # payload bytes do not match the stored crc32


def encode(ns_digest: bytes, page_hash: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    """One object: header + payload (copies the payload once)."""
    if len(ns_digest) != 32 or len(page_hash) != 32:
        raise ValueError("ns_digest and page_hash must be 32 bytes each")
    mv = memoryview(payload).cast("B")
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, mv.nbytes, zlib.crc32(mv), ns_digest, page_hash)
    return b"".join((header, mv))


def decode_checked(blob: bytes | bytearray | memoryview | None, ns_digest: bytes,
                   page_hash: bytes) -> tuple[memoryview | None, DecodeStatus]:
    """``(payload, DecodeStatus.OK)`` or ``(None, reason)``. Never raises on bad data.

    The payload is a zero-copy view into ``blob``; keep ``blob`` alive while using it.
    """
    if blob is None:
        return None, DecodeStatus.MISSING
    try:
        mv = memoryview(blob).cast("B")
    except TypeError:
        return None, DecodeStatus.MAGIC
    if mv.nbytes < 8:
        return None, DecodeStatus.SHORT if MAGIC.startswith(bytes(mv[:4])) else DecodeStatus.MAGIC
    if mv[:4] != MAGIC:
        return None, DecodeStatus.MAGIC
    # Check the version before the full header: a future version may have another size.
    version, header_len = struct.unpack_from("<HH", mv, 4)
    if version != FORMAT_VERSION or header_len != HEADER_SIZE:
        return None, DecodeStatus.VERSION
    if mv.nbytes < HEADER_SIZE:
        return None, DecodeStatus.SHORT
    _, _, _, payload_len, crc, ns, ph = _HEADER.unpack_from(mv)
    if ns != ns_digest:
        return None, DecodeStatus.NAMESPACE
    if ph != page_hash:
        return None, DecodeStatus.PAGE
    end = HEADER_SIZE + payload_len
    if mv.nbytes < end:
        return None, DecodeStatus.SHORT
    if mv.nbytes > end:
        return None, DecodeStatus.LENGTH
    payload = mv[HEADER_SIZE:end]
    if zlib.crc32(payload) != crc:
        return None, DecodeStatus.CHECKSUM
    return payload, DecodeStatus.OK


def decode(blob: bytes | bytearray | memoryview | None, ns_digest: bytes, page_hash: bytes) -> memoryview | None:
    """The payload of a valid object, else None (see :func:`decode_checked` for why)."""
    return decode_checked(blob, ns_digest, page_hash)[0]
