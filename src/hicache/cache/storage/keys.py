"""Storage keys: a chained SHA-256 over token pages, so one key names a whole prefix.

``h_0 = namespace_digest(...)`` (model identity + ``cache_salt``), and for page ``i``
``h_{i+1} = sha256(h_i || int32-LE bytes of the page's token ids)``. Because every hash
folds in its predecessor, two prompts share the key of page ``k`` iff they share the
namespace and all tokens up to the end of page ``k``: storage never needs the tree.

Invariants:
  * all digests are 32 bytes (``DIGEST_SIZE``); keys are their 64-char lowercase hex;
  * ``page_hashes(t[:a*p], p, h)`` followed by ``page_hashes(t[a*p:], p, last)`` equals
    ``page_hashes(t, p, h)`` (chain continuation);
  * only whole pages are hashed; a trailing partial page has no key.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

DIGEST_SIZE = 32  # bytes of every namespace digest and page hash
_NS_TAG = b"hicache-kv-namespace-v1\n"  # versioned so a format change never reuses old keys


def namespace_digest(**fields: Any) -> bytes:
    """The chain head for one deployment's KV: a SHA-256 over the sorted ``fields``.

    Pass everything that changes the bytes of a page: model identity (weights' digest or
    path), KV dtype, page size, KV layout, ``cache_salt``, LoRA id, ... Values must be
    JSON-representable (other objects are folded in through ``str``). Field order does
    not matter; ``None`` values are kept (``salt=None`` differs from no ``salt`` field).
    """
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(_NS_TAG + text.encode()).digest()


def page_hashes(tokens: np.ndarray | list[int], page_size: int, prev: bytes) -> list[bytes]:
    """One 32-byte hash per whole page of ``tokens`` (a trailing partial page is ignored).

    ``prev`` is the namespace digest for a prompt's first page, or the hash of the page
    just before ``tokens[0]`` to continue a chain. Token ids are hashed as little-endian
    int32 (ids outside int32 range raise ``ValueError``). Cost: one SHA-256 update per
    page over ``4 * page_size`` bytes; no per-token Python work.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if len(prev) != DIGEST_SIZE:
        raise ValueError(f"prev must be a {DIGEST_SIZE}-byte digest, got {len(prev)} bytes")
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    n_pages = arr.shape[0] // page_size
    if n_pages == 0:
        return []
    arr = arr[: n_pages * page_size]
    if arr.dtype != np.dtype("<i4"):
        if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
            raise ValueError("token ids must fit in int32")
        arr = arr.astype("<i4")
    buf = memoryview(np.ascontiguousarray(arr)).cast("B")
    step = 4 * page_size
    out: list[bytes] = []
    sha256 = hashlib.sha256
    h = bytes(prev)
    for start in range(0, n_pages * step, step):
        s = sha256(h)
        s.update(buf[start : start + step])
        h = s.digest()
        out.append(h)
    return out


def key_of(h: bytes) -> str:
    """The storage key (64-char lowercase hex) for a page hash."""
    return h.hex()


def page_keys(tokens: np.ndarray | list[int], page_size: int, prev: bytes) -> list[str]:
    """``[key_of(h) for h in page_hashes(tokens, page_size, prev)]``."""
    return [h.hex() for h in page_hashes(tokens, page_size, prev)]
