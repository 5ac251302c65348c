"""L3 storage: page keys, self-checking page objects, and backends (file, valkey, mooncake, user).

Public surface (see each module): :mod:`.keys` (``tree_namespace``, ``KeyNamespace``,
``namespace_digest``, ``page_hashes``, ``continue_chain``, ``object_key``), :mod:`.objects`
(``encode``, ``decode``, ``decode_checked``, ``DecodeStatus``), :mod:`.base` (the
``StorageBackend`` contract), :mod:`.registry` (``create_backend``). The tests' fault-injecting
wrapper is ``tests/faulty_backend.py``.
"""

from .base import BackendStats, StorageBackend, StorageError
from .keys import KeyNamespace, continue_chain, namespace_digest, object_key, page_hashes, page_keys, tree_namespace
from .objects import DecodeStatus, decode, decode_checked, encode
from .registry import create_backend

__all__ = ["BackendStats", "DecodeStatus", "KeyNamespace", "StorageBackend", "StorageError", "continue_chain",
           "create_backend", "decode", "decode_checked", "encode", "namespace_digest", "object_key", "page_hashes",
           "page_keys", "tree_namespace"]
