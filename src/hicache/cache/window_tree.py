"""The prefix tree's sliding-window component (a hybrid pool, issue 48): which cached pages still
hold their window-layer KV, and the rules that keep those useful.

A boundary of ``m`` pages is a usable prefix hit only if the window its next token reads is held:
the pages of positions ``m * page - window + 1 .. m * page - 1`` (:func:`window_first_page`). A
match is cut back to the last such boundary: recomputing a window is not an option (each sliding
layer's window depends on the layer below's, so it reaches back a window per layer). Window pages
of other cached pages are tombstones (id 0) once evicted; full-layer pages stay.

Running requests lock the window pages their next tokens read (``window_lock_ref``, whole nodes,
split at the first page), never more; everything else the tree holds is evictable, in two rounds:
first every window page no leaf's checkpoint needs (a leaf's checkpoint is the window of its end
boundary, which reaches into its ancestors when the leaf is shorter than a window), least recently
used node first; then whole checkpoints, least recently used leaf first (what they held in their
ancestors goes in a later first round). Order is a deterministic key, so ranks evicting from the
same tree agree (DESIGN invariant 3).

Units: pages unless named tokens; page indices count from the namespace's root.
"""

from __future__ import annotations

import heapq
import logging
from typing import Callable, Iterator

import numpy as np

from ..consensus_record import consensus_check
from .pools import PageAllocator
from .tree_node import TreeNode

logger = logging.getLogger(__name__)


def window_first_page(boundary_tokens: int, window: int, page_size: int) -> int:
    """First page whose window-layer KV a token at position ``boundary_tokens`` reads."""
    return max(0, boundary_tokens - window + 1) // page_size


def usable_boundary(held: np.ndarray, window: int, page_size: int) -> int:
    """The largest ``m <= len(held)`` (pages) whose window pages are all held (``held``: per page
    of a path from the root, whether its window page is held); 0 always qualifies."""
    n = len(held)
    if n == 0 or held.all():
        return n
    # last[m]: index of the last tombstone before page m (-1: none)
    last = np.full(n + 1, -1, dtype=np.int64)
    last[1:] = np.maximum.accumulate(np.where(held, -1, np.arange(n)))
    m = np.arange(n + 1)
    first = np.maximum(0, m * page_size - window + 1) // page_size
    return int(np.flatnonzero(last < first)[-1])


class WindowTombstones:
    """The window component of :class:`~.radix.RadixCache` (mixed in; inactive when ``window`` is
    0): window pages per node, the locks of running requests, tombstoning eviction."""

    # Provided by RadixCache / PageTree.
    page_size: int
    eviction_policy: str
    _all_nodes: Callable[[], Iterator[TreeNode]]
    _split: Callable[[TreeNode, int], TreeNode]
    _eviction_key: Callable[[TreeNode], tuple]

    def _init_window(self, window: int, window_allocator: PageAllocator | None) -> None:
        if window and window_allocator is None:
            raise ValueError("a sliding-window component needs its own page allocator")
        self.window = window  # tokens; 0: no window component
        self.window_allocator = window_allocator
        self.window_pages_held = 0
        self.evicted_window_pages_total = 0
        self.host_window_allocator: PageAllocator | None = None  # set by a hybrid host tier

    def _drop_host_window(self, node: TreeNode) -> None:
        """Free ``node``'s host window pages (its host copy is gone)."""
        if node.host_window_pages is not None:
            self.host_window_allocator.free(node.host_window_pages[node.host_window_pages != 0])
            node.host_window_pages = None

    def window_first_page(self, boundary_tokens: int) -> int:
        return window_first_page(boundary_tokens, self.window, self.page_size)

    # ---- matching ------------------------------------------------------------------------
    def _cut_to_window(self, path: list[TreeNode], device_tokens: int, host_tokens: int) -> int:
        """Tokens of the path's match (its leading device run, then host-only tokens) that a
        request may use: cut back to the last boundary whose window is held (on the device or in a
        host copy in the device run -- a tombstone the host holds is loaded back with the hit --,
        on the host after it)."""
        total = (device_tokens + host_tokens) // self.page_size
        if total == 0:
            return 0
        held, pos, device = [], 0, device_tokens // self.page_size
        for node in path:
            if pos >= total:
                break
            n = min(len(node.key) // self.page_size, total - pos)
            host = node.host_window_pages[:n] != 0 if node.host_window_pages is not None else np.zeros(n, dtype=bool)
            held.append(host | (node.window_pages[:n] != 0) if pos < device and node.window_pages is not None else host)
            pos += n
        return usable_boundary(np.concatenate(held), self.window, self.page_size) * self.page_size

    def checkpoint_span(self, node: TreeNode) -> tuple[int, int]:
        """(end page, first page) of the window of ``node``'s end boundary, cut to the node."""
        end, n = 0, node
        while not n.is_root:
            end += len(n.key) // self.page_size
            n = n.parent
        return end, max(self.window_first_page(end * self.page_size), end - len(node.key) // self.page_size)

    def checkpoint_pages(self, node: TreeNode) -> np.ndarray:
        """Indices of ``node``'s pages inside the window of its end boundary whose window KV the
        device holds: what a host copy of the node keeps of the window layers."""
        end, first = self.checkpoint_span(node)
        start = end - len(node.key) // self.page_size
        idx = np.arange(first, end) - start
        return idx[node.window_pages[idx] != 0] if node.window_pages is not None else idx[:0]

    def superseded_windows(self, node: TreeNode) -> list[tuple[TreeNode, np.ndarray]]:
        """Pages of ``node``'s ancestors whose window no hit will start from once ``node``'s end
        window (its checkpoint) is stored: walking up while each ancestor's only child continues
        the path (a conversation that went on; a branch point, where other conversations' hits
        start, ends the walk), its pages before the first page the window of ``node``'s start
        reads. The checkpoint just before ``node`` keeps its window (the same prompt again -- a
        retry, a regenerated answer -- hits it); those before it go. (ancestor, page indices)
        pairs, nearest first."""
        start, n = 0, node.parent
        while not n.is_root:
            start += self._key_pages(n)
            n = n.parent
        first = self.window_first_page(start * self.page_size)
        out, pos, anc = [], start, node.parent
        while not anc.is_root and len(anc.children) == 1:
            start = pos - self._key_pages(anc)
            idx = np.arange(0, min(self._key_pages(anc), max(first - start, 0)))
            if len(idx):
                out.append((anc, idx))
            anc, pos = anc.parent, start
        return out

    def _key_pages(self, node: TreeNode) -> int:
        """``node``'s length in pages, whichever tiers hold it (``num_pages`` counts device pages: 0 for a
        host-only node, which a hit's window lock walks before its pages are loaded)."""
        return len(node.key) // self.page_size

    # ---- locks ---------------------------------------------------------------------------
    def lock_window(self, node: TreeNode, end_page: int, first_page: int) -> None:
        """Protect the window pages of the nodes on ``node``'s path from ``first_page`` to
        ``end_page`` (where ``node`` ends); the node holding ``first_page`` is split there so the
        lock covers no page before it."""
        pos = end_page
        while not node.is_root and pos > first_page:
            start = pos - self._key_pages(node)
            if start < first_page:
                self._split(node, (first_page - start) * self.page_size)  # node keeps the lower part
                start = first_page
            node.window_lock_ref += 1
            node, pos = node.parent, start

    def unlock_window(self, node: TreeNode, end_page: int, first_page: int) -> None:
        """Undo :meth:`lock_window` with the same arguments (later splits keep node boundaries
        inside the span, and give both parts the lock)."""
        pos = end_page
        while not node.is_root and pos > first_page:
            if node.window_lock_ref <= 0:
                raise RuntimeError(f"window unlock of a node not window-locked {node}")
            node.window_lock_ref -= 1
            node, pos = node.parent, pos - self._key_pages(node)

    # ---- giving and taking pages ---------------------------------------------------------
    def _adopt_window(self, node: TreeNode, offered: np.ndarray | None, fresh: bool) -> None:
        """``node`` takes ``offered`` (a request's window pages for its key pages; 0: none) where it
        holds none; a page it already holds makes the offered one a duplicate, freed."""
        if not self.window or offered is None:
            return
        if fresh or node.window_pages is None:
            node.window_pages = np.asarray(offered, dtype=np.int64).copy()
            self.window_pages_held += node.held_window_pages
            return
        take = (node.window_pages == 0) & (offered != 0)
        node.window_pages[take] = offered[take]
        self.window_pages_held += int(np.count_nonzero(take))
        self.window_allocator.free(offered[(offered != 0) & ~take])

    def _drop_window(self, node: TreeNode, pages: int | None = None) -> int:
        """Free the window pages ``node`` holds among its first ``pages`` (default: all), leaving
        tombstones. Returns how many."""
        if node.window_pages is None:
            return 0
        part = node.window_pages[:pages]
        held = part[part != 0]
        self.window_allocator.free(held)
        self.window_pages_held -= len(held)
        part[:] = 0
        return len(held)

    # ---- eviction ------------------------------------------------------------------------
    def _checkpoint_tails(self) -> dict[TreeNode, int]:
        """Per node, how many of its last pages the checkpoint of some leaf below (or of itself, a
        leaf) needs: the leaf's window reaches back ``end - window_first_page(end)`` pages. Only
        leaves holding window pages count (a tombstoned checkpoint protects nothing)."""
        order, stack = [], [(root, 0) for root in self._roots.values()]
        while stack:  # depth-first, each node with its end page
            node, start = stack.pop()
            end = start + len(node.key) // self.page_size
            order.append((node, end))
            stack.extend((c, end) for c in node.children.values() if c.device_pages is not None)
        reach: dict[TreeNode, int] = {}  # pages back from the node's end its subtree's checkpoints need
        tails: dict[TreeNode, int] = {}
        for node, end in reversed(order):  # children before parents
            below = [reach[c] - c.num_pages for c in node.children.values() if c in reach]
            if below:
                need = max(below)
            else:  # a leaf: its own checkpoint, if it holds one
                need = end - self.window_first_page(end * self.page_size) if node.held_window_pages else 0
            reach[node] = max(need, 0)
            tails[node] = min(node.num_pages, reach[node])
        return tails

    @consensus_check("tree.evict_windows", args=lambda self, num_pages, spare_only=False: (num_pages, "spare") if spare_only else num_pages,
                     result=lambda freed: freed)
    def evict_windows(self, num_pages: int, spare_only: bool = False) -> int:
        """Tombstone the window pages of nodes no running request window-locks until at least
        ``num_pages`` are free or none is evictable: pages no leaf's checkpoint needs first (least
        recently used node first), then whole checkpoints (least recently used leaf first).
        Full-layer pages stay. ``spare_only``: no checkpoint. Returns the pages freed."""
        freed = 0
        while freed < num_pages:
            tails = self._checkpoint_tails()
            unlocked = [n for n in tails if not n.is_root and n.window_lock_ref == 0]
            spare = [(self._eviction_key(n), n) for n in unlocked
                     if np.count_nonzero(n.window_pages[: n.num_pages - tails[n]])]
            heapq.heapify(spare)
            while freed < num_pages and spare:
                node = heapq.heappop(spare)[1]
                freed += self._drop_window(node, node.num_pages - tails[node])
            if freed >= num_pages or spare_only:
                break
            leaves = [(self._eviction_key(n), n) for n in unlocked if tails[n] and n.held_window_pages
                      and not any(c.device_pages is not None for c in n.children.values())]
            if not leaves:
                break
            freed += self._drop_window(min(leaves, key=lambda kn: kn[0])[1])  # then its ancestors' share, above
        self.evicted_window_pages_total += freed
        if freed:
            logger.debug("tombstoned %d window pages", freed)
        return freed

    def window_usage(self) -> dict:
        """Window pages the tree holds, and those running requests lock."""
        locked = sum(n.held_window_pages for n in self._all_nodes() if n.window_lock_ref > 0)
        return {"cached_pages": self.window_pages_held, "locked_pages": locked,
                "evictable_pages": self.window_pages_held - locked}
