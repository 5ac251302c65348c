"""Storage keys: a chained SHA-256 over token pages, so one key names a whole prefix.

This module is the one owner of the key namespace: what separates requests in the tree
(:func:`tree_namespace`: model identity, dtype, page size, ``cache_salt``), what heads the
hash chain of one rank's page objects (:class:`KeyNamespace`: the tree namespace plus KV
dtype, shape, layers, shard and object layout), how a chain continues along a tree path
(:func:`continue_chain`) and how a hash is spelled as a key (:func:`object_key`).

``h_0 = KeyNamespace(...).digest(namespace)``, and for page ``i``
``h_{i+1} = sha256(h_i || int32-LE bytes of the page's token ids)``. Because every hash
folds in its predecessor, two prompts share the key of page ``k`` iff they share the
namespace and all tokens up to the end of page ``k``: storage never needs the tree.

Units: ``page_size`` and token arrays are tokens; hash lists have one entry per whole page.

Invariants:
  * all digests are 32 bytes (``DIGEST_SIZE``); keys are their 64-char lowercase hex;
  * ``page_hashes(t[:a*p], p, h)`` followed by ``page_hashes(t[a*p:], p, last)`` equals
    ``page_hashes(t, p, h)`` (chain continuation);
  * only whole pages are hashed; a trailing partial page has no key;
  * the bytes of every namespace string, digest and key never change for the same inputs:
    objects written by an earlier version stay readable (tests pin literal values).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

DIGEST_SIZE = 32  # bytes of every namespace digest and page hash
_NS_TAG = b"hicache-kv-namespace-v1\n"  # versioned so a format change never reuses old keys
# Axes of a page object (see storage.prefetch_backup): one page of every layer's K and V.
OBJECT_LAYOUT_V1 = "layer,kv,token,head,dim/v1"


def tree_namespace(model_identity: str, dtype: str, page_size: int, cache_salt: str | None = None) -> str:
    """The namespace of a request's tree path (``Request.namespace``): requests share radix
    nodes, and storage objects, only within one.

    16 hex chars of SHA-256 over the model identity, its dtype name and the page size (in
    tokens), then ``|<salt>`` when a ``cache_salt`` is given (an empty salt is no salt).
    """
    base = hashlib.sha256(f"{model_identity}|{dtype}|page={page_size}".encode()).hexdigest()[:16]
    return f"{base}|{cache_salt}" if cache_salt else base


@dataclass(frozen=True)
class KeyNamespace:
    """What names one rank's page objects, besides the tree namespace: the chain head of a
    request is :meth:`digest` of its tree namespace (which carries model identity, dtype,
    page size and ``cache_salt``, see :func:`tree_namespace`).

    Two ranks or deployments read each other's objects only if every field agrees.
    """

    page_size: int  # tokens per page
    kv_dtype: str  # ``str()`` of the KV buffers' torch dtype, e.g. ``"torch.bfloat16"``
    kv_shape: tuple[int, ...]  # shape of one token slot of one layer's K: (kv_heads, head_dim)
    layers: int  # layers whose K/V one object holds
    shard: str = ""  # this rank's slice of the KV (layers, kv heads); "" when it holds all
    object_layout: str = OBJECT_LAYOUT_V1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_shape", tuple(self.kv_shape))  # hashable, whatever was passed

    # Every prefetch and storage backup asks for it; bounded, as each cache_salt is a namespace.
    @functools.lru_cache(maxsize=1024)
    def digest(self, namespace: str) -> bytes:
        """The 32-byte chain head for requests of tree namespace ``namespace``."""
        # These field names and values are the first key format's: any change renames every object.
        return namespace_digest(namespace=namespace, page_size=self.page_size, dtype=self.kv_dtype,
                                object_layout=self.object_layout, kv_shape=list(self.kv_shape),
                                layers=self.layers, shard=self.shard)


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
    arr = arr[: arr.shape[0] // page_size * page_size]
    if arr.dtype != np.dtype("<i4"):
        if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
            raise ValueError("token ids must fit in int32")
        arr = arr.astype("<i4")
    pages = np.ascontiguousarray(arr).view(np.uint8).reshape(-1, 4 * page_size)
    chain = itertools.accumulate(pages, lambda h, page: hashlib.sha256(h + page.tobytes()).digest(), initial=bytes(prev))
    return list(chain)[1:]  # (without prev)


def continue_chain(segments: Sequence[np.ndarray], page_size: int, prev: bytes) -> list[list[bytes]]:
    """The page hashes of consecutive token ``segments`` (e.g. the keys of the tree nodes on
    a path, each whole pages), the chain running on from ``prev`` across segments: the same
    hashes as :func:`page_hashes` over their concatenation, cut per segment."""
    out: list[list[bytes]] = []
    for seg in segments:
        hashes = page_hashes(seg, page_size, prev)
        out.append(hashes)
        prev = hashes[-1] if hashes else prev
    return out


def object_key(h: bytes) -> str:
    """The storage key (64-char lowercase hex) for a page hash."""
    return h.hex()


def page_keys(tokens: np.ndarray | list[int], page_size: int, prev: bytes) -> list[str]:
    """``[object_key(h) for h in page_hashes(tokens, page_size, prev)]``."""
    return [object_key(h) for h in page_hashes(tokens, page_size, prev)]
