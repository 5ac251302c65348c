"""The host tier (L2): write policy, device<->host copies, their acks, host eviction.

A node gets a host copy by its write policy: ``write_through`` on insert, ``write_through_
selective`` on its Nth hit, ``write_back`` only when the device evicts it. A backup locks its
node until the ack is consumed; a load-back (host hit at admission) locks the deepest loaded
node until its ack is consumed. A consumed backup ack tells the tier below (storage) that the
node now has a host copy. Host eviction deletes unlocked, unprotected host-only leaves.

Units: page ids and counts are logical pages of the host pool unless named ``dev``; a host
page mirrors one device page (same page size). Invariant: transfers are queued during a step
and submitted once per step, one op per direction, in queue order.

A hybrid pool (:mod:`.device_window`) keeps host window pages for the window of a backed-up node's
end boundary only, the checkpoint a next turn needs; a load-back brings the window pages the hit's
window reads with the rest. Over a fixed split they are a second host pool (``window_host``, page
ids of its own); over shared device blocks (issue 56) one block per sliding group of the same host
pool the full pages take theirs from, so eviction makes room for either kind from one budget
(:meth:`HostTier.make_room`).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np

from .acks import AckCounts
from .host_pool import HostKVPool
from .host_transfer import BACKUP, LOAD, TransferController, TransferOp
from .placement import ShardedPageAllocator, ShardView, alloc_evicting
from .pools import DeviceKVPool, PageAllocator, SharedWindowAllocator
from .radix import RadixCache
from .tiers import CachePolicy, CacheStats, Tier
from .tree_node import TreeNode

logger = logging.getLogger(__name__)

EMPTY = np.zeros(0, dtype=np.int64)

# One queued copy: device pages, host pages, device and host window pages (a hybrid pool's), and the
# node to unlock when its ack is consumed.
_Item = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, TreeNode | None]


class HostTier:
    """Implements :class:`~.tiers.Tier` below the device; ``lower`` is the storage tier."""

    def __init__(self, pool: DeviceKVPool, host_pool: HostKVPool, allocator: PageAllocator | ShardedPageAllocator,
                 tree: RadixCache | None, policy: CachePolicy, stats: CacheStats, shard: ShardView | None = None,
                 sidecars: Sequence[tuple[DeviceKVPool, HostKVPool]] = ()) -> None:
        """``policy``: its write policy and threshold. ``shard``: device and host pages are sharded (this rank's view); host pages follow the
        owner rotation of their positions like device pages, so each rank copies its own.
        ``sidecars``: (device, host) pools of KV on the same page ids (a speculative draft's),
        copied with every page (see :class:`TransferController`)."""
        self.pool, self.host_pool, self.allocator, self.tree, self.stats = pool, host_pool, allocator, tree, stats
        self.shard = shard
        window_host = host_pool.window_pool
        self.controller = TransferController(pool, host_pool, shard, sidecars, window_host)
        self.bytes_per_page = host_pool.bytes_per_page + sum(dev.bytes_per_page for dev, _ in sidecars)
        self.window_host = window_host
        # shared blocks: full pages and window pages (one block per sliding group each) from one allocator
        self.shared = host_pool.shared
        self.window_allocator: PageAllocator | SharedWindowAllocator | None = \
            SharedWindowAllocator(allocator, host_pool.window_blocks) if self.shared else \
            PageAllocator(window_host.num_pages) if window_host is not None else None
        self.cached = tree.windows if tree is not None and window_host is not None else None  # TreeWindows
        if self.cached is not None:
            self.cached.attach_host_allocator(self.window_allocator)
        # Hits a node needs before it is backed up (write_back: only at eviction).
        self.backup_threshold = {"write_through": 1, "write_through_selective": policy.write_through_threshold,
                                 "write_back": None}[policy.write_policy]
        if tree is not None and policy.write_policy == "write_back":
            tree.backup_on_evict = self.on_evict
        self.lower: Tier | None = None
        self._pending: dict[str, list[_Item]] = {BACKUP: [], LOAD: []}
        # hybrid: the window span each in-flight backup window-locks (its device window pages must not be
        # tombstoned and reused before the copy reads them), by node
        self._backup_spans: dict[TreeNode, tuple[int, int]] = {}
        # hybrid: backed-up nodes whose checkpoint supersedes their ancestors' host windows (_drop_superseded)
        self._superseding: list[TreeNode] = []

    # ---- write policy --------------------------------------------------------------------
    def on_insert(self, node: TreeNode | None) -> None:
        """Queue a backup of every node on the path to ``node`` that the write policy says
        should have a host copy and has none yet. Each is locked until its ack is consumed."""
        if self.backup_threshold is None or node is None:
            return
        path = []
        while not node.is_root:
            if node.host_pages is None and node.device_pages is not None and node.hit_count >= self.backup_threshold:
                path.append(node)
            node = node.parent
        for n in reversed(path):
            host = self.alloc(n.num_pages, self._anchor_like(n.device_pages))
            if host is None:
                self.stats.backup_skipped_pages += n.num_pages
                continue
            self.tree.attach_host_pages(n, host)
            self.tree.inc_lock_ref(n)
            window = self._backup_windows(n)
            if len(window[0]):  # the whole node: a lock from inside it would split it under this backup
                end = self.cached.checkpoint_span(n)[0]
                span = self._backup_spans[n] = (end, end - n.num_pages)
                self.cached.lock(n, *span)
            self._pending[BACKUP].append((n.device_pages, host, *window, n))

    def on_evict(self, node: TreeNode) -> bool:
        """write_back: copy an L1 victim to host before its device pages are freed."""
        host = self.alloc(node.num_pages, self._anchor_like(node.device_pages))
        if host is None:
            self.stats.backup_skipped_pages += node.num_pages
            return False
        self.tree.attach_host_pages(node, host)
        op = self.controller.submit(BACKUP, node.device_pages, host, [], self._backup_windows(node))
        op.done.wait()
        return True

    def _backup_windows(self, node: TreeNode) -> tuple[np.ndarray, np.ndarray]:
        """Hybrid: host window pages for ``node``'s checkpoint (the window of its end boundary,
        where the device holds it); the (device, host) window pages to copy. Without room (after
        evicting host leaves) the host copy keeps tombstones there."""
        if self.window_host is None:
            return EMPTY, EMPTY
        idx = self.cached.checkpoint_pages(node)
        host, _ = alloc_evicting(self.window_allocator, len(idx), 0, self.evict_for_windows) if len(idx) \
            else (EMPTY, 0)
        if host is None:
            self.stats.backup_skipped_window_pages += len(idx)
            idx, host = EMPTY, EMPTY
        self.cached.attach_host(node, idx, host)
        return self.cached.of(node).device[idx], host

    def _drop_superseded(self) -> None:
        """Nodes whose checkpoint window reached the host: free the host window pages of the
        ancestors' checkpoints each supersedes (their conversation went on; no hit starts there),
        once no load may be reading them and storage is not writing them (else at a later ack)."""
        if self.controller.pending(LOAD) or self._pending[LOAD]:
            return
        later = []
        for node in self._superseding:
            pairs = self.cached.superseded(node) if self.cached.of(node).host is not None else []
            if any(anc.host_ref for anc, _ in pairs):
                later.append(node)
                continue
            for anc, idx in pairs:
                self.stats.superseded_host_window_pages += self.cached.free_host(anc, idx)
        self._superseding = later

    def evict_for_windows(self, num_pages: int) -> int:
        """Delete host-only leaves holding window pages until ``num_pages`` of those are free (shared
        blocks: until the blocks of ``num_pages`` window pages are, see :meth:`make_room`)."""
        if self.shared:
            return self.make_room(num_pages * self.window_allocator.groups) // self.window_allocator.groups
        def take(node: TreeNode) -> int:
            freed = self.cached.of(node).host_held
            self.stats.evicted_host_pages += self._drop(node)
            return freed
        return self.tree.evict_leaves(num_pages, lambda n: _host_evictable_leaf(n) and self.cached.of(n).host_held > 0,
                                      take)

    def make_room(self, blocks: int) -> int:
        """Shared blocks: free at least ``blocks`` blocks if the tree can: the window pages of superseded
        checkpoints first (:meth:`_drop_superseded`, once no load may read them), then host-only
        leaves in policy order, each with its full pages and window pages. Returns the blocks freed."""
        start = self.allocator.available
        self._drop_superseded()
        short = blocks - (self.allocator.available - start)
        if short > 0:
            self.tree.evict_leaves(short, _host_evictable_leaf, self._drop_blocks)
        return self.allocator.available - start

    def _drop_blocks(self, node: TreeNode) -> int:
        """Delete a host-only leaf of a shared pool; the blocks its full and window pages held."""
        windows = self.cached.of(node).host_held
        pages = self._drop(node)
        self.stats.evicted_host_pages += pages
        return pages + windows * self.window_allocator.groups

    def load_back(self, nodes: list[TreeNode], windows: bool = True,
                  device_hit_windows: list[tuple[np.ndarray, np.ndarray]] = ()) -> None:
        """Queue host->device copies into the device pages ``nodes`` (a path, in order) were
        just given; the deepest stays locked until the load's ack is consumed (its payload).
        ``windows`` False: a hybrid hit's window pages arrive otherwise (P/D), full layers only.
        ``device_hit_windows``: (device, host) window pages of the device hit's tombstones whose
        host copy holds them (the request's window lock keeps them)."""
        for device_window, host_window in device_hit_windows:
            self._pending[LOAD].append((EMPTY, EMPTY, device_window, host_window, None))
        for n in nodes:
            part = self.cached.of(n) if self.cached is not None else None
            if part is not None and part.device is not None and windows:  # the windows DeviceWindows gave pages to
                idx = np.flatnonzero(part.device)
                window = (part.device[idx], part.host[idx])
            else:
                window = (EMPTY, EMPTY)
            self._pending[LOAD].append((n.device_pages, n.host_pages, *window, n if n is nodes[-1] else None))
        if nodes:
            self.tree.inc_lock_ref(nodes[-1])

    # ---- host pages ----------------------------------------------------------------------
    def _anchor_like(self, device_pages: np.ndarray) -> int:
        """Sharded: host pages for ``device_pages`` start on their first page's owner, so each
        host page has its device page's owner."""
        return 0 if self.shard is None else int(self.shard.placement.owner(int(device_pages[0])))

    def alloc(self, n: int, anchor: int, first_position: int = 0) -> np.ndarray | None:
        """``n`` host pages for positions ``first_position ..`` of a sequence anchored on rank
        ``anchor`` (unsharded: any), evicting host-only leaves first when too few are free."""
        if self.shared:  # make_room counts the evicted pages
            return alloc_evicting(self.allocator, n, first_position, self.make_room, anchor)[0]
        pages, evicted = alloc_evicting(self.allocator, n, first_position, self.evict, anchor)
        self.stats.evicted_host_pages += evicted
        return pages

    def evict(self, num_pages: int, wanted: Callable[[np.ndarray], bool] | None = None) -> int:
        """Free at least ``num_pages`` host pages by deleting unlocked host-only leaves in
        policy order (``wanted(host_pages)``: only leaves it accepts). Returns the pages freed."""
        evictable = _host_evictable_leaf if wanted is None else \
            (lambda n: _host_evictable_leaf(n) and wanted(n.host_pages))
        return self.tree.evict_leaves(num_pages, evictable, self._drop)

    def _drop(self, node: TreeNode) -> int:
        freed = len(node.host_pages)
        self.tree.delete_subtree(node)
        return freed

    # ---- queues --------------------------------------------------------------------------
    def submit(self) -> None:
        """Submit this step's queued loads and backups, merged into one op per direction."""
        for kind, items in self._pending.items():
            if items:
                dev, host, wdev, whost = (np.concatenate([item[i] for item in items]) for i in range(4))
                self.controller.submit(kind, dev, host, [n for *_, n in items if n is not None], (wdev, whost))
                items.clear()

    def ready_acks(self) -> AckCounts:
        return AckCounts(self.controller.ready_count(BACKUP), self.controller.ready_count(LOAD))

    def pending_acks(self) -> AckCounts:
        return AckCounts(backup=self.controller.pending(BACKUP), load=self.controller.pending(LOAD))

    def consume_acks(self, acks: AckCounts) -> None:
        """Unlock the nodes of the first ``acks.backup`` / ``acks.load`` ops, count their bytes;
        a backed-up node is handed to the tier below."""
        for kind, n in ((BACKUP, acks.backup), (LOAD, acks.load)):
            for op in self.controller.pop(kind, n):
                for node in op.payload:
                    if kind == BACKUP and node in self._backup_spans:
                        self.cached.unlock(node, *self._backup_spans.pop(node))
                        self._superseding.append(node)
                    self.tree.dec_lock_ref(node)
                    if kind == BACKUP and self.lower is not None:
                        self.lower.on_insert(node)
                self._account(op)
        self._drop_superseded()

    def _account(self, op: TransferOp) -> None:
        tokens, nbytes = op.num_pages * self.pool.page_size, op.num_pages * self.bytes_per_page
        if self.window_host is not None:
            nbytes += len(op.window_device_pages) * self.window_host.window_page_bytes
        if op.kind == BACKUP:
            self.stats.backup_tokens += tokens
            self.stats.backup_bytes += nbytes
        else:
            self.stats.load_tokens += tokens
            self.stats.load_bytes += nbytes
            self.stats.load_time_s += op.finish_time - op.submit_time
        logger.debug("%s ack op=%d pages=%d", op.kind, op.op_id, op.num_pages)

    def has_pending(self) -> bool:
        return any(self._pending.values()) or any(self.controller.pending(k) for k in (BACKUP, LOAD))

    def shutdown(self) -> None:
        self.controller.shutdown()

    def usage(self) -> dict:
        out = {
            "capacity_pages": self.allocator.capacity,
            "free_pages": self.allocator.available,
            "cached_pages": self.tree.host_pages_held,
            "layout": self.host_pool.layout,
            # each host pool once (a shared pool is also the window pair's)
            "host_pool_bytes": sum(h.total_bytes for h in {id(h): h for _, h in self.controller.pairs}.values()),
        }
        if self.window_host is not None:
            a = self.window_allocator
            held = a.capacity - a.ids.available if self.shared else a.capacity - a.available
            out["window"] = {"capacity_pages": a.capacity, "free_pages": a.available,
                             "cached_pages": held, "cached_tokens": held * self.pool.page_size,
                             "superseded_pages": self.stats.superseded_host_window_pages,
                             "page_bytes": self.window_host.window_page_bytes,
                             "pool_bytes": self.window_host.total_bytes,
                             "full_pool_bytes": self.host_pool.total_bytes}
            if self.shared:  # one pool of blocks: capacity_pages are the window pages its blocks could hold
                out["window"].update(shared_blocks=True, groups=a.groups)
        return out


def _host_evictable_leaf(node: TreeNode) -> bool:
    """Host eviction takes leaves that are host-only, unlocked and not read by storage."""
    return (not node.is_root and node.lock_ref == 0 and node.host_ref == 0 and node.device_pages is None
            and node.host_pages is not None and not node.children)
