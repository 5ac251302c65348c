"""L3 storage: page keys, self-checking page objects, and backends (file, valkey, user).

Public surface (see each module): :mod:`.keys` (``namespace_digest``, ``page_hashes``,
``key_of``), :mod:`.objects` (``encode``, ``decode``, ``decode_checked``, ``DecodeStatus``),
:mod:`.base` (the ``StorageBackend`` contract), :mod:`.registry` (``create_backend``),
:mod:`.faulty` (``FaultyBackend`` for tests).
"""

from .base import BackendStats, StorageBackend, StorageError
from .keys import key_of, namespace_digest, page_hashes, page_keys
from .objects import DecodeStatus, decode, decode_checked, encode
from .registry import create_backend

__all__ = [
    "BackendStats",
    "DecodeStatus",
    "StorageBackend",
    "StorageError",
    "create_backend",
    "decode",
    "decode_checked",
    "encode",
    "key_of",
    "namespace_digest",
    "page_hashes",
    "page_keys",
]
