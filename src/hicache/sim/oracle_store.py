"""The shared L3 under the offline-optimal order (``--policy belady`` with a bounded store): over
its object cap, the object whose page is next used farthest in the future goes first, the ones
never used again first (possibly the one just written: Belady bypasses).

Objects are named by their page's chained hash (:mod:`hicache.cache.storage.keys`); the replay
tells the store, before each request, the hashes of the request's pages and their blocks
(:meth:`OracleStore.expect`), so a key maps to a block and the block's next use comes from
:class:`~.oracle.NextUse`. The store's next use is *after* the request being served: the store is
read at admission (prefetch) and written after it, so the current request is done with it by the
time a write evicts.

Eviction is a lazy max-heap on next use: a key's next use changes only when a request uses its
block, and that request's :meth:`expect` pushes the new value; stale heap entries are skipped.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence

from ..cache.storage.memory import MemoryBackend
from .oracle import NEVER, NextUse

HASH_HEX = 64  # a key starts with its page hash in hex (a suffix may follow: another object of the page)


class OracleStore(MemoryBackend):
    """A :class:`MemoryBackend` of at most ``max_objects`` objects, evicting by ``oracle``."""

    def __init__(self, max_objects: int, oracle: NextUse) -> None:
        super().__init__()  # uncapped: this class keeps the cap
        self.cap, self.oracle = max_objects, oracle
        self._block: dict[str, int] = {}  # page hash hex -> block
        self._keys: dict[str, set[str]] = {}  # page hash hex -> stored keys of that page
        self._value: dict[str, float] = {}  # stored key -> its next use when last pushed
        self._heap: list[tuple[float, int, str]] = []  # (-next use, tie, key)
        self._tie = itertools.count()

    def expect(self, hashes: Sequence[bytes], blocks: Sequence[int]) -> None:
        """The request about to be served names these pages (its chain's hashes, its blocks):
        remember their blocks, and re-rank those already stored (their next use moved on)."""
        with self._lock:
            for h, block in zip(hashes, blocks):
                hx = h.hex()
                self._block[hx] = block
                for key in self._keys.get(hx, ()):
                    self._push(key)

    def _next_use(self, key: str) -> float:
        block = self._block.get(key[:HASH_HEX])
        return NEVER if block is None else self.oracle.next_use(block, after_now=True)

    def _push(self, key: str) -> None:
        value = self._value[key] = self._next_use(key)
        heapq.heappush(self._heap, (-value, next(self._tie), key))

    def batch_set(self, keys: list[str], values: list[bytes]) -> int:
        with self._lock:
            stored = super().batch_set(keys, values)
            for key in keys[:stored]:
                self._keys.setdefault(key[:HASH_HEX], set()).add(key)
                self._push(key)
            self._evict()
            return stored

    def _evict(self) -> None:
        while len(self._value) > self.cap:
            neg, _, key = heapq.heappop(self._heap)
            if self._value.get(key) != -neg:
                continue  # stale: re-ranked or gone since
            self.delete([key])
            self._c.evictions += 1

    def delete(self, keys: list[str]) -> None:
        with self._lock:
            super().delete(keys)
            for key in keys:
                if self._value.pop(key, None) is not None:
                    self._keys[key[:HASH_HEX]].discard(key)

    def clear(self) -> None:
        with self._lock:
            super().clear()
            self._keys.clear()
            self._value.clear()
            self._heap.clear()
