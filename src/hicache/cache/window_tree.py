"""The prefix tree's sliding-window component (a hybrid pool, issue 48): which cached pages still
hold their window-layer KV, and the rules that keep those useful.

A boundary of ``m`` pages is a usable prefix hit only if the window its next token reads is held:
the pages of positions ``m * page - window + 1 .. m * page - 1`` (:func:`window_first_page`). A
match is cut back to the last such boundary: recomputing a window is not an option (each sliding
layer's window depends on the layer below's, so it reaches back a window per layer). Window pages
of other cached pages are tombstones (id 0) once evicted; full-layer pages stay.

Running requests lock the window pages their next tokens read (``WindowPart.lock_ref``, whole nodes,
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import numpy as np

from ..consensus_record import consensus_check
from .pools import PageAllocator, SharedWindowAllocator, free_held
from .tree_node import TreeNode, check_pages

if TYPE_CHECKING:
    from .leaf_eviction import LeafEviction

logger = logging.getLogger(__name__)


def window_first_page(boundary_tokens: int, window: int, page_size: int) -> int:
    """First page whose window-layer KV a token at position ``boundary_tokens`` reads."""
    return max(0, boundary_tokens - window + 1) // page_size


def path_spans(node: TreeNode | None, end: int, first: int, page_size: int) -> Iterator[tuple[TreeNode, int]]:
    """``node`` (ending ``end`` pages into its namespace) and its ancestors that end after page ``first``,
    nearest first, each with its first page. A caller may split the node it was given: the walk
    goes on from the node's parent as it was."""
    while end > first and not node.is_root:
        start = end - len(node.key) // page_size
        yield node, start
        node, end = node.parent, start


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


@dataclass(slots=True)
class WindowPart:
    """A node's handle on the window component (``node.parts[TreeWindows.index]``)."""

    # window page per device page (0: tombstone); None without device pages
    device: np.ndarray | None = None
    # host window page per host page (0: none; the host keeps checkpoints' only); None without a host copy
    host: np.ndarray | None = None
    # running requests whose window reaches into the node: its window pages are not evicted. Unlike the
    # node's lock_ref it is not path-wide: a request locks just the nodes its window covers (whole nodes).
    lock_ref: int = 0

    @property
    def held(self) -> int:
        """Window pages the node holds on the device (not tombstoned)."""
        return int(np.count_nonzero(self.device)) if self.device is not None else 0

    @property
    def host_held(self) -> int:
        """Window pages the node's host copy holds."""
        return int(np.count_nonzero(self.host)) if self.host is not None else 0


class TreeWindows:
    """The window component of a :class:`~.radix.RadixCache` (``tree.windows``; a
    :class:`~.tree_node.TreeComponent`): window pages per node, the locks of running requests,
    tombstoning eviction. Tiers change nodes' window pages only through its methods."""

    name = "window"

    def __init__(self, tree: "LeafEviction", window: int, allocator: PageAllocator) -> None:
        self.tree, self.page_size = tree, tree.page_size
        self.index = -1  # set when the tree registers it (PageTree.add_component)
        self.window = window  # tokens
        self.allocator = allocator
        # set by a hybrid host tier (HostWindows): window pages of a fixed split, or shared blocks
        self.host_allocator: PageAllocator | SharedWindowAllocator | None = None
        self.held_pages = 0  # window pages the tree holds on the device

    def of(self, node: TreeNode) -> WindowPart:
        return node.parts[self.index]

    def new_part(self) -> WindowPart:
        return WindowPart()

    def first_page(self, boundary_tokens: int) -> int:
        return window_first_page(boundary_tokens, self.window, self.page_size)

    # ---- the tree's hooks ----------------------------------------------------------------
    def split(self, upper: TreeNode, node: TreeNode, pages: int) -> None:
        up, low = self.of(upper), self.of(node)
        # a window lock covers whole nodes from its first page on, so both parts of a locked node stay locked
        up.lock_ref = low.lock_ref
        if low.device is not None:
            up.device, low.device = low.device[:pages], low.device[pages:]
        if low.host is not None:
            up.host, low.host = low.host[:pages], low.host[pages:]

    def usable(self, path: list[TreeNode], device_tokens: int, host_tokens: int) -> int:
        """Tokens of the path's match (its leading device run, then host-only tokens) that a
        request may use: cut back to the last boundary whose window is held (on the device or in a
        host copy in the device run -- a tombstone the host holds is loaded back with the hit --,
        on the host after it)."""
        held, pos = np.zeros((device_tokens + host_tokens) // self.page_size, dtype=bool), 0
        for node in path:  # (each matched in full but the last)
            part, n = self.of(node), min(self.tree.key_pages(node), len(held) - pos)
            if part.host is not None:
                held[pos:pos + n] = part.host[:n] != 0
            if pos * self.page_size < device_tokens and part.device is not None:
                held[pos:pos + n] |= part.device[:n] != 0
            pos += n
        return usable_boundary(held, self.window, self.page_size) * self.page_size

    def adopt(self, node: TreeNode, offered: np.ndarray, fresh: bool) -> None:
        """``node`` takes ``offered`` (a request's window pages for its key pages; 0: none) where it
        holds none; a page it already holds makes the offered one a duplicate, freed."""
        part = self.of(node)
        if fresh or part.device is None:
            part.device = np.asarray(offered, dtype=np.int64).copy()
            self.held_pages += part.held
            return
        take = (part.device == 0) & (offered != 0)
        part.device[take] = offered[take]
        self.held_pages += int(np.count_nonzero(take))
        self.allocator.free(offered[(offered != 0) & ~take])

    def hit_pages(self, nodes: list[TreeNode]) -> np.ndarray:
        return np.concatenate([self.of(m).device for m in nodes]) if nodes else np.zeros(0, dtype=np.int64)

    def device_attached(self, node: TreeNode) -> None:
        """Its window pages come with the load, where it brings them (``DeviceWindows``)."""
        self.of(node).device = np.zeros(node.num_pages, dtype=np.int64)

    def host_attached(self, node: TreeNode) -> None:
        """Its host window pages come with the backup (``HostWindows.backup``)."""

    def drop_device(self, node: TreeNode) -> None:
        """The node's device copy goes: its window pages with it."""
        self.tombstone(node)
        self.of(node).device = None

    def tombstone(self, node: TreeNode, pages: int | None = None) -> int:
        """Free the window pages ``node`` holds among its first ``pages`` (default: all), leaving
        tombstones. Returns how many."""
        device = self.of(node).device
        freed = free_held(self.allocator, device, slice(pages)) if device is not None else 0
        self.held_pages -= freed
        return freed

    def drop_host(self, node: TreeNode) -> None:
        """Free ``node``'s host window pages (its host copy is gone)."""
        part = self.of(node)
        if part.host is not None:
            self.host_allocator.free(part.host[part.host != 0])
            part.host = None

    def victim_rank(self, node: TreeNode) -> tuple:
        """Device eviction takes leaves whose window KV is all tombstoned first (no match can end in them)."""
        return (self.of(node).held > 0,)

    def check(self, nodes: list[TreeNode]) -> None:
        """Window pages only beside device pages (host ones beside host pages), one per page, none
        shared; a window lock only on a locked node (a request locks its whole path)."""
        seen: set[int] = set()
        seen_host: set[int] = set()
        for node in nodes:
            part = self.of(node)
            assert 0 <= part.lock_ref <= node.lock_ref, f"{node}: window locked by more requests than lock it"
            if part.device is not None:
                assert node.device_pages is not None, f"{node}: window pages without device pages"
                check_pages(node, part.device, seen, node.num_pages, "window", holes=True)
            if part.host is not None:
                assert node.host_pages is not None, f"{node}: host window pages without host pages"
                check_pages(node, part.host, seen_host, len(node.host_pages), "host window", holes=True)
        assert len(seen) == self.held_pages, (len(seen), self.held_pages)

    # ---- what tiers do to nodes ----------------------------------------------------------
    def give(self, node: TreeNode, idx: np.ndarray, pages: np.ndarray) -> None:
        """``node``'s pages ``idx`` (tombstones) now hold their window KV in device ``pages``."""
        self.of(node).device[idx] = pages
        self.held_pages += len(idx)

    def attach_host(self, node: TreeNode, idx: np.ndarray, pages: np.ndarray) -> None:
        """``node``'s new host copy keeps the window of its pages ``idx`` in host window ``pages``."""
        part = self.of(node)
        part.host = np.zeros(len(node.host_pages), dtype=np.int64)
        part.host[idx] = pages

    def free_host(self, node: TreeNode, idx: np.ndarray) -> int:
        """Free the host window pages of ``node``'s pages ``idx`` (its copy keeps the full KV). Returns how many."""
        host = self.of(node).host
        return free_held(self.host_allocator, host, idx) if host is not None else 0

    # ---- checkpoints ---------------------------------------------------------------------
    def checkpoint_span(self, node: TreeNode) -> tuple[int, int]:
        """(end page, first page) of the window of ``node``'s end boundary, cut to the node."""
        end = sum(self.tree.key_pages(n) for n in node.lineage())
        return end, max(self.first_page(end * self.page_size), end - self.tree.key_pages(node))

    def checkpoint_pages(self, node: TreeNode) -> np.ndarray:
        """Indices of ``node``'s pages inside the window of its end boundary whose window KV the
        device holds: what a host copy of the node keeps of the window layers."""
        end, first = self.checkpoint_span(node)
        start = end - self.tree.key_pages(node)
        idx, device = np.arange(first, end) - start, self.of(node).device
        return idx[device[idx] != 0] if device is not None else idx[:0]

    def superseded(self, node: TreeNode) -> list[tuple[TreeNode, np.ndarray]]:
        """Pages of ``node``'s ancestors whose window no hit will start from once ``node``'s end
        window (its checkpoint) is stored: walking up while each ancestor's only child continues
        the path (a conversation that went on; a branch point, where other conversations' hits
        start, ends the walk), its pages before the first page the window of ``node``'s start
        reads. The checkpoint just before ``node`` keeps its window (the same prompt again -- a
        retry, a regenerated answer -- hits it); those before it go. (ancestor, page indices)
        pairs, nearest first."""
        end = sum(self.tree.key_pages(n) for n in node.parent.lineage())
        first, out = self.first_page(end * self.page_size), []
        for anc, start in path_spans(node.parent, end, 0, self.page_size):
            if len(anc.children) != 1:
                break
            idx = np.arange(0, min(self.tree.key_pages(anc), max(first - start, 0)))
            if len(idx):
                out.append((anc, idx))
        return out

    # ---- locks ---------------------------------------------------------------------------
    def lock(self, node: TreeNode, end_page: int, first_page: int) -> None:
        """Protect the window pages of the nodes on ``node``'s path from ``first_page`` to
        ``end_page`` (where ``node`` ends); the node holding ``first_page`` is split there so the
        lock covers no page before it."""
        for n, start in path_spans(node, end_page, first_page, self.page_size):
            if start < first_page:
                self.tree.split(n, (first_page - start) * self.page_size)  # n keeps the lower part
            self.of(n).lock_ref += 1

    def unlock(self, node: TreeNode, end_page: int, first_page: int) -> None:
        """Undo :meth:`lock` with the same arguments (later splits keep node boundaries inside the
        span, and give both parts the lock)."""
        for n, _ in path_spans(node, end_page, first_page, self.page_size):
            part = self.of(n)
            if part.lock_ref <= 0:
                raise RuntimeError(f"window unlock of a node not window-locked {n}")
            part.lock_ref -= 1

    # ---- eviction ------------------------------------------------------------------------
    def _checkpoint_tails(self) -> dict[TreeNode, int]:
        """Per node, how many of its last pages the checkpoint of some leaf below (or of itself, a
        leaf) needs: the leaf's window reaches back ``end - window_first_page(end)`` pages. Only
        leaves holding window pages count (a tombstoned checkpoint protects nothing)."""
        order, stack = [], [(root, 0) for root in self.tree.roots()]
        while stack:  # depth-first, each node with its end page
            node, start = stack.pop()
            end = start + self.tree.key_pages(node)
            order.append((node, end))
            stack.extend((c, end) for c in node.children.values() if c.device_pages is not None)
        reach: dict[TreeNode, int] = {}  # pages back from the node's end its subtree's checkpoints need
        for node, end in reversed(order):  # children before parents
            below = [reach[c] - c.num_pages for c in node.children.values() if c in reach]
            own = end - self.first_page(end * self.page_size) if self.of(node).held else 0  # a leaf's, if held
            reach[node] = max(max(below, default=own), 0)
        return {node: min(node.num_pages, need) for node, need in reach.items()}

    @consensus_check("tree.evict_windows", args=lambda self, num_pages, spare_only=False: (num_pages, "spare") if spare_only else num_pages,
                     result=lambda freed: freed)
    def evict(self, num_pages: int, spare_only: bool = False) -> int:
        """Tombstone the window pages of nodes no running request window-locks until at least
        ``num_pages`` are free or none is evictable: pages no leaf's checkpoint needs first (least
        recently used node first), then whole checkpoints (least recently used leaf first).
        Full-layer pages stay. ``spare_only``: no checkpoint. Returns the pages freed."""
        freed, key = 0, self.tree.eviction_key
        while freed < num_pages:
            tails = self._checkpoint_tails()
            unlocked = [n for n in tails if not n.is_root and self.of(n).lock_ref == 0]
            spare = [(key(n), n) for n in unlocked if np.count_nonzero(self.of(n).device[: n.num_pages - tails[n]])]
            heapq.heapify(spare)
            while freed < num_pages and spare:
                node = heapq.heappop(spare)[1]
                freed += self.tombstone(node, node.num_pages - tails[node])
            if freed >= num_pages or spare_only:
                break
            leaves = [n for n in unlocked if tails[n] and self.of(n).held
                      and not any(c.device_pages is not None for c in n.children.values())]
            if not leaves:
                break
            freed += self.tombstone(min(leaves, key=key))  # then its ancestors' share, above
        if freed:
            logger.debug("tombstoned %d window pages", freed)
        return freed

    def usage(self) -> dict:
        """Window pages the tree holds, and those running requests lock."""
        locked = sum(self.of(n).held for n in self.tree.all_nodes() if not n.is_root and self.of(n).lock_ref > 0)
        return {"cached_pages": self.held_pages, "locked_pages": locked,
                "evictable_pages": self.held_pages - locked}
