"""Device eviction from the prefix tree: unlocked leaves in policy order (LRU or LFU).

Units: pages. Order is a deterministic key (logical tick, hit count, node id), so ranks
evicting from the same tree pick the same victims (DESIGN invariant 3). A victim with a host
copy stays in the tree host-only; one without is dropped with its (host-only) subtree.
"""

from __future__ import annotations

import heapq
import logging
from typing import Callable, Iterator

import numpy as np

from ..consensus_record import consensus_check
from .page_tree import TreeObserver
from .pools import PageAllocator
from .tree_node import TreeNode

logger = logging.getLogger(__name__)


class LeafEviction:
    """Eviction for :class:`~.radix.RadixCache` (mixed in): it frees the tree's device pages
    and keeps the tree's page counters right while doing so."""

    # Provided by RadixCache / PageTree.
    allocator: PageAllocator
    host_allocator: PageAllocator | None
    eviction_policy: str
    backup_on_evict: Callable[[TreeNode], bool] | None
    evictable_pages: int
    host_pages_held: int
    evicted_pages_total: int
    window: int
    _drop_window: Callable[[TreeNode], int]
    _drop_host_window: Callable[[TreeNode], None]
    _all_nodes: Callable[[], Iterator[TreeNode]]
    _page_key: Callable[[np.ndarray, int], bytes]
    observer: "TreeObserver | None"

    def _eviction_key(self, node: TreeNode) -> tuple:
        if self.eviction_policy == "lfu":
            return (node.hit_count, node.last_access, node.id)
        return (node.last_access, node.id)

    def _evictable_leaf(self, node: TreeNode) -> bool:
        return (
            not node.is_root and node.lock_ref == 0 and node.device_pages is not None
            and not any(c.device_pages is not None for c in node.children.values())
            # dropping a node without a host copy drops its subtree: not while storage reads it
            and (node.host_pages is not None or node.host_ref == 0)
        )

    def evict_leaves(self, num_pages: int, evictable: Callable[[TreeNode], bool],
                     take: Callable[[TreeNode], int], key: Callable[[TreeNode], tuple] | None = None) -> int:
        """Apply ``take`` (returns the pages it freed) to ``evictable`` leaves in ``key`` order
        (default: the policy's), a parent joining once its last child goes, until ``num_pages``
        are freed or none is left."""
        key = key or self._eviction_key
        heap = [(key(n), n) for n in self._all_nodes() if evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, node = heapq.heappop(heap)
            parent = node.parent
            freed += take(node)
            if evictable(parent):
                heapq.heappush(heap, (key(parent), parent))
        return freed

    def _device_victim_key(self, node: TreeNode) -> tuple:
        """Hybrid: leaves whose window KV is all tombstoned first (no match can end in them), then
        the policy's order."""
        return (node.held_window_pages > 0, *self._eviction_key(node))

    @consensus_check("tree.evict", args=lambda self, num_pages, wanted=None: num_pages, result=lambda freed: freed)
    def evict(self, num_pages: int, wanted: Callable[[np.ndarray], bool] | None = None) -> int:
        """Free at least ``num_pages`` device pages from unlocked leaves, least valuable first
        (policy order); ``wanted(pages)``: only leaves whose device pages it accepts (sharded KV:
        those holding a page on an owner that is short). A victim with a host copy stays in the
        tree as host-only; one without is dropped (with any host-only nodes below it). Returns
        the pages freed (fewer when too little is evictable)."""
        evictable = self._evictable_leaf if wanted is None else \
            (lambda n: self._evictable_leaf(n) and wanted(n.device_pages))
        freed = self.evict_leaves(num_pages, evictable, self._evict_device,
                                  self._device_victim_key if self.window else None)
        self.evicted_pages_total += freed
        if freed:
            logger.debug("evicted %d device pages", freed)
        return freed

    def _evict_device(self, node: TreeNode) -> int:
        if node.host_pages is None and self.backup_on_evict is not None:
            self.backup_on_evict(node)
        freed = node.num_pages
        self.evictable_pages -= freed
        self.allocator.free(node.device_pages)
        self._drop_window(node)
        node.device_pages = node.window_pages = None
        if node.host_pages is None:
            self.delete_subtree(node)
        return freed

    def delete_subtree(self, node: TreeNode) -> None:
        """Unlink ``node``; free the host pages of it and everything below (none is on device)."""
        del node.parent.children[self._page_key(node.key, 0)]
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.device_pages is None and n.lock_ref == 0 and n.host_ref == 0, f"{n}: deleting live data"
            if self.observer is not None:
                self.observer.on_delete(n)
            if n.host_pages is not None:
                self.host_allocator.free(n.host_pages)
                self.host_pages_held -= len(n.host_pages)
                n.host_pages = None
                self._drop_host_window(n)
            stack.extend(n.children.values())
