"""The radix tree's node and the results of its walks: per-node state of every tier.

Units: ``key`` is token ids, always whole pages; ``device_pages`` / ``host_pages`` are logical
page ids of the L1 / L2 pool, one per key page; ``hash_values`` one chained hash per key page;
``window_pages`` (a hybrid pool's sliding-window component) one window page id per key page, 0
where that page's window-layer KV is not held (a tombstone).
The tree (:mod:`.radix`) keeps the invariants between these fields; tiers only read them and
change them through the tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np


class TreeNode:
    """One edge of the tree: ``key`` tokens and where their KV lives in each tier."""

    __slots__ = (
        "id", "namespace", "key", "parent", "children", "device_pages", "host_pages",
        "hash_values", "stored", "lock_ref", "host_ref", "last_access", "hit_count", "window_pages",
        "window_lock_ref", "host_window_pages",
    )

    def __init__(self, node_id: int, namespace: str, key: np.ndarray, parent: "TreeNode | None") -> None:
        self.id = node_id
        self.namespace = namespace
        self.key = key  # int32 token ids, len = num_pages * page_size
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.device_pages: np.ndarray | None = None  # L1 page ids
        self.host_pages: np.ndarray | None = None  # L2 page ids (hierarchical cache)
        self.hash_values: list[bytes] | None = None  # per-page chained hashes (storage tier)
        self.stored = False  # a storage backup of this node's pages was issued (L3)
        self.lock_ref = 0
        self.host_ref = 0  # in-flight reads of the host copy (storage backups); like lock_ref, path-wide
        self.last_access = 0
        self.hit_count = 0
        # hybrid pool: window page per device page (0: tombstone); None without device pages or a window component
        self.window_pages: np.ndarray | None = None
        # running requests whose window reaches into this node: its window pages are not evicted. Unlike
        # lock_ref it is not path-wide: a request locks just the nodes its window covers (whole nodes).
        self.window_lock_ref = 0
        # hybrid host tier: host window page per host page (0: none; the host keeps checkpoints' only)
        self.host_window_pages: np.ndarray | None = None

    @property
    def held_window_pages(self) -> int:
        """Window pages this node holds (not tombstoned)."""
        return int(np.count_nonzero(self.window_pages)) if self.window_pages is not None else 0

    @property
    def num_pages(self) -> int:
        return len(self.device_pages) if self.device_pages is not None else 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, tokens={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass
class MatchResult:
    """Result of :meth:`RadixCache.match_prefix`. Lengths are in tokens (whole pages)."""

    device_pages: np.ndarray  # L1 page ids of the device hit, in order
    device_hit_tokens: int  # = len(device_pages) * page_size
    last_device_node: TreeNode  # deepest node of the device hit (lock this one)
    host_hit_tokens: int  # tokens past the device hit found only in lower tiers
    last_node: TreeNode  # deepest matched node of any tier
    window_pages: np.ndarray | None = None  # hybrid: the device hit's window pages (0: tombstone)


@dataclass(frozen=True)
class PeekResult:
    """Result of :meth:`RadixCache.peek_prefix`: the lengths of :meth:`RadixCache.match_prefix`
    (tokens, whole pages) with the tree untouched. The match ends ``node_pages`` pages into
    ``node`` (None when nothing matched); that is inside ``node`` where match_prefix would
    have split it."""

    device_hit_tokens: int
    host_hit_tokens: int
    node: TreeNode | None
    node_pages: int


def check_nodes(nodes: Iterable[TreeNode], page_size: int) -> tuple[int, int, int, int]:
    """Assert every per-node invariant over ``nodes`` (a whole tree, roots included) and
    return the recounted (evictable device pages, locked device pages, host pages, window pages)."""
    evictable = protected = 0
    seen_pages: set[int] = set()
    seen_host: set[int] = set()
    seen_window: set[int] = set()
    seen_host_window: set[int] = set()
    for node in nodes:
        if node.is_root:
            continue
        _check_window(node, seen_window)
        if node.host_window_pages is not None:
            assert node.host_pages is not None and len(node.host_window_pages) == len(node.host_pages), \
                f"{node}: host window pages without host pages"
            for p in node.host_window_pages[node.host_window_pages != 0].tolist():
                assert p not in seen_host_window, f"{node}: host window page {p} shared"
                seen_host_window.add(p)
        assert len(node.key) > 0 and len(node.key) % page_size == 0, f"{node}: key not whole pages"
        if node.device_pages is not None:
            _check_pages(node, node.device_pages, seen_pages, page_size, "device")
            if node.lock_ref > 0:
                protected += node.num_pages
            else:
                evictable += node.num_pages
        else:
            assert node.host_pages is not None, f"{node}: in no tier"
            assert all(c.device_pages is None for c in node.children.values()), f"{node}: device below host-only"
        if node.host_pages is not None:
            _check_pages(node, node.host_pages, seen_host, page_size, "host")
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), f"{node}: lock below parent"
        assert node.host_ref >= sum(c.host_ref for c in node.children.values()), f"{node}: host ref below parent"
        if node.hash_values is not None:
            assert len(node.hash_values) * page_size == len(node.key), f"{node}: hashes do not cover key"
        assert node.parent.children.get(node.key[:page_size].tobytes()) is node, f"{node}: parent link broken"
    return evictable, protected, len(seen_host), len(seen_window)


def _check_window(node: TreeNode, seen: set[int]) -> None:
    """Window pages only beside device pages, one per page, none shared; a window lock only on a
    locked node (a request locks its whole path)."""
    assert node.window_lock_ref >= 0, f"{node}: negative window lock"
    assert node.window_lock_ref <= node.lock_ref, f"{node}: window locked by more requests than lock it"
    if node.window_pages is None:
        return
    assert node.device_pages is not None and len(node.window_pages) == len(node.device_pages), \
        f"{node}: window pages without device pages"
    for p in node.window_pages[node.window_pages != 0].tolist():
        assert p not in seen, f"{node}: window page {p} shared"
        seen.add(p)


def _check_pages(node: TreeNode, pages: np.ndarray, seen: set[int], page_size: int, tier: str) -> None:
    """One page id per key page; page 0 is reserved and no page is shared within a tier."""
    assert len(pages) * page_size == len(node.key), f"{node}: {tier} pages do not cover key"
    for p in pages.tolist():
        assert p != 0 and p not in seen, f"{node}: {tier} page {p} reserved or shared"
        seen.add(p)
