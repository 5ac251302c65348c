"""The radix tree's node and the results of its walks: per-node state of every tier.

Units: ``key`` is token ids, always whole pages; ``device_pages`` / ``host_pages`` are logical
page ids of the L1 / L2 pool, one per key page (the full KV, and every component that shares its
page ids); ``hash_values`` one chained hash per key page. A component with page ids of its own (a
hybrid pool's sliding window, :mod:`.window_tree`) keeps its state on a node in ``parts``, one
handle per :class:`TreeComponent` of the tree.
The tree (:mod:`.radix`) keeps the invariants between these fields; tiers only read them and
change them through the tree and its components.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Protocol

import numpy as np


@dataclass(slots=True, eq=False)  # eq=False: nodes hash by identity (dict keys, heap entries)
class TreeNode:
    """One edge of the tree: ``key`` tokens and where their KV lives in each tier."""

    id: int
    namespace: str
    key: np.ndarray  # int32 token ids, len = num_pages * page_size
    parent: TreeNode | None
    parts: tuple = ()  # one handle per component of the tree (TreeComponent.index)
    children: dict[bytes, TreeNode] = field(default_factory=dict)
    device_pages: np.ndarray | None = None  # L1 page ids
    host_pages: np.ndarray | None = None  # L2 page ids (hierarchical cache)
    hash_values: list[bytes] | None = None  # per-page chained hashes (storage tier)
    stored: bool = False  # a storage backup of this node's pages was issued (L3)
    lock_ref: int = 0
    host_ref: int = 0  # in-flight reads of the host copy (storage backups); like lock_ref, path-wide
    last_access: int = 0
    hit_count: int = 0
    # A client's retention hint granted here (:mod:`.retention`): kept until ``retain_until`` (unix s, the
    # tree's retention clock) in tier ``retain_level`` (0 device, 1 host, 2 storage) and every tier below,
    # evicted from them only after every unretained leaf; a higher ``retain_priority`` goes later.
    retain_until: float = 0.0
    retain_priority: int = 0
    retain_level: int = 0

    @property
    def num_pages(self) -> int:
        return len(self.device_pages) if self.device_pages is not None else 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def lineage(self) -> Iterator[TreeNode]:
        """This node and its ancestors, nearest first, the root left out."""
        node = self
        while not node.is_root:
            yield node
            node = node.parent

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
    parts: dict[str, np.ndarray] | None = None  # per component of the tree, its pages of the device hit


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


def check_nodes(nodes: Iterable[TreeNode], page_size: int) -> tuple[int, int, int]:
    """Assert every per-node invariant of the full KV over ``nodes`` (a whole tree, roots included)
    and return the recounted (evictable device pages, locked device pages, host pages)."""
    evictable = protected = 0
    seen_pages: set[int] = set()
    seen_host: set[int] = set()
    for node in nodes:
        if node.is_root:
            continue
        assert node.lock_ref >= 0 and node.host_ref >= 0, f"{node}: negative ref"
        assert len(node.key) > 0 and len(node.key) % page_size == 0, f"{node}: key not whole pages"
        if node.device_pages is not None:
            check_pages(node, node.device_pages, seen_pages, len(node.key) // page_size, "device")
            if node.lock_ref > 0:
                protected += node.num_pages
            else:
                evictable += node.num_pages
        else:
            assert node.host_pages is not None, f"{node}: in no tier"
            assert all(c.device_pages is None for c in node.children.values()), f"{node}: device below host-only"
        if node.host_pages is not None:
            check_pages(node, node.host_pages, seen_host, len(node.key) // page_size, "host")
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), f"{node}: lock below parent"
        assert node.host_ref >= sum(c.host_ref for c in node.children.values()), f"{node}: host ref below parent"
        if node.hash_values is not None:
            assert len(node.hash_values) * page_size == len(node.key), f"{node}: hashes do not cover key"
        assert node.parent.children.get(node.key[:page_size].tobytes()) is node, f"{node}: parent link broken"
    return evictable, protected, len(seen_host)


def check_pages(node: TreeNode, pages: np.ndarray, seen: set[int], count: int, what: str, holes: bool = False) -> None:
    """``count`` page ids (one per page of the node), none shared within a tier (``seen``: its pages so far);
    page 0 is reserved (``holes``: it marks a page held by none, a window's tombstone)."""
    assert len(pages) == count, f"{node}: {what} pages do not cover its pages"
    for p in (pages[pages != 0] if holes else pages).tolist():
        assert p != 0 and p not in seen, f"{node}: {what} page {p} reserved or shared"
        seen.add(p)


class TreeComponent(Protocol):
    """A component with page ids of its own on the tree's nodes (``node.parts[index]``: its handle
    there). The tree calls these hooks as it changes, so matching, splitting, eviction and checks
    are written once for any component; tiers change a component's handles through its methods."""

    name: str
    index: int  # its handle's place in ``TreeNode.parts``

    def new_part(self) -> Any: ...  # a node's empty handle

    def split(self, upper: TreeNode, node: TreeNode, pages: int) -> None: ...  # node's first pages -> upper

    def usable(self, path: list[TreeNode], device_tokens: int, host_tokens: int) -> int: ...  # a match's usable tokens

    def adopt(self, node: TreeNode, offered: np.ndarray, fresh: bool) -> None: ...  # an insert's pages

    def hit_pages(self, nodes: list[TreeNode]) -> np.ndarray: ...  # its pages of a device hit along ``nodes``

    def device_attached(self, node: TreeNode) -> None: ...  # a host-only node got device pages

    def host_attached(self, node: TreeNode) -> None: ...  # a node got its host copy's pages

    def drop_device(self, node: TreeNode) -> None: ...  # the node's device copy goes

    def drop_host(self, node: TreeNode) -> None: ...  # the node's host copy goes

    def victim_rank(self, node: TreeNode) -> tuple: ...  # device eviction: order before the policy's key

    def check(self, nodes: list[TreeNode]) -> None: ...  # assert its per-node invariants and counters
