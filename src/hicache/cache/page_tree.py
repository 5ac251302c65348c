"""The shape of the prefix tree: token-id keys cut into whole pages, one root per namespace.

Units: keys and positions are in tokens, always a whole number of pages; a child is found by
its first page's bytes. Recency is a logical tick and node ids come from one counter, so the
tree's shape and order depend only on the operation sequence (DESIGN invariant 3). Which tier
holds a node's pages is :class:`~.radix.RadixCache`'s business; here a split only cuts every
tier's page list, and every component's handle, at the same place.
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional, Protocol

import numpy as np

from .tree_node import TreeComponent, TreeNode

EMPTY_PAGES = np.zeros(0, dtype=np.int64)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many first tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class TreeObserver(Protocol):
    """Told of every change of the tree's shape, as it happens (e.g. the token index behind
    NGRAM drafts, :mod:`.tree_tokens`)."""

    def on_leaf(self, node: TreeNode) -> None: ...  # a new leaf with its key

    def on_split(self, upper: TreeNode, node: TreeNode, at: int) -> None: ...  # node's first ``at`` tokens -> upper

    def on_delete(self, node: TreeNode) -> None: ...  # node left the tree (each node of a subtree is told)

    def on_reset(self) -> None: ...  # every node left the tree


class PageTree:
    """Namespaced roots and the structural steps of a page-granular radix tree: find a child,
    split a node at a page boundary, hang a new leaf, walk all nodes."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._ids = itertools.count()
        self._tick = 0
        self._roots: dict[str, TreeNode] = {}
        self.observer: Optional[TreeObserver] = None
        self.components: list[TreeComponent] = []  # each node holds one handle per component, in this order
        self.retained: set[TreeNode] = set()  # nodes with a retention granted (cache/retention.py), expired or not

    def add_component(self, component: TreeComponent) -> None:
        """Register ``component`` (before any node exists): every node gets its handle."""
        assert not self._roots, "components are registered before the tree has nodes"
        component.index = len(self.components)
        self.components.append(component)

    def _node(self, namespace: str, key: np.ndarray, parent: TreeNode | None) -> TreeNode:
        return TreeNode(next(self._ids), namespace, key, parent, tuple(c.new_part() for c in self.components))

    def _root(self, namespace: str) -> TreeNode:
        """``namespace``'s root, created on first use (locked: roots are never evicted)."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._node(namespace, np.zeros(0, dtype=np.int32), None)
            root.device_pages = EMPTY_PAGES
            root.lock_ref = 1  # roots are never evicted
            self._roots[namespace] = root
        return root

    def _page_key(self, tokens: np.ndarray, start: int) -> bytes:
        return tokens[start : start + self.page_size].tobytes()

    def _common_pages(self, key: np.ndarray, tokens: np.ndarray, start: int) -> int:
        """Whole pages of ``key`` that equal ``tokens[start:]``, in tokens."""
        same = common_prefix(key, tokens[start:])
        return same - same % self.page_size

    def _touch(self, node: TreeNode) -> None:
        self._tick += 1
        node.last_access = self._tick
        node.hit_count += 1

    def split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` tokens (whole pages); return the new upper part."""
        pages_at = at // self.page_size
        upper = self._node(node.namespace, node.key[:at], node.parent)
        upper.lock_ref, upper.host_ref, upper.stored = node.lock_ref, node.host_ref, node.stored
        upper.last_access, upper.hit_count = node.last_access, node.hit_count
        # the upper part is a prefix of the node: retained at least as long (its retention is the node's)
        upper.retain_until, upper.retain_priority, upper.retain_level = \
            node.retain_until, node.retain_priority, node.retain_level
        if node in self.retained:
            self.retained.add(upper)
        for component in self.components:
            component.split(upper, node, pages_at)
        for tier in ("device_pages", "host_pages", "hash_values"):  # one entry per key page, where held
            if (pages := getattr(node, tier)) is not None:
                setattr(upper, tier, pages[:pages_at])
                setattr(node, tier, pages[pages_at:])
        node.parent.children[self._page_key(upper.key, 0)] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[self._page_key(node.key, 0)] = node
        if self.observer is not None:
            self.observer.on_split(upper, node, at)
        return upper

    def _child(self, node: TreeNode, tokens: np.ndarray, pos: int) -> TreeNode | None:
        """The child of ``node`` that ``tokens[pos:]`` enters, cut to their common pages; None
        when no child shares the first page."""
        child = node.children.get(self._page_key(tokens, pos))
        if child is not None and (n := self._common_pages(child.key, tokens, pos)) < len(child.key):
            child = self.split(child, n)
        return child

    def _leaf(self, parent: TreeNode, key: np.ndarray) -> TreeNode:
        """A new (touched) leaf below ``parent``; the caller gives it its tier's pages."""
        leaf = self._node(parent.namespace, key.copy(), parent)
        self._touch(leaf)
        parent.children[self._page_key(leaf.key, 0)] = leaf
        if self.observer is not None:
            self.observer.on_leaf(leaf)
        return leaf

    def _as_tokens(self, tokens) -> np.ndarray:
        """``tokens`` as int32, cut to whole pages."""
        arr = np.asarray(tokens, dtype=np.int32)
        return arr[: len(arr) - len(arr) % self.page_size]

    def key_pages(self, node: TreeNode) -> int:
        """``node``'s length in pages, whichever tiers hold it (``num_pages`` counts device pages)."""
        return len(node.key) // self.page_size

    def roots(self) -> list[TreeNode]:
        return list(self._roots.values())

    def all_nodes(self, top: TreeNode | None = None) -> Iterator[TreeNode]:
        """Every node of every namespace, roots included (``top``: of its subtree, itself included)."""
        stack = list(self._roots.values()) if top is None else [top]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def num_nodes(self) -> int:
        return sum(1 for n in self.all_nodes() if not n.is_root)
