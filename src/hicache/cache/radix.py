"""Page-granular radix tree over token ids: the logical index of every cache tier.

Invariants (checked by :meth:`RadixCache.check_invariants`):

* Every node key is a whole number of pages; a child is found by its first page's bytes.
* A node's ``device_pages`` (L1 page ids, one per key page) is either complete or None (the
  node's device copy was evicted; later tiers keep ``host_pages`` / ``hash_values``).
* ``lock_ref`` counts running requests whose matched path passes through the node; a locked
  node is never evicted. A lock on a node also locks every ancestor.
* Page accounting: device pages held by the tree = ``evictable_pages`` (unlocked) +
  ``protected_pages`` (locked). With the allocator's free pages and the pages that requests own
  outside the tree, they add up to the pool's capacity.
* Decisions depend only on the operation sequence: recency is a logical tick, not wall time,
  and ties break by node id, so ranks replaying the same operations agree (DESIGN invariant 3).

Keys carry a namespace (model identity, ``cache_salt``, ...): each namespace has its own root,
so different namespaces never share nodes.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..consensus_record import consensus_check
from .pools import PageAllocator

logger = logging.getLogger(__name__)

_EMPTY_PAGES = np.zeros(0, dtype=np.int64)


class TreeNode:
    """One edge of the tree: ``key`` tokens and where their KV lives in each tier."""

    __slots__ = (
        "id", "namespace", "key", "parent", "children", "device_pages", "host_pages",
        "hash_values", "stored", "lock_ref", "host_ref", "last_access", "hit_count",
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


class RadixCache:
    """The L1 prefix cache: match / insert / lock / evict over logical token pages."""

    def __init__(
        self,
        page_size: int,
        allocator: PageAllocator,
        eviction_policy: str = "lru",
        host_allocator: PageAllocator | None = None,
    ) -> None:
        if eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction policy {eviction_policy!r}")
        self.page_size = page_size
        self.allocator = allocator
        self.host_allocator = host_allocator  # L2 pages; None without a host tier
        self.eviction_policy = eviction_policy
        # Called for an L1 victim that has no host copy yet; returns True once it has one
        # (write_back). Without it such a victim is dropped.
        self.backup_on_evict: Callable[[TreeNode], bool] | None = None
        self.host_pages_held = 0
        self.evicted_host_pages_total = 0
        self._ids = itertools.count()
        self._tick = 0
        self._roots: dict[str, TreeNode] = {}
        self.evictable_pages = 0
        self.protected_pages = 0
        self.evicted_pages_total = 0

    # ---- helpers -------------------------------------------------------------------------
    def _root(self, namespace: str) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = TreeNode(next(self._ids), namespace, np.zeros(0, dtype=np.int32), None)
            root.device_pages = _EMPTY_PAGES
            root.lock_ref = 1  # roots are never evicted
            self._roots[namespace] = root
        return root

    def _page_key(self, tokens: np.ndarray, start: int) -> bytes:
        return tokens[start : start + self.page_size].tobytes()

    def _common_pages(self, key: np.ndarray, tokens: np.ndarray, start: int) -> int:
        """Whole pages of ``key`` that equal ``tokens[start:]``, in tokens."""
        n = min(len(key), len(tokens) - start)
        diff = np.flatnonzero(key[:n] != tokens[start : start + n])
        same = int(diff[0]) if len(diff) else n
        return same - same % self.page_size

    def _touch(self, node: TreeNode) -> None:
        self._tick += 1
        node.last_access = self._tick
        node.hit_count += 1

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` tokens (whole pages); return the new upper part."""
        pages_at = at // self.page_size
        upper = TreeNode(next(self._ids), node.namespace, node.key[:at], node.parent)
        upper.lock_ref, upper.host_ref, upper.stored = node.lock_ref, node.host_ref, node.stored
        upper.last_access, upper.hit_count = node.last_access, node.hit_count
        if node.device_pages is not None:
            upper.device_pages, node.device_pages = node.device_pages[:pages_at], node.device_pages[pages_at:]
        if node.host_pages is not None:
            upper.host_pages, node.host_pages = node.host_pages[:pages_at], node.host_pages[pages_at:]
        if node.hash_values is not None:
            upper.hash_values, node.hash_values = node.hash_values[:pages_at], node.hash_values[pages_at:]
        node.parent.children[self._page_key(upper.key, 0)] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[self._page_key(node.key, 0)] = node
        return upper

    def _as_tokens(self, tokens) -> np.ndarray:
        arr = np.asarray(tokens, dtype=np.int32)
        return arr[: len(arr) - len(arr) % self.page_size]

    # ---- the contract --------------------------------------------------------------------
    @consensus_check("tree.match_prefix", args=lambda self, ns, tokens: (ns, len(tokens)),
                     result=lambda m: (m.device_hit_tokens, m.host_hit_tokens))
    def match_prefix(self, namespace: str, tokens) -> MatchResult:
        """Longest cached prefix of ``tokens`` (whole pages) in ``namespace``.

        Splits a node when the match ends inside it, so the returned node is an exact
        boundary that a request can lock. Updates recency and hit counts.
        """
        tokens = self._as_tokens(tokens)
        node = self._root(namespace)
        last_device = node
        device: list[np.ndarray] = []
        host_tokens = 0
        pos = 0
        while pos < len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            # Fix: touch after the split, so only the matched part gets the new recency / hit
            # (touching first also refreshed the unmatched lower half, skewing LRU and LFU).
            self._touch(child)
            if child.device_pages is not None and last_device is node:
                device.append(child.device_pages)
                last_device = child
            elif child.host_pages is not None:
                host_tokens += n
            else:
                break
            node = child
            pos += n
        pages = np.concatenate(device) if device else _EMPTY_PAGES
        return MatchResult(pages, len(pages) * self.page_size, last_device, host_tokens, node)

    def peek_prefix(self, namespace: str, tokens) -> PeekResult:
        """:meth:`match_prefix`'s lengths without changing any state: no split, no hit count,
        no recency, no root created (a probe, e.g. for a prefetch, is not a hit)."""
        tokens = self._as_tokens(tokens)
        parent, node = self._roots.get(namespace), None
        device = host = pages = pos = 0
        while parent is not None and pos < len(tokens):
            child = parent.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos)
            if child.device_pages is not None and host == 0:  # device hits are a leading run
                device += n
            elif child.host_pages is not None:
                host += n
            else:
                break
            parent = node = child
            pages, pos = n // self.page_size, pos + n
            if n < len(child.key):  # the match ends inside this node
                break
        return PeekResult(device, host, node, pages)

    def insert(self, namespace: str, tokens, pages: np.ndarray) -> int:
        """Insert ``tokens`` (whole pages) whose KV lives in device ``pages``.

        Returns how many leading tokens were already cached on the device: the caller still
        owns ``pages`` for that span beyond what it had matched itself and must free those
        duplicates. The tree owns every page of the new suffix from now on.
        """
        tokens = self._as_tokens(tokens)
        pages = np.asarray(pages, dtype=np.int64)
        if len(pages) != len(tokens) // self.page_size:
            raise ValueError(f"insert of {len(tokens)} tokens needs {len(tokens) // self.page_size} pages, got {len(pages)}")
        node = self._root(namespace)
        pos = 0
        on_device: int | None = None  # where the device-resident prefix ends
        while pos < len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                leaf = TreeNode(next(self._ids), namespace, tokens[pos:].copy(), node)
                leaf.device_pages = pages[pos // self.page_size :].copy()
                self._touch(leaf)
                node.children[self._page_key(leaf.key, 0)] = leaf
                self.evictable_pages += leaf.num_pages
                return pos if on_device is None else on_device
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            self._touch(child)  # Fix: after the split (see match_prefix)
            if child.device_pages is None:
                # A node whose device copy was evicted adopts the caller's pages. Eviction is
                # leaf-first, so everything below it is device-less too: the device prefix ends here.
                child.device_pages = pages[pos // self.page_size : (pos + n) // self.page_size].copy()
                self._count(child, +1)
                if on_device is None:
                    on_device = pos
            node = child
            pos += n
        return pos if on_device is None else on_device

    def node_at(self, namespace: str, tokens) -> TreeNode | None:
        """The node whose path ends exactly after ``tokens`` (whole pages), or None. Read-only:
        no split, no recency update."""
        tokens = self._as_tokens(tokens)
        node = self._roots.get(namespace)
        pos = 0
        while node is not None and pos < len(tokens):
            node = node.children.get(self._page_key(tokens, pos))
            if node is None or self._common_pages(node.key, tokens, pos) != len(node.key):
                return None
            pos += len(node.key)
        return node

    def _count(self, node: TreeNode, sign: int) -> None:
        if node.lock_ref > 0:
            self.protected_pages += sign * node.num_pages
        else:
            self.evictable_pages += sign * node.num_pages

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref == 0:
                self.evictable_pages -= node.num_pages
                self.protected_pages += node.num_pages
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not None and not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_pages -= node.num_pages
                self.evictable_pages += node.num_pages
            node = node.parent

    def inc_host_ref(self, node: TreeNode) -> None:
        """Protect the host copies of ``node`` and its ancestors from L2 eviction."""
        while node is not None and not node.is_root:
            node.host_ref += 1
            node = node.parent

    def dec_host_ref(self, node: TreeNode) -> None:
        while node is not None and not node.is_root:
            if node.host_ref <= 0:
                raise RuntimeError(f"host unref of an unprotected node {node}")
            node.host_ref -= 1
            node = node.parent

    def insert_host(self, namespace: str, tokens, host_pages: np.ndarray, start_page: int,
                    hashes: list[bytes] | None = None) -> int:
        """Insert host-only pages fetched from storage: ``host_pages[i]`` holds page
        ``start_page + i`` of ``tokens`` (whole pages). Pages the tree already has, in any tier,
        are not taken. Returns the index into ``host_pages`` from which the tree took ownership
        (``len(host_pages)`` when it took none: the caller frees ``host_pages[:returned]``)."""
        tokens = self._as_tokens(tokens)
        node = self._root(namespace)
        pos = 0
        while pos < len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                first = pos // self.page_size - start_page
                if first < 0:  # the prefix before the fetched pages is gone: nothing to hang them on
                    return len(host_pages)
                leaf = TreeNode(next(self._ids), namespace, tokens[pos:].copy(), node)
                leaf.host_pages = np.asarray(host_pages[first:], dtype=np.int64).copy()
                if hashes is not None:
                    leaf.hash_values = list(hashes[first:])
                leaf.stored = True  # it came from storage
                self._touch(leaf)
                node.children[self._page_key(leaf.key, 0)] = leaf
                self.host_pages_held += len(leaf.host_pages)
                return first
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            node = child
            pos += n
        return len(host_pages)

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

    @consensus_check("tree.evict", args=lambda self, num_pages: num_pages, result=lambda freed: freed)
    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` device pages from unlocked leaves, least valuable first
        (policy order). A victim with a host copy stays in the tree as host-only; one without
        is dropped (with any host-only nodes below it). Returns the pages freed (fewer when too
        little is evictable)."""
        heap = [(self._eviction_key(n), n) for n in self._all_nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, node = heapq.heappop(heap)
            if node.host_pages is None and self.backup_on_evict is not None:
                self.backup_on_evict(node)
            freed += node.num_pages
            self.evictable_pages -= node.num_pages
            self.allocator.free(node.device_pages)
            node.device_pages = None
            parent = node.parent
            if node.host_pages is None:
                self._delete_subtree(node)
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (self._eviction_key(parent), parent))
        self.evicted_pages_total += freed
        if freed:
            logger.debug("evicted %d device pages", freed)
        return freed

    def evict_host(self, num_pages: int) -> int:
        """Free at least ``num_pages`` host pages by deleting unlocked host-only leaves in
        policy order. Returns the host pages freed."""
        heap = [(self._eviction_key(n), n) for n in self._all_nodes() if self._host_evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, node = heapq.heappop(heap)
            parent = node.parent
            freed += len(node.host_pages)
            self._delete_subtree(node)
            if self._host_evictable_leaf(parent):
                heapq.heappush(heap, (self._eviction_key(parent), parent))
        self.evicted_host_pages_total += freed
        return freed

    def _host_evictable_leaf(self, node: TreeNode) -> bool:
        return (not node.is_root and node.lock_ref == 0 and node.host_ref == 0 and node.device_pages is None
                and node.host_pages is not None and not node.children)

    def _delete_subtree(self, node: TreeNode) -> None:
        """Unlink ``node``; free the host pages of it and everything below (none is on device)."""
        del node.parent.children[self._page_key(node.key, 0)]
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.device_pages is None and n.lock_ref == 0 and n.host_ref == 0, f"{n}: deleting live data"
            if n.host_pages is not None:
                self.host_allocator.free(n.host_pages)
                self.host_pages_held -= len(n.host_pages)
                n.host_pages = None
            stack.extend(n.children.values())

    def attach_host_pages(self, node: TreeNode, host_pages: np.ndarray) -> None:
        """Record ``node``'s L2 copy (its backup is in flight while the node stays locked)."""
        assert node.host_pages is None and len(host_pages) * self.page_size == len(node.key)
        node.host_pages = host_pages
        self.host_pages_held += len(host_pages)

    def attach_device_pages(self, node: TreeNode, device_pages: np.ndarray) -> None:
        """Give a host-only node device pages (a load-back into them is in flight)."""
        assert node.device_pages is None and len(device_pages) * self.page_size == len(node.key)
        node.device_pages = device_pages
        self._count(node, +1)

    def reset(self) -> None:
        """Drop every node and return its device pages. Only valid when nothing is locked."""
        if self.protected_pages:
            raise RuntimeError(f"cannot reset the cache while {self.protected_pages} pages are locked")
        for node in self._all_nodes():
            if not node.is_root and node.device_pages is not None:
                self.allocator.free(node.device_pages)
            if not node.is_root and node.host_pages is not None:
                self.host_allocator.free(node.host_pages)
        self._roots.clear()
        self.evictable_pages = 0
        self.host_pages_held = 0

    # ---- introspection -------------------------------------------------------------------
    @property
    def cached_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    def _all_nodes(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def num_nodes(self) -> int:
        return sum(1 for n in self._all_nodes() if not n.is_root)

    def check_invariants(self) -> None:
        """Recompute every counter from the nodes and compare; raise AssertionError on drift."""
        evictable = protected = 0
        seen_pages: set[int] = set()
        seen_host: set[int] = set()
        for node in self._all_nodes():
            if node.is_root:
                continue
            assert len(node.key) > 0 and len(node.key) % self.page_size == 0, f"{node}: key not whole pages"
            if node.device_pages is not None:
                assert len(node.device_pages) * self.page_size == len(node.key), f"{node}: pages do not cover key"
                for p in node.device_pages.tolist():
                    assert p != 0 and p not in seen_pages, f"{node}: page {p} reserved or shared"
                    seen_pages.add(p)
                if node.lock_ref > 0:
                    protected += node.num_pages
                else:
                    evictable += node.num_pages
            else:
                assert node.host_pages is not None, f"{node}: in no tier"
                assert all(c.device_pages is None for c in node.children.values()), f"{node}: device below host-only"
            if node.host_pages is not None:
                assert len(node.host_pages) * self.page_size == len(node.key), f"{node}: host pages do not cover key"
                for p in node.host_pages.tolist():
                    assert p != 0 and p not in seen_host, f"{node}: host page {p} reserved or shared"
                    seen_host.add(p)
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), f"{node}: lock below parent"
            assert node.host_ref >= sum(c.host_ref for c in node.children.values()), f"{node}: host ref below parent"
            if node.hash_values is not None:
                assert len(node.hash_values) * self.page_size == len(node.key), f"{node}: hashes do not cover key"
            assert node.parent.children.get(self._page_key(node.key, 0)) is node, f"{node}: parent link broken"
        assert evictable == self.evictable_pages, (evictable, self.evictable_pages)
        assert protected == self.protected_pages, (protected, self.protected_pages)
        assert len(seen_host) == self.host_pages_held, (len(seen_host), self.host_pages_held)
