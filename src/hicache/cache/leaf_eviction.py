"""Device eviction from the prefix tree: unlocked leaves in policy order (LRU or LFU).

Units: pages. Order is a deterministic key (logical tick, hit count, node id), so ranks
evicting from the same tree pick the same victims (DESIGN invariant 3). A victim with a host
copy stays in the tree host-only; one without is dropped with its (host-only) subtree.

Retention (:mod:`.retention`) comes before the policy's key: a leaf a client asked to keep in a
tier goes only after every unretained one there, and a retained victim is demoted (copied to
the host first) rather than dropped. The retention clock is the newest request's arrival stamp,
the same on every rank, so retained or expired is decided alike everywhere.
"""

from __future__ import annotations

import heapq
import logging
from typing import Callable

import numpy as np

from ..consensus_record import consensus_check
from .page_tree import PageTree
from .pools import PageAllocator
from .tree_node import TreeNode

logger = logging.getLogger(__name__)


class LeafEviction(PageTree):
    """A page tree with its device and host pages counted, and device eviction: it frees the
    tree's device pages (and its components') and keeps the page counters right while doing so."""

    def __init__(self, page_size: int, allocator: PageAllocator, eviction_policy: str = "lru",
                 host_allocator: PageAllocator | None = None) -> None:
        if eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction policy {eviction_policy!r}")
        super().__init__(page_size)
        self.allocator = allocator
        self.host_allocator = host_allocator  # L2 pages; None without a host tier
        self.eviction_policy = eviction_policy
        # Called for an L1 victim that has no host copy yet; returns True once it has one
        # (write_back). Without it such a victim is dropped.
        self.backup_on_evict: Callable[[TreeNode], bool] | None = None
        # The same copy for a victim retained in the host tier, whatever the write policy (demotion).
        self.demote_on_evict: Callable[[TreeNode], bool] | None = None
        self.retain_clock = 0.0  # unix seconds: the newest arrival stamp seen (cache/retention.py)
        self.host_pages_held = 0
        self.evictable_pages = 0
        self.protected_pages = 0
        self.evicted_pages_total = 0
        # An order that replaces the policy's, device and host alike (the simulator's offline
        # optimal plugs its next-use key in here); None: the policy's.
        self.eviction_order: Callable[[TreeNode], tuple] | None = None

    def eviction_key(self, node: TreeNode) -> tuple:
        if self.eviction_order is not None:
            return self.eviction_order(node)
        if self.eviction_policy == "lfu":
            return (node.hit_count, node.last_access, node.id)
        return (node.last_access, node.id)

    def retention_rank(self, node: TreeNode, level: int) -> tuple[int, int]:
        """``node``'s place before the policy's key in tier ``level``'s eviction (0 device, 1 host):
        (1, priority) while a retention keeps it there, after every (0, 0)."""
        if node.retain_until > self.retain_clock and node.retain_level <= level:
            return 1, node.retain_priority
        return 0, 0

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
        key = key or self.eviction_key
        heap = [(key(n), n) for n in self.all_nodes() if evictable(n)]
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
        """Retention first (unretained leaves before retained ones), then the components' order (a
        hybrid tree: leaves whose window KV is all tombstoned), then the policy's."""
        return (*self.retention_rank(node, 0), *(r for c in self.components for r in c.victim_rank(node)),
                *self.eviction_key(node))

    @consensus_check("tree.evict", args=lambda self, num_pages, wanted=None: num_pages, result=lambda freed: freed)
    def evict(self, num_pages: int, wanted: Callable[[np.ndarray], bool] | None = None) -> int:
        """Free at least ``num_pages`` device pages from unlocked leaves, least valuable first
        (policy order); ``wanted(pages)``: only leaves whose device pages it accepts (sharded KV:
        those holding a page on an owner that is short). A victim with a host copy stays in the
        tree as host-only; one without is dropped (with any host-only nodes below it). Returns
        the pages freed (fewer when too little is evictable)."""
        evictable = self._evictable_leaf if wanted is None else \
            (lambda n: self._evictable_leaf(n) and wanted(n.device_pages))
        freed = self.evict_leaves(num_pages, evictable, self._evict_device, self._device_victim_key)
        self.evicted_pages_total += freed
        if freed:
            logger.debug("evicted %d device pages", freed)
        return freed

    def _evict_device(self, node: TreeNode) -> int:
        if node.host_pages is None:
            demoted = self.demote_on_evict if self.retention_rank(node, 1)[0] else None
            backup = self.backup_on_evict or demoted
            if backup is not None:
                backup(node)
        freed = node.num_pages
        self.evictable_pages -= freed
        self.drop_device(node)
        if node.host_pages is None:
            self.delete_subtree(node)
        return freed

    def drop_device(self, node: TreeNode) -> None:
        """Free ``node``'s device copy (its components' device pages with it); the caller keeps the counters."""
        self.allocator.free(node.device_pages)
        for component in self.components:
            component.drop_device(node)
        node.device_pages = None

    def drop_host(self, node: TreeNode) -> None:
        """Free ``node``'s host copy (its components' host pages with it)."""
        self.host_allocator.free(node.host_pages)
        self.host_pages_held -= len(node.host_pages)
        node.host_pages = None
        for component in self.components:
            component.drop_host(node)

    def delete_subtree(self, node: TreeNode) -> None:
        """Unlink ``node``; free the host pages of it and everything below (none is on device)."""
        del node.parent.children[self._page_key(node.key, 0)]
        for n in self.all_nodes(node):
            assert n.device_pages is None and n.lock_ref == 0 and n.host_ref == 0, f"{n}: deleting live data"
            self.retained.discard(n)
            if self.observer is not None:
                self.observer.on_delete(n)
            if n.host_pages is not None:
                self.drop_host(n)
