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

The tree's shape (split, walk, namespaces) is :class:`~.page_tree.PageTree`; device eviction is
:class:`~.leaf_eviction.LeafEviction`. This module is the contract on top: match / insert, lock
and host refs, and the page counters they keep. Components with page ids of their own (a hybrid
pool's window, :class:`~.window_tree.TreeWindows`) keep a handle per node and are told of every
change (:class:`~.tree_node.TreeComponent`): a match ends where every component can serve it.
"""

from __future__ import annotations

import bisect
import itertools

import numpy as np

from ..consensus_record import consensus_check
from .leaf_eviction import LeafEviction
from .page_tree import EMPTY_PAGES
from .tree_node import MatchResult, PeekResult, TreeNode, check_nodes
from .window_tree import TreeWindows


class RadixCache(LeafEviction):
    """The prefix index of every tier: match / insert / lock / evict over logical token pages.
    It keeps each node's tier state consistent; when to copy between tiers is the tiers' policy."""

    @property
    def windows(self) -> TreeWindows | None:
        """A hybrid pool's sliding-window component (:mod:`.window_tree`), once added; None without one."""
        return next((c for c in self.components if isinstance(c, TreeWindows)), None)

    # ---- the contract --------------------------------------------------------------------
    def _walk(self, namespace: str, tokens: np.ndarray, cut: bool = True) -> tuple[list[TreeNode], int, int, int]:
        """Read-only walk along the longest cached prefix of ``tokens``: the nodes passed (the
        last may match only in part), the tokens of the leading device run, the host-only tokens
        after it, and the tokens matched in the last node. Cut back to the last boundary every
        component can serve (a hybrid tree: whose window is held), unless ``cut`` is False (the
        components' state comes from elsewhere, e.g. a P/D transfer's window tail)."""
        node, path = self._roots.get(namespace), []
        device = host = pos = n = 0
        while node is not None and pos < len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            k = self._common_pages(child.key, tokens, pos)
            if child.device_pages is not None and host == 0:  # device hits are a leading run
                device += k
            elif child.host_pages is not None:
                host += k
            else:
                break
            path.append(child)
            node, pos, n = child, pos + k, k
            if k < len(child.key):  # the match ends inside this node
                break
        if cut and self.components:
            usable = min(c.usable(path, device, host) for c in self.components)
            if usable < device + host:  # the nodes that start before ``usable``, the last matched in part
                starts = [0, *itertools.accumulate(len(node.key) for node in path)]
                k = bisect.bisect_left(starts, usable, hi=len(path))
                path, n = path[:k], usable - starts[k - 1] if k else 0
                device, host = min(device, usable), max(0, usable - device)
        return path, device, host, n

    @consensus_check("tree.match_prefix", args=lambda self, ns, tokens, cut=True: (ns, len(tokens), cut),
                     result=lambda m: (m.device_hit_tokens, m.host_hit_tokens))
    def match_prefix(self, namespace: str, tokens, cut: bool = True) -> MatchResult:
        """Longest cached prefix of ``tokens`` (whole pages) in ``namespace`` that every component
        can serve (see :meth:`_walk`; ``cut`` False: as far as the full KV goes).

        Splits a node when the match ends inside it, so the returned node is an exact
        boundary that a request can lock. Updates recency and hit counts.
        """
        tokens = self._as_tokens(tokens)
        root = self._root(namespace)
        path, _, host_tokens, n = self._walk(namespace, tokens, cut)
        if path and n < len(path[-1].key):
            path[-1] = self.split(path[-1], n)
        # Touch after the split, so only the matched part gets the new recency / hit (touching
        # first also refreshed the unmatched lower half, skewing LRU and LFU).
        for node in path:
            self._touch(node)
        # the device hit is the leading run of nodes with device pages
        k = sum(1 for _ in itertools.takewhile(lambda m: m.device_pages is not None, path))
        pages = np.concatenate([m.device_pages for m in path[:k]]) if k else EMPTY_PAGES
        last_device = path[k - 1] if k else root
        return MatchResult(pages, len(pages) * self.page_size, last_device, host_tokens, path[-1] if path else root,
                           {c.name: c.hit_pages(path[:k]) for c in self.components})

    def peek_prefix(self, namespace: str, tokens, cut: bool = True) -> PeekResult:
        """:meth:`match_prefix`'s lengths without changing any state: no split, no hit count,
        no recency, no root created (a probe, e.g. for a prefetch, is not a hit)."""
        path, device, host, n = self._walk(namespace, self._as_tokens(tokens), cut)
        return PeekResult(device, host, path[-1] if path else None, n // self.page_size if path else 0)

    def node_at(self, namespace: str, tokens) -> TreeNode | None:
        """The node whose path ends exactly after ``tokens`` (whole pages), or None. Read-only:
        no split, no recency update."""
        tokens = self._as_tokens(tokens)
        path, device, host, n = self._walk(namespace, tokens, cut=False)
        if not path:
            return self._roots.get(namespace) if len(tokens) == 0 else None
        return path[-1] if device + host == len(tokens) and n == len(path[-1].key) else None

    def boundary_node(self, namespace: str, tokens, host: bool = False) -> TreeNode | None:
        """The node ending exactly after ``tokens`` (whole pages, all on the device; ``host``: in any
        tier), split there when a node runs past it; None when they are not all cached so. No recency
        or hit count."""
        tokens = self._as_tokens(tokens)
        path, device, in_host, n = self._walk(namespace, tokens, cut=False)
        if not path or device + (in_host if host else 0) < len(tokens):
            return None
        return path[-1] if n == len(path[-1].key) else self.split(path[-1], n)

    def insert(self, namespace: str, tokens, pages: np.ndarray, parts: dict[str, np.ndarray] | None = None) -> int:
        """Insert ``tokens`` (whole pages) whose KV lives in device ``pages`` (and, per component
        of the tree, its pages in ``parts[name]``: a hybrid tree's window pages, 0 where the caller
        holds none).

        Returns how many leading tokens were already cached on the device: the caller still
        owns ``pages`` for that span beyond what it had matched itself and must free those
        duplicates. The tree owns every page of the new suffix from now on, and every component
        page given: it keeps each where it holds none, and frees the duplicates.
        """
        tokens = self._as_tokens(tokens)
        pages = np.asarray(pages, dtype=np.int64)
        if len(pages) != len(tokens) // self.page_size:
            raise ValueError(f"insert of {len(tokens)} tokens needs {len(tokens) // self.page_size} pages, got {len(pages)}")
        parts = parts or {}
        for c in self.components:
            if parts.get(c.name) is None or len(parts[c.name]) != len(pages):
                raise ValueError(f"an insert into a tree with a {c.name} component needs a {c.name} page (or 0) per page")
        node, pos = self._root(namespace), 0
        on_device: int | None = None  # where the device-resident prefix ends
        while pos < len(tokens):
            child = self._child(node, tokens, pos)
            if child is None:  # the rest is a new leaf
                child = self._leaf(node, tokens[pos:])
            else:
                self._touch(child)  # after the split (see match_prefix)
            first, end = pos // self.page_size, (pos + len(child.key)) // self.page_size
            fresh = child.device_pages is None
            if fresh:
                # A new leaf, or a node whose device copy was evicted, adopts the caller's pages. Eviction
                # is leaf-first, so everything below it is device-less too: the device prefix ends here.
                child.device_pages = pages[first:end].copy()
                self._count(child, +1)
                on_device = pos if on_device is None else on_device
            for c in self.components:  # an old node's: fills its tombstones
                c.adopt(child, parts[c.name][first:end], fresh)
            node, pos = child, pos + len(child.key)
        return pos if on_device is None else on_device

    def insert_host(self, namespace: str, tokens, host_pages: np.ndarray, start_page: int,
                    hashes: list[bytes] | None = None) -> int:
        """Insert host-only pages fetched from storage: ``host_pages[i]`` holds page
        ``start_page + i`` of ``tokens`` (whole pages). Pages the tree already has, in any tier,
        are not taken. Returns the index into ``host_pages`` from which the tree took ownership
        (``len(host_pages)`` when it took none: the caller frees ``host_pages[:returned]``)."""
        tokens = self._as_tokens(tokens)
        node, pos = self._root(namespace), 0
        while pos < len(tokens):
            child = self._child(node, tokens, pos)
            if child is None:
                first = pos // self.page_size - start_page
                if first < 0:  # the prefix before the fetched pages is gone: nothing to hang them on
                    return len(host_pages)
                leaf = self._leaf(node, tokens[pos:])
                leaf.host_pages = np.asarray(host_pages[first:], dtype=np.int64).copy()
                if hashes is not None:
                    leaf.hash_values = list(hashes[first:])
                leaf.stored = True  # it came from storage
                self.host_pages_held += len(leaf.host_pages)
                return first
            node, pos = child, pos + len(child.key)
        return len(host_pages)

    # ---- refs and page accounting ------------------------------------------------------
    def _count(self, node: TreeNode, sign: int) -> None:
        """Add (``sign`` +1) or take (-1) ``node``'s device pages to or from the counter its lock puts them in."""
        if node.lock_ref > 0:
            self.protected_pages += sign * node.num_pages
        else:
            self.evictable_pages += sign * node.num_pages

    def inc_lock_ref(self, node: TreeNode) -> None:
        for n in node.lineage():
            self._count(n, -1)
            n.lock_ref += 1
            self._count(n, +1)

    def dec_lock_ref(self, node: TreeNode) -> None:
        for n in node.lineage():
            if n.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {n}")
            self._count(n, -1)
            n.lock_ref -= 1
            self._count(n, +1)

    def inc_host_ref(self, node: TreeNode) -> None:
        """Protect the host copies of ``node`` and its ancestors from L2 eviction."""
        for n in node.lineage():
            n.host_ref += 1

    def dec_host_ref(self, node: TreeNode) -> None:
        for n in node.lineage():
            if n.host_ref <= 0:
                raise RuntimeError(f"host unref of an unprotected node {n}")
            n.host_ref -= 1

    def attach_host_pages(self, node: TreeNode, host_pages: np.ndarray) -> None:
        """Record ``node``'s L2 copy (its backup is in flight while the node stays locked)."""
        assert node.host_pages is None and len(host_pages) * self.page_size == len(node.key)
        node.host_pages = host_pages
        self.host_pages_held += len(host_pages)
        for c in self.components:
            c.host_attached(node)

    def attach_device_pages(self, node: TreeNode, device_pages: np.ndarray) -> None:
        """Give a host-only node device pages (a load-back into them is in flight)."""
        assert node.device_pages is None and len(device_pages) * self.page_size == len(node.key)
        node.device_pages = device_pages
        for c in self.components:
            c.device_attached(node)
        self._count(node, +1)

    def reset(self) -> None:
        """Drop every node and return its device pages. Only valid when nothing is locked."""
        if self.protected_pages:
            raise RuntimeError(f"cannot reset the cache while {self.protected_pages} pages are locked")
        for node in self.all_nodes():
            if not node.is_root and node.device_pages is not None:
                self.drop_device(node)
            if not node.is_root and node.host_pages is not None:
                self.drop_host(node)
        self._roots.clear()
        self.retained.clear()
        if self.observer is not None:
            self.observer.on_reset()
        self.evictable_pages = 0  # (host_pages_held and each component's counters went down with the drops)

    # ---- introspection -------------------------------------------------------------------
    @property
    def cached_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    def check_invariants(self) -> None:
        """Recompute every counter from the nodes and compare; raise AssertionError on drift."""
        evictable, protected, host = check_nodes(self.all_nodes(), self.page_size)
        for c in self.components:
            c.check([n for n in self.all_nodes() if not n.is_root])
        assert evictable == self.evictable_pages, (evictable, self.evictable_pages)
        assert protected == self.protected_pages, (protected, self.protected_pages)
        assert host == self.host_pages_held, (host, self.host_pages_held)
