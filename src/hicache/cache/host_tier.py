"""The host tier (L2): write policy, device<->host copies, their acks, host eviction.

A node gets a host copy by its write policy: ``write_through`` on insert, ``write_through_
selective`` on its Nth hit, ``write_back`` only when the device evicts it. A backup locks its
node until the ack is consumed; a load-back (host hit at admission) locks the deepest loaded
node until its ack is consumed. A consumed backup ack tells the tier below (storage) that the
node now has a host copy. Host eviction deletes unlocked, unprotected host-only leaves.

Units: page ids and counts are logical pages of the host pool unless named ``dev``; a host
page mirrors one device page (same page size). Invariant: transfers are queued during a step
and submitted once per step, one op per direction, in queue order.

A component with host pages of its own has its host part in ``HostTier.parts`` (by name): a
hybrid pool's window, :mod:`.host_window` (``HostTier.windows``), host window pages for
checkpoints only; a backup and a load-back copy each part's pages with the rest.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np

from .acks import AckCounts
from .content_index import Unreadable
from .host_pool import HostKVPool
from .host_transfer import BACKUP, LOAD, TransferController, TransferOp
from .host_state import HostStates
from .host_window import HostWindows
from .page_tree import EMPTY_PAGES
from .placement import ShardedPageAllocator, ShardView, alloc_evicting
from .pools import DeviceKVPool, PageAllocator
from .radix import RadixCache
from .tiers import CachePolicy, CacheStats, Tier
from .tree_node import TreeNode

logger = logging.getLogger(__name__)

# One queued copy: device pages, host pages, each part's (device, host) pages by component, and the
# node to unlock when its ack is consumed.
_Item = tuple[np.ndarray, np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]], TreeNode | None]


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
        self.controller = TransferController(pool, host_pool, shard, sidecars,
                                             {} if window_host is None else {HostWindows.name: window_host})
        self.bytes_per_page = host_pool.bytes_per_page + sum(dev.bytes_per_page for dev, _ in sidecars)
        self.windows = HostWindows(self, window_host, tree.windows) if tree is not None and window_host is not None \
            else None
        self.parts: dict[str, HostWindows] = {} if self.windows is None else {self.windows.name: self.windows}
        # Hits a node needs before it is backed up (write_back: only at eviction).
        self.backup_threshold = {"write_through": 1, "write_through_selective": policy.write_through_threshold,
                                 "write_back": None}[policy.write_policy]
        if tree is not None and policy.write_policy == "write_back":
            tree.backup_on_evict = self.on_evict
        if tree is not None:  # a victim retained in the host tier is copied here first, whatever the policy
            tree.demote_on_evict = self.demote
        self.lower: Tier | None = None
        self.states: HostStates | None = None  # recurrent layers: host snapshots (set by the manager)
        self._pending: dict[str, list[_Item]] = {BACKUP: [], LOAD: []}

    # ---- write policy --------------------------------------------------------------------
    def on_insert(self, node: TreeNode | None) -> None:
        """Queue a backup of every node on the path to ``node`` that the write policy says
        should have a host copy and has none yet. Each is locked until its ack is consumed."""
        if self.backup_threshold is None or node is None:
            return
        path = [n for n in node.lineage()
                if n.host_pages is None and n.device_pages is not None and n.hit_count >= self.backup_threshold]
        for n in reversed(path):
            parts = self._give_host(n, lock=True)
            if parts is not None:
                self._pending[BACKUP].append((n.device_pages, n.host_pages, parts, n))

    def on_evict(self, node: TreeNode) -> bool:
        """write_back: copy an L1 victim to host before its device pages are freed."""
        parts = self._give_host(node, lock=False)
        if parts is None:
            return False
        self.controller.submit(BACKUP, node.device_pages, node.host_pages, [], parts).done.wait()
        return True

    def demote(self, node: TreeNode) -> bool:
        """A retained L1 victim: copy it to host (:meth:`on_evict`) and on to storage, as its retention asks."""
        if not self.on_evict(node):
            return False
        if self.lower is not None:
            self.lower.on_insert(node)
        return True

    def _give_host(self, node: TreeNode, lock: bool) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
        """Host pages for a backup of ``node`` (``lock``: locked until its ack is consumed); each
        part's (device, host) pages to copy, None (counted) when there is no room."""
        # sharded: the host pages start on the first device page's owner, so each has its device page's owner
        anchor = 0 if self.shard is None else int(self.shard.placement.owner(int(node.device_pages[0])))
        host = self.alloc(node.num_pages, anchor)
        if host is None:
            self.stats.backup_skipped_pages += node.num_pages
            return None
        self.tree.attach_host_pages(node, host)
        if lock:
            self.tree.inc_lock_ref(node)
        return {name: part.backup(node, lock) for name, part in self.parts.items()}

    def load_back(self, nodes: list[TreeNode], windows: bool = True,
                  device_hit_windows: list[tuple[np.ndarray, np.ndarray]] = ()) -> None:
        """Queue host->device copies into the device pages ``nodes`` (a path, in order) were
        just given; the deepest stays locked until the load's ack is consumed (its payload).
        ``windows`` False: a hybrid hit's window pages arrive otherwise (P/D), full layers only.
        ``device_hit_windows``: (device, host) window pages of the device hit's tombstones whose
        host copy holds them (the request's window lock keeps them)."""
        for window in device_hit_windows:
            self._pending[LOAD].append((EMPTY_PAGES, EMPTY_PAGES, {HostWindows.name: window}, None))
        for n in nodes:
            parts = {name: part.load(n) for name, part in self.parts.items()} if windows else {}
            self._pending[LOAD].append((n.device_pages, n.host_pages, parts, n if n is nodes[-1] else None))
        if nodes:
            self.tree.inc_lock_ref(nodes[-1])

    def unreadable(self) -> Unreadable:
        """Pages a copy queued or in flight may still write: device pages of loads, host pages of backups."""
        def pages(kind: str, side: int) -> frozenset[int]:
            ids = [item[side] for item in self._pending[kind]] + [
                op.device_pages if side == 0 else op.host_pages for op in self.controller.unacked(kind)]
            return frozenset(np.concatenate(ids).tolist()) if ids else frozenset()
        return Unreadable(pages(LOAD, 0), pages(BACKUP, 1))

    # ---- host pages ----------------------------------------------------------------------
    def alloc(self, n: int, anchor: int, first_position: int = 0) -> np.ndarray | None:
        """``n`` host pages for positions ``first_position ..`` of a sequence anchored on rank
        ``anchor`` (unsharded: any), evicting host-only leaves first when too few are free."""
        evict = self.windows.make_room if self.host_pool.shared else self.evict  # shared: blocks for either kind
        return alloc_evicting(self.allocator, n, first_position, evict, anchor)[0]

    def evict(self, num_pages: int, wanted: Callable[[np.ndarray], bool] | None = None) -> int:
        """Free at least ``num_pages`` host pages by deleting unlocked host-only leaves, those a
        retention keeps in the host tier last, else in policy order (``wanted(host_pages)``: only
        leaves it accepts). Returns the pages freed."""
        evictable = self.evictable if wanted is None else (lambda n: self.evictable(n) and wanted(n.host_pages))
        tree = self.tree
        return tree.evict_leaves(num_pages, evictable, self.drop,
                                 lambda n: (*tree.retention_rank(n, 1), *tree.eviction_key(n)))

    @staticmethod
    def evictable(node: TreeNode) -> bool:
        """Host eviction takes leaves that are host-only, unlocked and not read by storage."""
        return (not node.is_root and node.lock_ref == 0 and node.host_ref == 0 and node.device_pages is None
                and node.host_pages is not None and not node.children)

    def drop(self, node: TreeNode) -> int:
        """Delete a host-only leaf (its pages counted as evicted); the host pages it held."""
        freed = len(node.host_pages)
        self.tree.delete_subtree(node)
        self.stats.evicted_host_pages += freed
        return freed

    # ---- queues --------------------------------------------------------------------------
    def submit(self) -> None:
        """Submit this step's queued loads and backups, merged into one op per direction."""
        for kind, items in self._pending.items():
            if items:
                dev, host = (np.concatenate([item[i] for item in items]) for i in (0, 1))
                parts = {name: tuple(np.concatenate([item[2].get(name, (EMPTY_PAGES,) * 2)[i] for item in items])
                                     for i in (0, 1)) for name in self.parts}
                self.controller.submit(kind, dev, host, [n for *_, n in items if n is not None], parts)
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
                    for part in self.parts.values() if kind == BACKUP else ():
                        part.backed_up(node)
                    self.tree.dec_lock_ref(node)
                    if kind == BACKUP and self.lower is not None:
                        self.lower.on_insert(node)
                self._account(op)
        for part in self.parts.values():
            part.drop_superseded()

    def _account(self, op: TransferOp) -> None:
        tokens = op.num_pages * self.pool.page_size
        nbytes = op.num_pages * self.bytes_per_page + sum(part.op_bytes(op) for part in self.parts.values())
        if op.kind == BACKUP:
            self.stats.backup_tokens += tokens
            self.stats.backup_bytes += nbytes
        else:
            self.stats.load_tokens += tokens
            self.stats.load_bytes += nbytes
            self.stats.load_time_s += op.finish_time - op.submit_time
        logger.debug("%s ack op=%d pages=%d", op.kind, op.op_id, op.num_pages)

    def loads_pending(self) -> bool:
        """Whether a load is queued or in flight (it may read host window pages)."""
        return bool(self.controller.pending(LOAD) or self._pending[LOAD])

    def has_pending(self) -> bool:
        return any(self._pending.values()) or any(self.controller.pending(k) for k in (BACKUP, LOAD))

    def shutdown(self) -> None:
        self.controller.shutdown()

    def usage(self) -> dict:
        out = {"capacity_pages": self.allocator.capacity, "free_pages": self.allocator.available,
               "cached_pages": self.tree.host_pages_held, "layout": self.host_pool.layout,
               # each host pool once (a shared pool is also the window pair's)
               "host_pool_bytes": sum(h.total_bytes for h in {id(h): h for _, h in self.controller.pairs}.values())}
        for name, part in self.parts.items():
            out[name] = part.usage(self.host_pool, self.pool.page_size)
        return out

