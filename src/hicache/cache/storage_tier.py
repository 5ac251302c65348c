"""The storage tier (L3): prefetch lifecycle, storage backups, and the key chain.

* Prefetch: storage is asked for a prompt's pages past what the device and host hold; they
  land in host pages reserved up front. Its reader publishes progress acks; the scheduler
  applies an agreed count, then :meth:`StorageTier.finish_prefetch` inserts the covered pages
  as host-only nodes. A stopped prefetch's unused host pages are freed only when reaped, in
  order and as many as agreed ("prefetch_reap" acks), so host allocation stays in step.
* Backup: once a node's host copy is acked, the host copies on its path that storage lacks are
  written; their host data stays protected (``host_ref``) until the write's ack is consumed.
* Keys: page ``i`` of a path is named by a hash chained over every earlier page from the
  namespace's digest (:mod:`.storage.keys`); hashes are kept on the nodes once computed.

Units: ``start_page`` / ``completed`` / held counts are pages (host pool pages for held ones);
``tokens`` are token ids. Invariant: ``prefetch_held_pages`` counts the host pages reserved by
prefetches that are running or stopped but not yet reaped, and stays under the limit.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import NamedTuple, Sequence

import numpy as np

from .acks import AckCounts
from .host_tier import HostTier
from .host_window import HostWindows
from .host_transfer import leading_done
from .placement import ShardView, path_anchor
from .storage.base import StorageBackend
from .storage.keys import KeyNamespace, continue_chain, page_hashes
from .storage.page_objects import PageObject, WholePage, window_object
from .storage.prefetch_backup import Agree, PrefetchOp, StorageController
from .page_tree import EMPTY_PAGES
from .storage.state_objects import StateObject, StoredStates
from .storage.storage_ops import PartWrite
from .storage.window_objects import StoredWindows
from .tiers import CachePolicy
from .tree_node import TreeNode

logger = logging.getLogger(__name__)


def node_hashes(node: TreeNode, keys: KeyNamespace) -> list[bytes]:
    """The page hashes of (non-root) ``node``; the missing ones on its path are computed and
    kept on their nodes, so a chain is hashed once however often it is continued."""
    path = list(itertools.takewhile(lambda m: m.hash_values is None, node.lineage()))[::-1]  # root first
    above = path[0].parent if path else node  # the nearest node with hashes, or the root
    head = keys.digest(node.namespace) if above.is_root else above.hash_values[-1]
    for m, hashes in zip(path, continue_chain([m.key for m in path], keys.page_size, head)):
        m.hash_values = hashes
    return node.hash_values


def consume_prefetch_acks(op: PrefetchOp, n: int) -> bool:
    """Apply the first ``n`` progress acks; True once the final one is applied. With
    several ranks ``n`` is agreed: this rank's reader may still be publishing it."""
    while len(op.progress) < n:
        time.sleep(0.0005)
    if n > op.consumed:
        op.consumed, op.completed = n, op.progress[n - 1][0]
    return op.final_applied


class GridObjects(NamedTuple):
    """The objects (reads, writes) each component of a page is read from and written to, where not the
    rank-suffix scheme's (None): its pages', its window layers' (a checkpoint's), its snapshots'."""

    pages: tuple[Sequence[PageObject], Sequence[PageObject]] | None
    windows: tuple[Sequence[PageObject], Sequence[PageObject]] | None
    states: tuple[Sequence[StateObject], Sequence[StateObject]] | None


class StorageTier:
    """Implements :class:`~.tiers.Tier` below the host tier, whose pages it borrows."""

    def __init__(self, backend: StorageBackend, host: HostTier, keys: KeyNamespace, agree: tuple[Agree, Agree] | None,
                 policy: CachePolicy, shard: ShardView | None = None, objects: GridObjects | None = None) -> None:
        """``policy``: the backend calls' deadline, when a prompt is worth a prefetch and how much of the
        host prefetches may hold. ``shard``: sharded KV; this rank reads and writes the objects of the pages it owns
        (its keys name its shard, see ``keys``). ``objects``: the objects each component is read from and
        written to (the unified grid's cells); default: one object per page of this rank's KV, and one per
        sidecar pool, one per checkpoint's window layers, one per snapshot."""
        self.host, self.tree, self.keys = host, host.tree, keys
        self.shard = shard
        self.page_size = keys.page_size
        objects = objects or GridObjects(None, None, None)
        pages = objects.pages
        if pages is None:  # one object per page; sidecar KV (a speculative draft's): "<key>-sidecar1", ...
            # (none of a pipeline stage without attention layers: the other stages' objects decide)
            pages = ([WholePage(host.host_pool)] * bool(host.host_pool.num_layers) + [
                WholePage(h, f"-sidecar{i}") for i, (_, h) in enumerate(host.controller.sidecar_pairs, start=1)],) * 2
        # hybrid: a checkpoint page's window layers in objects of their own ("<key>-window"; the grid's
        # cells with the suffix "_swa" on the unified layout)
        windows = host.windows
        parts = [] if windows is None else [StoredWindows(
            *(objects.windows or ([window_object(windows.window_host, "-window")],) * 2), windows.span)]
        self.states = host.states  # recurrent layers: their snapshots, "<key>-state" objects (None: none)
        if self.states is not None:
            parts.append(StoredStates(self.states.pool, self.page_size, objects.states))
        # how each part's reserved host pages (slots) are freed once a stopped prefetch's reader is done
        self._free_reserved = {name: part.allocator.free for name, part in host.parts.items()}
        if self.states is not None:
            self._free_reserved[StoredStates.name] = self.states.free_slots
        self.controller = StorageController(backend, host.host_pool, agree, op_timeout=policy.storage_op_timeout,
                                            reads=pages[0], writes=pages[1], parts=parts)
        self.prefetch_threshold = policy.prefetch_threshold
        # selective writes: only prefixes retained for storage or hit this often go to L3
        self.write_threshold = policy.write_through_threshold if policy.storage_write_policy == "selective" else None
        # At most this many host pages may be held by prefetches at once.
        self.prefetch_page_limit = int(policy.prefetch_max_host_fraction * host.allocator.capacity)
        self.prefetch_held_pages = 0
        # Stopped prefetches whose reader may still write their unused host pages (and each part's, by name).
        self._stopped: deque[tuple[PrefetchOp, np.ndarray, dict[str, np.ndarray]]] = deque()

    # ---- prefetch ------------------------------------------------------------------------
    def start_prefetch(self, namespace: str, tokens: np.ndarray) -> PrefetchOp | None:
        """Ask storage for the prompt's pages past what the device and host tiers hold, if the
        uncached tail is long enough and prefetches hold few enough host pages."""
        peek = self.tree.peek_prefix(namespace, tokens[: len(tokens) - 1])  # not a hit: admit counts it
        start = (peek.device_hit_tokens + peek.host_hit_tokens) // self.page_size
        tail = (len(tokens) - 1) // self.page_size - start
        if tail * self.page_size < self.prefetch_threshold or self.prefetch_held_pages + tail > self.prefetch_page_limit:
            return None
        # The chain goes on from the last cached page, inside peek.node when the match ends mid-node.
        digest = self.keys.digest(namespace)
        prev = digest if peek.node is None else node_hashes(peek.node, self.keys)[peek.node_pages - 1]
        # Sharded: the first-page owner of the path ending at peek.node (prefetched pages continue its
        # rotation); for a prompt with nothing cached, the host rank with the most room.
        anchor = 0 if self.shard is None else path_anchor(self.shard.placement, peek.node)
        host = self.host.alloc(tail, self.host.allocator.roomiest_owner() if anchor is None else anchor, start)
        if host is None:
            return None
        hashes = page_hashes(tokens[start * self.page_size : (start + tail) * self.page_size], self.page_size, prev)
        parts = {name: part.reserve_prefetch(start + tail) for name, part in self.host.parts.items()}  # none sharded
        if self.states is not None:  # a host slot for the deepest snapshot the read finds
            slot = self.states.reserve()
            parts[StoredStates.name] = None if slot is None else np.array([slot])
        owned, local = (None, None) if self.shard is None else (self.shard.owned_indices(host), self.shard.local(host))
        op = self.controller.prefetch(namespace, digest, hashes, host, owned, local, start, parts)
        self.prefetch_held_pages += tail
        logger.debug("prefetch op=%d pages=%d from page %d", op.op_id, tail, start)
        return op

    def finish_prefetch(self, op: PrefetchOp, tokens: np.ndarray) -> int:
        """Stop waiting: insert the pages the consumed acks cover as host-only nodes, release
        the rest (once the reader is done with them). Returns the tokens inserted."""
        op.stop.set()
        ps, done = self.page_size, op.completed
        taken_from = done  # (none taken)
        if self._joins_rotation(op, tokens[: (op.start_page + done) * ps]):
            taken_from = self.tree.insert_host(op.namespace, tokens[: (op.start_page + done) * ps],
                                               op.host_pages[:done], op.start_page, op.hashes[:done])
        self.host.allocator.free(op.host_pages[:taken_from])
        took = op.parts and taken_from < done  # the window parts' pages hang from the new leaf
        leaf = self.tree.node_at(op.namespace, tokens[: (op.start_page + done) * ps]) if took else None
        later = {name: self.host.parts[name].place_prefetch(op, leaf, taken_from) for name in op.parts
                 if name != StoredStates.name}
        if StoredStates.name in op.parts:
            later[StoredStates.name] = self._place_state(op, tokens)
        self.prefetch_held_pages -= done
        self.controller.stats.prefetched_pages += done
        self.controller.stats.prefetch_bytes += done * self.host.bytes_per_page
        # Its failure (if any) is counted when it is reaped: best_effort stops waiting before the
        # reader knows whether the store answered.
        self._stopped.append((op, op.host_pages[done:], later))
        return (done - taken_from) * ps if taken_from < done else 0

    def _place_state(self, op: PrefetchOp, tokens: np.ndarray) -> np.ndarray:
        """The snapshot a finished read found goes to the node ending at its boundary (split there);
        returns the slot to free once the reader is surely done with it (it found none, or is not done)."""
        read = op.parts[StoredStates.name]
        if not (op.final_applied and 0 < read.first <= op.completed):
            return read.host_pages
        node = self.tree.boundary_node(op.namespace, tokens[: (op.start_page + read.first) * self.page_size], host=True)
        if node is None:
            return read.host_pages
        self.states.adopt(node, int(read.host_pages[0]))
        return EMPTY_PAGES

    def _joins_rotation(self, op: PrefetchOp, tokens: np.ndarray) -> bool:
        """Sharded: whether the prefetched pages continue the rotation of the path the tree holds
        for ``tokens`` now (it may have been evicted and cached again, from another rank, while
        the read ran); if not, they are dropped like an unused prefetch."""
        if self.shard is None or op.completed == 0:
            return True
        existing = path_anchor(self.shard.placement, self.tree.peek_prefix(op.namespace, tokens).node)
        return existing is None or existing == self.shard.placement.anchor_of(op.host_pages, op.start_page)

    def _reap(self, n: int) -> None:
        """Free the unused host pages of the first ``n`` stopped prefetches and count their
        failures, waiting for their readers to finish (only a drain asks for readers that are
        not done; their backend calls are bounded by deadlines)."""
        for _ in range(n):
            op, unused, later = self._stopped.popleft()
            op.done.wait()
            if op.failure:
                self.controller.stats.failures[op.failure] += 1
            self.host.allocator.free(unused)
            self.prefetch_held_pages -= len(unused)
            for name, pages in later.items():  # each part's pages the reader might still have written
                self._free_reserved[name](pages)

    # ---- backups -------------------------------------------------------------------------
    def on_insert(self, node: TreeNode | None) -> None:
        """``node`` has a host copy now: write the host copies on its path that storage lacks (selective
        writes: up to the deepest node retained for storage or hit often enough; an object chain is
        read from its first page, so everything above a written node is written too)."""
        unstored = [m for m in itertools.takewhile(lambda m: not m.stored, node.lineage()) if m.host_pages is not None]
        if self.write_threshold is not None:
            worth = (i for i, m in enumerate(unstored)
                     if self.tree.retention_rank(m, 2)[0] or m.hit_count >= self.write_threshold)
            unstored = unstored[next(worth, len(unstored)):]
        for n in reversed(unstored):
            n.stored = True
            self.tree.inc_host_ref(n)
            hashes = list(node_hashes(n, self.keys))
            parts = {name: PartWrite(*stored, self._superseded_hashes(n, part) if len(stored[0]) else [])  # not sharded
                     for name, part in self.host.parts.items() if (stored := part.stored(n)) is not None}
            state = self.states.tree_states.of(n).host if self.states is not None else 0
            if state:  # the snapshot at its end, beside its last page
                parts[StoredStates.name] = PartWrite(np.array([len(hashes) - 1]), np.array([state]), [])
            owned = None if self.shard is None else self.shard.owned_indices(n.host_pages)
            pages = n.host_pages.copy() if self.shard is None else self.shard.local(n.host_pages)
            self.controller.backup(self.keys.digest(n.namespace), hashes, pages, [n], owned, parts)

    def retain(self, nodes: list[TreeNode], until: float) -> None:
        """A retention was granted on ``nodes``: the backend keeps their page objects past every
        unretained one until ``until`` (those not written yet too: the write follows the host copy)."""
        for n in nodes:
            self.controller.retain(self.keys.digest(n.namespace), list(node_hashes(n, self.keys)), until,
                                   self.tree.retain_clock)

    def _superseded_hashes(self, node: TreeNode, part: HostWindows) -> list[bytes]:
        """Page hashes of stored ancestors' checkpoint pages that ``node``'s checkpoint supersedes
        (:meth:`~.host_window.HostWindows.superseded_stored`): their window objects go once
        ``node``'s are written."""
        return [node_hashes(anc, self.keys)[i] for anc, idx in part.superseded_stored(node) for i in idx]

    # ---- queues --------------------------------------------------------------------------
    def ready_acks(self) -> AckCounts:
        return AckCounts(storage_backup=self.controller.backup_ready_count(),
                         prefetch_reap=leading_done(op for op, *_ in self._stopped))

    def pending_acks(self) -> AckCounts:
        return AckCounts(storage_backup=self.controller.pending_backups(), prefetch_reap=len(self._stopped))

    def consume_acks(self, acks: AckCounts) -> None:
        """Release the host copies of the first ``acks.storage_backup`` writes (a failed write
        leaves its nodes unstored), then reap ``acks.prefetch_reap`` stopped prefetches."""
        for op in self.controller.pop_backups(acks.storage_backup):
            for node in op.payload:
                self.tree.dec_host_ref(node)
                if op.failure:
                    node.stored = False
            if op.failure:
                self.controller.stats.failures[op.failure] += 1
        self._reap(acks.prefetch_reap)

    def has_pending(self) -> bool:
        return self.controller.pending_backups() > 0 or bool(self._stopped)

    def shutdown(self) -> None:
        self.controller.shutdown()
