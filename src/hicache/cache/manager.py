"""Request-facing cache operations: admit (match + lock + reserve), cache a computed prefix,
release. The engine calls these on its scheduler thread only; the manager knows nothing of
requests beyond the :class:`KVState` it hands out.

Units: ``tokens`` are token-id sequences; lengths are tokens unless named ``*_pages``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..consensus_record import consensus_check
from .acks import AckCounts
from .controller import BACKUP, LOAD, TransferController, TransferOp, leading_done
from .host_pool import HostKVPool
from .pools import DeviceKVPool, PageAllocator, pages_to_slots
from .radix import RadixCache, TreeNode
from .storage.base import StorageBackend
from .storage.controller import Agree, PrefetchOp, StorageController
from .storage.keys import KeyNamespace, continue_chain, page_hashes

logger = logging.getLogger(__name__)


@dataclass
class KVState:
    """One request's hold on the device pool.

    ``pages[:cached_pages]`` belong to the tree and are locked through ``node``; the rest were
    allocated for this request and are its own until inserted or freed.
    """

    pages: np.ndarray
    cached_pages: int
    node: TreeNode | None
    device_hit_tokens: int
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    slots: torch.Tensor = field(default=None)  # slots of every page, in order (cached)

    def refresh_slots(self, page_size: int) -> None:
        self.slots = pages_to_slots(self.pages, page_size)


@dataclass
class CacheStats:
    """Cumulative counters since start."""

    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    evicted_device_pages: int = 0
    evicted_host_pages: int = 0
    backup_tokens: int = 0
    backup_bytes: int = 0
    load_tokens: int = 0
    load_bytes: int = 0
    load_time_s: float = 0.0  # submit -> finish, summed over load-backs
    backup_skipped_pages: int = 0  # host pool full of locked data


WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class _KVView:
    """The model's view: device buffers, with reads of layer i gated on in-flight loads."""

    def __init__(self, pool: DeviceKVPool, controller: TransferController | None) -> None:
        self.k_buffers, self.v_buffers = pool.k_buffers, pool.v_buffers
        self.wait_layer = controller.wait_layer if controller is not None else pool.wait_layer


class KVCacheManager:
    """Owns the device pool and its allocator, the radix tree (None when reuse is off) and,
    with a host tier, the host pool, its allocator and the transfer controller."""

    def __init__(
        self,
        pool: DeviceKVPool,
        eviction_policy: str = "lru",
        enable_prefix_cache: bool = True,
        host_pool: HostKVPool | None = None,
        write_policy: str = "write_through",
        write_through_threshold: int = 2,
        storage: StorageBackend | None = None,
        prefetch_threshold: int = 256,
        prefetch_max_host_fraction: float = 0.5,
        storage_agree: tuple[Agree, Agree] | None = None,
        shard: str = "",
        storage_op_timeout: float = 10.0,
    ) -> None:
        """``storage_agree``: MIN-reduce functions for the prefetch and backup threads when
        several ranks share the deployment; ``shard``: names this rank's slice of the KV
        (layers, heads) so ranks never share storage objects; ``storage_op_timeout``: deadline
        in seconds of each storage backend call (a breaker skips a backend that keeps failing)."""
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}")
        self.pool = pool
        self.page_size = pool.page_size
        self.allocator = PageAllocator(pool.num_pages)
        self.host_pool = host_pool
        self.host_allocator = PageAllocator(host_pool.num_pages) if host_pool is not None else None
        self.controller = TransferController(pool, host_pool) if host_pool is not None else None
        self.tree = (
            RadixCache(self.page_size, self.allocator, eviction_policy, self.host_allocator)
            if enable_prefix_cache else None
        )
        self.write_policy = write_policy
        # Hits a node needs before it is backed up (write_back: only at eviction).
        self.backup_threshold = {"write_through": 1, "write_through_selective": write_through_threshold,
                                 "write_back": None}[write_policy]
        if self.tree is not None and host_pool is not None and write_policy == "write_back":
            self.tree.backup_on_evict = self._backup_now
        self.kv_view = _KVView(pool, self.controller)
        # L3: prefetch reserves host pages; at most this many may be held by prefetches at once.
        self.storage = StorageController(storage, host_pool, *(storage_agree or ()), op_timeout=storage_op_timeout) \
            if storage is not None else None
        k = pool.k_buffers[0]  # what a page object holds: this rank's layers and KV heads
        self.keys = KeyNamespace(self.page_size, str(k.dtype), tuple(k.shape[1:]), len(pool.k_buffers), shard)
        self.prefetch_threshold = prefetch_threshold
        self.prefetch_page_limit = int(prefetch_max_host_fraction * self.host_allocator.capacity) \
            if self.host_allocator is not None else 0
        self.prefetch_held_pages = 0
        # Stopped prefetches whose reader may still write their unused host pages; freed in
        # order, as many as agreed ("prefetch_reap" acks), so host allocation stays in step.
        self._stopped_prefetches: deque[tuple[PrefetchOp, np.ndarray]] = deque()
        self._pending: dict[str, list[tuple[np.ndarray, np.ndarray, TreeNode | None]]] = {BACKUP: [], LOAD: []}
        self.stats = CacheStats()

    @property
    def capacity_pages(self) -> int:
        return self.allocator.capacity

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @consensus_check("cache.admit", args=lambda self, ns, tokens, reserve, storage=0: (ns, len(tokens), reserve, storage),
                     result=lambda s: None if s is None else (s.device_hit_tokens, s.host_hit_tokens,
                                                              s.storage_hit_tokens, len(s.pages)))
    def admit(self, namespace: str, tokens: np.ndarray, reserve_tokens: int, storage_tokens: int = 0) -> KVState | None:
        """Match ``tokens`` (the prompt), lock the hit and reserve pages up to ``reserve_tokens``
        (prompt + most output). A host hit gets device pages and a load-back (submitted with
        :meth:`submit_transfers`). Returns None, with nothing changed, when the pool cannot hold
        the request even after evicting unlocked cache.

        At least one prompt token is always left uncomputed so the prompt yields logits.
        """
        hit_pages = np.zeros(0, dtype=np.int64)
        node = None
        host_nodes: list[TreeNode] = []
        if self.tree is not None:
            match = self.tree.match_prefix(namespace, tokens[: len(tokens) - 1])
            hit_pages, node = match.device_pages, match.last_node
            self.tree.inc_lock_ref(node)  # also protects the host-hit nodes from L2 eviction
            n = match.last_node
            while n is not match.last_device_node:
                host_nodes.append(n)
                n = n.parent
            host_nodes.reverse()
        need = self.pages_for(reserve_tokens) - len(hit_pages)
        new_pages = self._alloc(need)
        if new_pages is None:
            if node is not None:
                self.tree.dec_lock_ref(node)
            return None
        # Load-back: the host-hit nodes take the first new pages, in path order.
        # The deepest node is locked until the load's ack is consumed (its ack payload).
        loaded = 0
        for hn in host_nodes:
            dev = new_pages[loaded : loaded + len(hn.host_pages)]
            self.tree.attach_device_pages(hn, dev)
            self._pending[LOAD].append((dev, hn.host_pages, hn if hn is host_nodes[-1] else None))
            loaded += len(dev)
        if host_nodes:
            self.tree.inc_lock_ref(host_nodes[-1])
        state = KVState(
            pages=np.concatenate([hit_pages, new_pages]),
            cached_pages=len(hit_pages) + loaded,
            node=node,
            device_hit_tokens=len(hit_pages) * self.page_size,
            host_hit_tokens=loaded * self.page_size,
        )
        # Pages that a prefetch just brought from storage arrive as host hits: report them as such.
        state.storage_hit_tokens = min(storage_tokens, state.host_hit_tokens)
        state.host_hit_tokens -= state.storage_hit_tokens
        state.refresh_slots(self.page_size)
        self.stats.prompt_tokens += len(tokens)
        self.stats.device_hit_tokens += state.device_hit_tokens
        self.stats.host_hit_tokens += state.host_hit_tokens
        self.stats.storage_hit_tokens += state.storage_hit_tokens
        if node is not None:
            self._maybe_backup(node)
        return state

    def _alloc(self, n: int) -> np.ndarray | None:
        if n > self.allocator.available and self.tree is not None:
            self.stats.evicted_device_pages += self.tree.evict(n - self.allocator.available)
        return self.allocator.alloc(n)

    def cache_prefix(self, namespace: str, tokens: np.ndarray, state: KVState) -> None:
        """Insert the whole pages of ``tokens`` (whose KV is computed) into the tree and move
        the request's lock to the new boundary, so concurrent requests can share it."""
        if self.tree is None:
            return
        n_pages = len(tokens) // self.page_size
        if n_pages <= state.cached_pages:
            return
        self._insert(namespace, tokens[: n_pages * self.page_size], state)
        match = self.tree.match_prefix(namespace, tokens[: n_pages * self.page_size])
        assert len(match.device_pages) == n_pages, "inserted prefix must match in full"
        if not np.array_equal(match.device_pages, state.pages[:n_pages]):
            state.pages[:n_pages] = match.device_pages
            state.refresh_slots(self.page_size)
        self.tree.inc_lock_ref(match.last_device_node)
        self.tree.dec_lock_ref(state.node)
        state.node = match.last_device_node
        state.cached_pages = n_pages

    def release(self, namespace: str, tokens: np.ndarray, state: KVState) -> None:
        """The request is done: cache the whole pages of ``tokens`` (those whose KV is
        computed), free every other page the request held, drop its lock."""
        keep = 0
        if self.tree is not None:
            keep = len(tokens) // self.page_size
            if keep > state.cached_pages:
                self._insert(namespace, tokens[: keep * self.page_size], state)
            keep = max(keep, state.cached_pages)
        self.allocator.free(state.pages[keep:])
        if state.node is not None:
            self.tree.dec_lock_ref(state.node)
        state.pages = state.pages[:0]
        state.node = None

    def _insert(self, namespace: str, tokens: np.ndarray, state: KVState) -> None:
        n_pages = len(tokens) // self.page_size
        already = self.tree.insert(namespace, tokens, state.pages[:n_pages]) // self.page_size
        # Pages we computed for a span another request cached first are duplicates: free them.
        if already > state.cached_pages:
            self.allocator.free(state.pages[state.cached_pages : already])
        if self.controller is not None:
            self._maybe_backup(self.tree.node_at(namespace, tokens))

    # ---- host tier -----------------------------------------------------------------------
    def _maybe_backup(self, node: TreeNode | None) -> None:
        """Queue a backup of every node on the path to ``node`` that the write policy says
        should have a host copy and has none yet. Each is locked until its ack is consumed."""
        if self.controller is None or self.backup_threshold is None or node is None:
            return
        path = []
        while not node.is_root:
            if node.host_pages is None and node.device_pages is not None and node.hit_count >= self.backup_threshold:
                path.append(node)
            node = node.parent
        for n in reversed(path):
            host = self._alloc_host(n.num_pages)
            if host is None:
                self.stats.backup_skipped_pages += n.num_pages
                continue
            self.tree.attach_host_pages(n, host)
            self.tree.inc_lock_ref(n)
            self._pending[BACKUP].append((n.device_pages, host, n))

    def _alloc_host(self, n: int) -> np.ndarray | None:
        if n > self.host_allocator.available:
            self.stats.evicted_host_pages += self.tree.evict_host(n - self.host_allocator.available)
        return self.host_allocator.alloc(n)

    def _backup_now(self, node: TreeNode) -> bool:
        """write_back: copy an L1 victim to host before its device pages are freed."""
        host = self._alloc_host(node.num_pages)
        if host is None:
            self.stats.backup_skipped_pages += node.num_pages
            return False
        self.tree.attach_host_pages(node, host)
        op = self.controller.submit(BACKUP, node.device_pages, host, [])
        op.done.wait()
        return True

    def submit_transfers(self) -> None:
        """Submit this step's queued loads and backups, merged into one op per direction."""
        if self.controller is None:
            return
        for kind, items in self._pending.items():
            if items:
                dev = np.concatenate([d for d, _, _ in items])
                host = np.concatenate([h for _, h, _ in items])
                self.controller.submit(kind, dev, host, [n for _, _, n in items if n is not None])
                items.clear()

    def ack_counts(self) -> AckCounts:
        """Leading acks ready on this rank, per queue (the input to agreement)."""
        if self.controller is None:
            return AckCounts()
        if self.storage is None:
            return AckCounts(self.controller.ready_count(BACKUP), self.controller.ready_count(LOAD))
        return AckCounts(self.controller.ready_count(BACKUP), self.controller.ready_count(LOAD),
                         self.storage.backup_ready_count(), leading_done(op for op, _ in self._stopped_prefetches))

    @consensus_check("cache.consume_acks", args=lambda self, acks: acks.to_list())
    def consume_acks(self, acks: AckCounts) -> None:
        """Apply exactly the given leading acks: unlock their nodes, count their bytes."""
        if self.controller is None:
            return
        for kind, n in ((BACKUP, acks.backup), (LOAD, acks.load)):
            for op in self.controller.pop(kind, n):
                for node in op.payload:
                    self.tree.dec_lock_ref(node)
                    if kind == BACKUP and self.storage is not None:
                        self._backup_to_storage(node)
                self._account(op)
        if self.storage is not None:
            for op in self.storage.pop_backups(acks.storage_backup):
                for node in op.payload:
                    self.tree.dec_host_ref(node)
                    if op.failure:
                        node.stored = False
                if op.failure:
                    self.storage.stats.fail(op.failure)
            self._reap_stopped_prefetches(acks.prefetch_reap)

    def _account(self, op: TransferOp) -> None:
        tokens, nbytes = op.num_pages * self.page_size, op.num_pages * self.pool.bytes_per_page
        if op.kind == BACKUP:
            self.stats.backup_tokens += tokens
            self.stats.backup_bytes += nbytes
        else:
            self.stats.load_tokens += tokens
            self.stats.load_bytes += nbytes
            self.stats.load_time_s += op.finish_time - op.submit_time
        logger.debug("%s ack op=%d pages=%d", op.kind, op.op_id, op.num_pages)

    def has_pending_transfers(self) -> bool:
        return self.controller is not None and (
            any(self._pending.values()) or any(self.controller.pending(k) for k in (BACKUP, LOAD))
            or (self.storage is not None and (self.storage.pending_backups() > 0 or bool(self._stopped_prefetches)))
        )

    def drain_ready(self) -> None:
        """Idle housekeeping: submit queued transfers and apply the acks that are ready now,
        never waiting (a hung storage backend must not hold the scheduler thread). Acks that
        are not ready yet stay for a later call; the caller comes back while
        :meth:`has_pending_transfers`."""
        if self.controller is None:
            return
        self.submit_transfers()
        self.consume_acks(self.ack_counts())

    def drain(self) -> None:
        """Submit and consume every transfer, storage writes included, waiting for them (flush
        and shutdown only: storage calls are bounded by their deadlines, see storage.guard)."""
        if self.controller is None:
            return
        self.submit_transfers()
        self.consume_acks(AckCounts(backup=self.controller.pending(BACKUP), load=self.controller.pending(LOAD)))
        if self.storage is not None:  # host backups just consumed may have queued storage writes
            self.consume_acks(AckCounts(storage_backup=self.storage.pending_backups(),
                                        prefetch_reap=len(self._stopped_prefetches)))

    # ---- storage tier (L3) ---------------------------------------------------------------
    def ns_digest(self, namespace: str) -> bytes:
        """Head of the hash chain of ``namespace`` on this rank (see :class:`KeyNamespace`)."""
        return self.keys.digest(namespace)

    def _node_hashes(self, node: TreeNode) -> list[bytes]:
        """The page hashes of (non-root) ``node``; the missing ones on its path are computed and
        kept on their nodes, so a chain is hashed once however often it is continued."""
        path = []
        n = node
        while not n.is_root and n.hash_values is None:
            path.append(n)
            n = n.parent
        path.reverse()
        head = self.ns_digest(node.namespace) if n.is_root else n.hash_values[-1]
        for m, hashes in zip(path, continue_chain([m.key for m in path], self.page_size, head)):
            m.hash_values = hashes
        return node.hash_values

    def _backup_to_storage(self, node: TreeNode) -> None:
        """Write the host copies on the path to ``node`` that storage lacks; their host data
        stays protected until the write's ack is consumed."""
        path = []
        n = node
        while not n.is_root and not n.stored:
            if n.host_pages is not None:
                path.append(n)
            n = n.parent
        for n in reversed(path):
            n.stored = True
            self.tree.inc_host_ref(n)
            self.storage.backup(self.ns_digest(n.namespace), list(self._node_hashes(n)), n.host_pages.copy(), [n])

    def start_prefetch(self, namespace: str, tokens: np.ndarray) -> PrefetchOp | None:
        """Ask storage for the prompt's pages past what the device and host tiers hold, if the
        uncached tail is long enough and prefetches hold few enough host pages."""
        if self.storage is None:
            return None
        peek = self.tree.peek_prefix(namespace, tokens[: len(tokens) - 1])  # not a hit: admit counts it
        start = (peek.device_hit_tokens + peek.host_hit_tokens) // self.page_size
        tail = (len(tokens) - 1) // self.page_size - start
        if tail * self.page_size < self.prefetch_threshold or self.prefetch_held_pages + tail > self.prefetch_page_limit:
            return None
        # The chain goes on from the last cached page, inside peek.node when the match ends mid-node.
        prev = self.ns_digest(namespace) if peek.node is None else self._node_hashes(peek.node)[peek.node_pages - 1]
        host = self._alloc_host(tail)
        if host is None:
            return None
        hashes = page_hashes(tokens[start * self.page_size : (start + tail) * self.page_size], self.page_size, prev)
        op = self.storage.prefetch(namespace, self.ns_digest(namespace), hashes, host)
        op.start_page = start
        self.prefetch_held_pages += tail
        logger.debug("prefetch op=%d pages=%d from page %d", op.op_id, tail, start)
        return op

    @staticmethod
    def prefetch_ack_count(op: PrefetchOp) -> int:
        """Progress acks published so far (the input to agreement)."""
        return len(op.progress)

    def consume_prefetch_acks(self, op: PrefetchOp, n: int) -> bool:
        """Apply the first ``n`` progress acks; True once the final one is applied. With
        several ranks ``n`` is agreed: this rank's reader may still be publishing it."""
        while len(op.progress) < n:
            time.sleep(0.0005)
        if n > op.consumed:
            op.consumed, op.completed = n, op.progress[n - 1][0]
        return op.final_applied

    @consensus_check("cache.finish_prefetch", args=lambda self, op, tokens: (op.namespace, op.start_page, op.completed),
                     result=lambda inserted: inserted)
    def finish_prefetch(self, op: PrefetchOp, tokens: np.ndarray) -> int:
        """Stop waiting: insert the pages the consumed acks cover as host-only nodes, release
        the rest (once the reader is done with them). Returns the tokens inserted."""
        op.stop.set()
        ps, done = self.page_size, op.completed
        taken_from = self.tree.insert_host(op.namespace, tokens[: (op.start_page + done) * ps], op.host_pages[:done],
                                           op.start_page, op.hashes[:done])
        self.host_allocator.free(op.host_pages[:taken_from])
        self.prefetch_held_pages -= done
        self.storage.stats.prefetched_pages += done
        self.storage.stats.prefetch_bytes += done * self.pool.bytes_per_page
        # Its failure (if any) is counted when it is reaped: best_effort stops waiting before the
        # reader knows whether the store answered.
        self._stopped_prefetches.append((op, op.host_pages[done:]))
        return (done - taken_from) * ps if taken_from < done else 0

    def _reap_stopped_prefetches(self, n: int) -> None:
        """Free the unused host pages of the first ``n`` stopped prefetches and count their
        failures, waiting for their readers to finish (only :meth:`drain` asks for readers that
        are not done; their backend calls are bounded by deadlines)."""
        for _ in range(n):
            op, unused = self._stopped_prefetches.popleft()
            op.done.wait()
            if op.failure:
                self.storage.stats.fail(op.failure)
            self.host_allocator.free(unused)
            self.prefetch_held_pages -= len(unused)


    def flush(self) -> None:
        """Drop all cached prefixes in every tier. Only valid when no request holds pages."""
        self.drain()
        if self.tree is not None:
            self.tree.reset()
        if self.allocator.available != self.allocator.capacity:
            raise RuntimeError("flush while requests still hold device pages")

    def shutdown(self) -> None:
        if self.controller is not None:
            self.drain()
            self.controller.shutdown()
        if self.storage is not None:
            self.storage.shutdown()

    def usage(self) -> dict:
        tree = self.tree
        return {
            "page_size": self.page_size,
            "capacity_pages": self.capacity_pages,
            "free_pages": self.allocator.available,
            "cached_pages": tree.cached_pages if tree else 0,
            "evictable_pages": tree.evictable_pages if tree else 0,
            "locked_pages": tree.protected_pages if tree else 0,
            "request_pages": self.capacity_pages - self.allocator.available - (tree.cached_pages if tree else 0),
            "device_pool_bytes": self.pool.total_bytes,
        }

    def host_usage(self) -> dict | None:
        if self.host_pool is None:
            return None
        return {
            "capacity_pages": self.host_allocator.capacity,
            "free_pages": self.host_allocator.available,
            "cached_pages": self.tree.host_pages_held,
            "layout": self.host_pool.layout,
            "host_pool_bytes": self.host_pool.total_bytes,
        }
