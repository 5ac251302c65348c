"""The host tier's sliding-window component (a hybrid pool, issue 48): host window pages for the
window of a backed-up node's end boundary only -- the checkpoint a next turn needs -- and the
window pages a load-back brings with the rest of a hit.

Over a fixed split they are a second host pool (``window_host``, page ids of its own); over shared
device blocks (issue 56) one block per sliding group of the same host pool the full pages take
theirs from, so eviction makes room for either kind from one budget (:meth:`HostWindows.make_room`).
A backup window-locks its node's checkpoint until its ack is consumed (the copy reads those device
window pages); once it lands, the host windows of the ancestors' checkpoints it supersedes go.

Units: pages unless named; host window page ids of the window allocator.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .host_pool import HostKVPool
from .host_transfer import TransferOp
from .page_tree import EMPTY_PAGES
from .placement import ShardedPageAllocator, alloc_evicting
from .pools import PageAllocator, SharedWindowAllocator
from .radix import RadixCache
from .storage.storage_ops import PrefetchOp
from .tiers import CacheStats
from .tree_node import TreeNode
from .window_tree import TreeWindows


class HostPages(Protocol):
    """What the window component uses of the host tier (:class:`~.host_tier.HostTier`)."""

    host_pool: HostKVPool
    allocator: PageAllocator | ShardedPageAllocator
    tree: RadixCache
    stats: CacheStats

    def drop(self, node: TreeNode) -> int: ...  # delete a host-only leaf (counted as evicted); the host pages it held

    def evictable(self, node: TreeNode) -> bool: ...  # a host-only leaf host eviction may take

    def loads_pending(self) -> bool: ...  # a load is queued or in flight


class HostWindows:
    """Host window pages of ``tier``'s nodes (``tier.windows``), kept on the tree's window
    component (``cached``): which to copy at a backup and a load, what superseded checkpoints free,
    and eviction for window room."""

    name = "window"  # the component (its pages in a transfer op's ``parts``, its ``/stats`` key)

    def __init__(self, tier: HostPages, window_host: HostKVPool, cached: TreeWindows) -> None:
        self.tier, self.window_host, self.cached = tier, window_host, cached
        self.shared = tier.host_pool.shared
        # a window pool of its own: its pages; shared: the ids of window pages of blocks of the full pages' allocator
        self.allocator: PageAllocator | SharedWindowAllocator = window_host.windows.page_ids(tier.allocator)
        cached.host_allocator = self.allocator
        # the window span each in-flight backup window-locks (its device window pages must not be tombstoned
        # and reused before the copy reads them), by node
        self._spans: dict[TreeNode, tuple[int, int]] = {}
        # backed-up nodes whose checkpoint supersedes their ancestors' host windows (drop_superseded)
        self._superseding: list[TreeNode] = []

    # ---- backups -------------------------------------------------------------------------
    def backup(self, node: TreeNode, lock: bool) -> tuple[np.ndarray, np.ndarray]:
        """Host window pages for ``node``'s checkpoint (the window of its end boundary, where the
        device holds it); the (device, host) window pages to copy. Without room (after evicting host
        leaves) the host copy keeps tombstones there. ``lock``: window-lock the node until
        :meth:`backed_up` (an asynchronous copy)."""
        idx = self.cached.checkpoint_pages(node)
        host, _ = alloc_evicting(self.allocator, len(idx), 0, self.evict_for_room) if len(idx) else (EMPTY_PAGES, 0)
        if host is None:
            self.tier.stats.backup_skipped_window_pages += len(idx)
            idx, host = EMPTY_PAGES, EMPTY_PAGES
        self.cached.attach_host(node, idx, host)
        if lock and len(host):  # the whole node: a lock from inside it would split it under this backup
            end = self.cached.checkpoint_span(node)[0]
            span = self._spans[node] = (end, end - node.num_pages)
            self.cached.lock(node, *span)
        return self.cached.of(node).device[idx], host

    def backed_up(self, node: TreeNode) -> None:
        """``node``'s backup ack was consumed: its checkpoint's lock comes off."""
        if node in self._spans:
            self.cached.unlock(node, *self._spans.pop(node))
            self._superseding.append(node)

    def drop_superseded(self) -> None:
        """Nodes whose checkpoint window reached the host: free the host window pages of the
        ancestors' checkpoints each supersedes (their conversation went on; no hit starts there),
        once no load may be reading them and storage is not writing them (else at a later ack)."""
        if self.tier.loads_pending():
            return
        later = []
        for node in self._superseding:
            pairs = self.cached.superseded(node) if self.cached.of(node).host is not None else []
            if any(anc.host_ref for anc, _ in pairs):
                later.append(node)
                continue
            for anc, idx in pairs:
                self.tier.stats.superseded_host_window_pages += self.cached.free_host(anc, idx)
        self._superseding = later

    # ---- loads ---------------------------------------------------------------------------
    def load(self, node: TreeNode) -> tuple[np.ndarray, np.ndarray]:
        """The (device, host) window pages of a node being loaded back: those DeviceWindows gave
        device pages to."""
        part = self.cached.of(node)
        if part.device is None:
            return EMPTY_PAGES, EMPTY_PAGES
        idx = np.flatnonzero(part.device)
        return part.device[idx], part.host[idx]

    # ---- storage (L3) --------------------------------------------------------------------
    def span(self, end_page: int) -> int:
        """Pages before a boundary of ``end_page`` pages that its window reads."""
        return end_page - self.cached.first_page(end_page * self.cached.page_size)

    def reserve_prefetch(self, end_page: int) -> np.ndarray | None:
        """Host window pages for the window of a prefetch's end (None: no room)."""
        return alloc_evicting(self.allocator, self.span(end_page), 0, self.evict_for_room)[0]

    def place_prefetch(self, op: PrefetchOp, leaf: TreeNode | None, taken_from: int) -> np.ndarray:
        """The window pages a finished read brought go to ``leaf``, the new host-only leaf of the
        pages the tree took (from ``taken_from`` on; None when it took none); the rest are freed.
        Returns the pages to free once the reader is surely done with them (the prefetch is reaped)."""
        read = op.parts[self.name]
        pages = read.host_pages
        if not (op.final_applied and read.first >= 0):  # the reader may still write them
            return pages
        keep = np.zeros(len(pages), dtype=bool)
        if op.completed > taken_from:  # the tree took some: they hang from one new host-only leaf
            assert leaf is not None, f"prefetch op={op.op_id}: the pages the tree took have no leaf"
            rel = np.arange(read.first, op.completed)  # op-relative pages the window objects were read for
            keep[: len(rel)] = rel >= taken_from
            self.cached.attach_host(leaf, rel[keep[: len(rel)]] - taken_from, pages[keep])
        self.allocator.free(pages[~keep])
        return EMPTY_PAGES

    def stored(self, node: TreeNode) -> tuple[np.ndarray, np.ndarray] | None:
        """(page indices, host window pages) of ``node``'s checkpoint pages a storage backup writes."""
        host = self.cached.of(node).host
        if host is None:
            return None
        idx = np.flatnonzero(host)
        return idx, host[idx].copy()

    def superseded_stored(self, node: TreeNode) -> list[tuple[TreeNode, np.ndarray]]:
        """Pages of stored ancestors whose window objects ``node``'s checkpoint supersedes
        (:meth:`~.window_tree.TreeWindows.superseded`): only pages whose host copy still holds a
        window have one left (the objects of earlier ones went with them)."""
        out = []
        for anc, idx in self.cached.superseded(node):
            host = self.cached.of(anc).host
            if anc.stored and host is not None and len(idx := idx[host[idx] != 0]):
                out.append((anc, idx))
        return out

    # ---- room ----------------------------------------------------------------------------
    def evict_for_room(self, num_pages: int) -> int:
        """Delete host-only leaves holding window pages until ``num_pages`` of those are free (shared
        blocks: until the blocks of ``num_pages`` window pages are, see :meth:`make_room`)."""
        if self.shared:
            return self.make_room(num_pages * self.allocator.groups) // self.allocator.groups
        tier = self.tier
        return tier.tree.evict_leaves(num_pages, lambda n: tier.evictable(n) and self.cached.of(n).host_held > 0,
                                      self._drop)

    def make_room(self, blocks: int) -> int:
        """Shared blocks: free at least ``blocks`` blocks if the tree can: the window pages of superseded
        checkpoints first (:meth:`drop_superseded`, once no load may read them), then host-only
        leaves in policy order, each with its full pages and window pages. Returns the blocks freed."""
        shared = self.tier.allocator  # the blocks both kinds take
        start = shared.available
        self.drop_superseded()
        short = blocks - (shared.available - start)
        if short > 0:
            self.tier.tree.evict_leaves(short, self.tier.evictable, self._drop)
        return shared.available - start

    def _drop(self, node: TreeNode) -> int:
        """Delete a host-only leaf; what that freed: its window pages (shared: the blocks its full and
        window pages held)."""
        windows = self.cached.of(node).host_held
        pages = self.tier.drop(node)
        return pages + windows * self.allocator.groups if self.shared else windows

    # ---- accounting ----------------------------------------------------------------------
    def op_bytes(self, op: TransferOp) -> int:
        part = op.parts.get(self.name)
        return 0 if part is None else len(part.device) * self.window_host.windows.bytes_per_page

    def usage(self, full_pool: HostKVPool, page_size: int) -> dict:
        a = self.allocator
        held = a.capacity - a.ids.available if self.shared else a.capacity - a.available
        out = {"capacity_pages": a.capacity, "free_pages": a.available,
               "cached_pages": held, "cached_tokens": held * page_size,
               "superseded_pages": self.tier.stats.superseded_host_window_pages,
               "page_bytes": self.window_host.windows.bytes_per_page,
               "pool_bytes": self.window_host.total_bytes,
               "full_pool_bytes": full_pool.total_bytes}
        if self.shared:  # one pool of blocks: capacity_pages are the window pages its blocks could hold
            out.update(shared_blocks=True, groups=a.groups)
        return out

