"""A hybrid pool's window objects in storage (issue 48, docs/hybrid_kv.md): the window layers of a
checkpoint page, written beside its page objects and read for the window a prefetched range ends
with. Best effort both ways: a reader missing one cuts its hit back to a boundary whose window it
has; the page objects decide what is stored.

Units: pages of an op (indices into its hashes); host window pages are the host window pool's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .guard import GuardedBackend
from .objects import decode_checked, encode
from .page_objects import PageObject


def read_window(guard: GuardedBackend, objects: Sequence[PageObject], ns_digest: bytes, hashes: list[bytes],
                first: int, done: int, host_pages: np.ndarray) -> tuple[int, str]:
    """Read pages ``[first, done)``'s window objects into ``host_pages`` (one per page, in order).
    Returns (bytes read, "" ) when all arrived intact, else (0, why: missing, checksum, ...)."""
    keys = [obj.key(hashes[i], ns_digest) for i in range(first, done) for obj in objects]
    blobs = guard.batch_get(keys)
    for j, blob in enumerate(blobs):
        page = first + j // len(objects)
        payload, reason = (None, "missing") if blob is None else decode_checked(blob, ns_digest, hashes[page])
        if payload is None:
            return 0, getattr(reason, "value", str(reason))
        objects[j % len(objects)].load(int(host_pages[page - first]), payload)
    return sum(len(b) for b in blobs), ""


def write_window(guard: GuardedBackend, objects: Sequence[PageObject], ns_digest: bytes, hashes: list[bytes],
                 pages: np.ndarray, host_pages: np.ndarray) -> tuple[int, int]:
    """Write the window objects of ``pages`` (indices) from ``host_pages``; (pages, bytes) stored."""
    items = list(zip(pages, host_pages))
    keys = [obj.key(hashes[i], ns_digest) for i, _ in items for obj in objects]
    blobs = [encode(ns_digest, hashes[i], obj.page_bytes(int(h))) for i, h in items for obj in objects]
    stored = guard.batch_set(keys, blobs)
    return stored // max(len(objects), 1), sum(len(b) for b in blobs[:stored])
