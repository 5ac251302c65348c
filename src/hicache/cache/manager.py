"""Request-facing cache operations: admit (match + lock + reserve), cache a computed prefix,
release. The engine calls these on its scheduler thread only; the manager knows nothing of
requests beyond the :class:`KVState` it hands out.

Units: ``tokens`` are token-id sequences; lengths are tokens unless named ``*_pages``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from .pools import DeviceKVPool, PageAllocator, pages_to_slots
from .radix import RadixCache, TreeNode

logger = logging.getLogger(__name__)


@dataclass
class KVState:
    """One request's hold on the device pool.

    ``pages[:cached_pages]`` belong to the tree and are locked through ``node``; the rest were
    allocated for this request and are its own until inserted or freed.
    """

    pages: np.ndarray
    cached_pages: int
    node: TreeNode | None
    device_hit_tokens: int
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    slots: torch.Tensor = field(default=None)  # slots of every page, in order (cached)

    def refresh_slots(self, page_size: int) -> None:
        self.slots = pages_to_slots(self.pages, page_size)


@dataclass
class CacheStats:
    """Cumulative counters since start (or the last flush for pool usage)."""

    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    evicted_device_pages: int = 0


class KVCacheManager:
    """Owns the device pool, its allocator and the radix tree (None when reuse is off)."""

    def __init__(self, pool: DeviceKVPool, eviction_policy: str = "lru", enable_prefix_cache: bool = True) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.allocator = PageAllocator(pool.num_pages)
        self.tree = RadixCache(self.page_size, self.allocator, eviction_policy) if enable_prefix_cache else None
        self.stats = CacheStats()

    @property
    def capacity_pages(self) -> int:
        return self.allocator.capacity

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def admit(self, namespace: str, tokens: np.ndarray, reserve_tokens: int) -> KVState | None:
        """Match ``tokens`` (the prompt), lock the hit and reserve pages up to ``reserve_tokens``
        (prompt + most output). Returns None, with nothing changed, when the pool cannot hold
        it even after evicting unlocked cache.

        At least one prompt token is always left uncomputed so the prompt yields logits.
        """
        hit_pages = np.zeros(0, dtype=np.int64)
        node = None
        if self.tree is not None:
            match = self.tree.match_prefix(namespace, tokens[: len(tokens) - 1])
            hit_pages, node = match.device_pages, match.last_device_node
            self.tree.inc_lock_ref(node)
        need = self.pages_for(reserve_tokens) - len(hit_pages)
        new_pages = self._alloc(need)
        if new_pages is None:
            if node is not None:
                self.tree.dec_lock_ref(node)
            return None
        state = KVState(
            pages=np.concatenate([hit_pages, new_pages]),
            cached_pages=len(hit_pages),
            node=node,
            device_hit_tokens=len(hit_pages) * self.page_size,
        )
        state.refresh_slots(self.page_size)
        self.stats.prompt_tokens += len(tokens)
        self.stats.device_hit_tokens += state.device_hit_tokens
        return state

    def _alloc(self, n: int) -> np.ndarray | None:
        if n > self.allocator.available and self.tree is not None:
            self.stats.evicted_device_pages += self.tree.evict(n - self.allocator.available)
        return self.allocator.alloc(n)

    def cache_prefix(self, namespace: str, tokens: np.ndarray, state: KVState) -> None:
        """Insert the whole pages of ``tokens`` (whose KV is computed) into the tree and move
        the request's lock to the new boundary, so concurrent requests can share it."""
        if self.tree is None:
            return
        n_pages = len(tokens) // self.page_size
        if n_pages <= state.cached_pages:
            return
        self._insert(namespace, tokens[: n_pages * self.page_size], state)
        match = self.tree.match_prefix(namespace, tokens[: n_pages * self.page_size])
        assert len(match.device_pages) == n_pages, "inserted prefix must match in full"
        if not np.array_equal(match.device_pages, state.pages[:n_pages]):
            state.pages[:n_pages] = match.device_pages
            state.refresh_slots(self.page_size)
        self.tree.inc_lock_ref(match.last_device_node)
        self.tree.dec_lock_ref(state.node)
        state.node = match.last_device_node
        state.cached_pages = n_pages

    def release(self, namespace: str, tokens: np.ndarray, state: KVState) -> None:
        """The request is done: cache the whole pages of ``tokens`` (those whose KV is
        computed), free every other page the request held, drop its lock."""
        keep = 0
        if self.tree is not None:
            keep = len(tokens) // self.page_size
            if keep > state.cached_pages:
                self._insert(namespace, tokens[: keep * self.page_size], state)
            keep = max(keep, state.cached_pages)
        self.allocator.free(state.pages[keep:])
        if state.node is not None:
            self.tree.dec_lock_ref(state.node)
        state.pages = state.pages[:0]
        state.node = None

    def _insert(self, namespace: str, tokens: np.ndarray, state: KVState) -> None:
        n_pages = len(tokens) // self.page_size
        already = self.tree.insert(namespace, tokens, state.pages[:n_pages]) // self.page_size
        # Pages we computed for a span another request cached first are duplicates: free them.
        if already > state.cached_pages:
            self.allocator.free(state.pages[state.cached_pages : already])

    def flush(self) -> None:
        """Drop all cached prefixes. Only valid when no request holds pages."""
        if self.tree is not None:
            self.tree.reset()
        if self.allocator.available != self.allocator.capacity:
            raise RuntimeError("flush while requests still hold device pages")

    def usage(self) -> dict:
        tree = self.tree
        return {
            "page_size": self.page_size,
            "capacity_pages": self.capacity_pages,
            "free_pages": self.allocator.available,
            "cached_pages": tree.cached_pages if tree else 0,
            "evictable_pages": tree.evictable_pages if tree else 0,
            "locked_pages": tree.protected_pages if tree else 0,
            "request_pages": self.capacity_pages - self.allocator.available - (tree.cached_pages if tree else 0),
            "device_pool_bytes": self.pool.total_bytes,
        }
