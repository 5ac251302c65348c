"""The device tier (L1): admission and eviction on the device pool.

Admission matches a prompt in the tree, locks the hit and reserves the rest of the request's
pages, evicting unlocked leaves to make room; a finished span is inserted back and its lock
moved to the new boundary. Host-hit nodes get device pages here; their load-back is the host
tier's (:meth:`.host_tier.HostTier.load_back`).

Units: ``tokens`` are token-id sequences; lengths are tokens unless named ``*_pages``; page ids
are logical pages of the device pool. Invariant: every device page is free, held by the tree,
or owned by exactly one :class:`KVState` (``pages[cached_pages:]``).
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable

from dataclasses import dataclass, field

import numpy as np
import torch

from .device_window import DeviceWindows, WindowHold
from .page_tree import EMPTY_PAGES
from .placement import PagePlacement, ShardedPageAllocator, alloc_evicting, path_anchor
from .pools import DeviceKVPool, PageAllocator, pages_to_slots
from .radix import RadixCache
from .device_state import DeviceStates
from .state_pool import StateHold, StatePool
from .state_tree import TreeStates
from .tiers import CacheStats, Tier
from .tree_node import TreeNode
from .window_tree import TreeWindows


logger = logging.getLogger(__name__)


@dataclass
class KVState:
    """One request's hold on the device pool.

    ``pages[:cached_pages]`` belong to the tree and are locked through ``node``; the rest were
    allocated for this request and are its own until inserted or freed. ``window``: its hold on a
    hybrid pool's window component (:class:`.device_window.WindowHold`; None without one).
    ``state``: its recurrent-state slot (:class:`.state_pool.StateHold`; None without recurrent layers).
    """

    pages: np.ndarray
    cached_pages: int
    node: TreeNode | None
    device_hit_tokens: int
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    slots: torch.Tensor = field(default=None)  # slots of every page, in order (cached)
    window: WindowHold | None = None
    state: StateHold | None = None

    def refresh_slots(self, page_size: int) -> None:
        self.slots = pages_to_slots(self.pages, page_size)


class DeviceTier:
    """The device pool's allocator and the tree (None when prefix reuse is off). ``lower`` is
    the host tier, told of every node that becomes cached on the device.

    ``placement`` (KV page-sharded over N ranks): page ids are logical, ``pool`` holds this
    rank's ``pool.num_pages`` local pages, and each of the N ranks as many; a request's pages
    follow the owner rotation of their positions (:mod:`.placement`). Without one (or N = 1)
    page ids are the pool's own."""

    def __init__(self, pool: DeviceKVPool, eviction_policy: str, enable_prefix_cache: bool,
                 host_allocator: PageAllocator | None, stats: CacheStats,
                 placement: PagePlacement | None = None, states: StatePool | None = None) -> None:
        self.pool = pool

        self.page_size = pool.page_size
        self.placement = placement if placement is not None and placement.num_shards > 1 else None
        self.allocator: PageAllocator | ShardedPageAllocator = (
            ShardedPageAllocator(self.placement, pool.num_pages) if self.placement else PageAllocator(pool.num_pages))
        if pool.hybrid and self.placement is not None:
            raise ValueError("a hybrid pool's window component is not page-sharded")
        page_ids = pool.windows.page_ids(self.allocator) if pool.hybrid else None
        self.tree = RadixCache(self.page_size, self.allocator, eviction_policy, host_allocator) \
            if enable_prefix_cache else None
        if self.tree is not None and pool.hybrid:
            self.tree.add_component(TreeWindows(self.tree, pool.windows.window, page_ids))
        self.stats = stats
        # the recurrent layers' state slots: one running slot per admitted request, snapshots on the tree
        self.states = DeviceStates(states, self.tree) if states is not None else None
        self.windows = DeviceWindows(page_ids, self.tree, stats, pool) if pool.hybrid else None
        self.lower: Tier | None = None

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def admit(self, namespace: str, tokens: np.ndarray, reserve_tokens: int, storage_tokens: int,
              forward_tokens: int = 0, kv_arrives: bool = False) -> tuple[KVState, list[TreeNode], list] | None:
        """Match, lock and reserve (see :meth:`.manager.KVCacheManager.admit`). Returns the
        state, the host-hit nodes, in path order, that just got device pages (the first new
        pages) and need a load-back, and (hybrid) the (device, host) window pages of device-hit
        pages whose window comes back from their host copy; None, with nothing changed, when the
        pool is too full.
        ``forward_tokens``: the most tokens one of its forwards adds (a hybrid pool's window
        budget). A pool with recurrent layers gives the request a state slot too (none free: None)."""
        if self.states is None:
            return self._admit_pages(namespace, tokens, reserve_tokens, storage_tokens, forward_tokens, kv_arrives)
        hold = self.states.hold()
        if hold is None:
            return None
        prompt = tokens[: len(tokens) - 1]  # (as the match: one token is left to compute)
        peek = self.tree.peek_prefix(namespace, prompt, cut=False) if self.tree else None
        kv_tokens = peek.device_hit_tokens + peek.host_hit_tokens if peek else 0
        admitted = self._admit_pages(namespace, tokens, reserve_tokens, storage_tokens, forward_tokens, kv_arrives)
        if admitted is None:
            self.states.release(hold)
            return None
        state = admitted[0]
        state.state = hold
        hit = state.device_hit_tokens + state.host_hit_tokens + state.storage_hit_tokens
        self.states.on_admit(hold, state.node, hit, kv_tokens, kv_arrives)
        return admitted

    def _admit_pages(self, namespace: str, tokens: np.ndarray, reserve_tokens: int, storage_tokens: int,
                     forward_tokens: int, kv_arrives: bool) -> tuple[KVState, list[TreeNode], list] | None:
        if self.windows is not None and not self.windows.fits(forward_tokens, self.pages_for(reserve_tokens)):
            return None
        hit_pages, node, match, window_lock, host_nodes = EMPTY_PAGES, None, None, None, []
        if self.tree is not None:
            match = self.tree.match_prefix(namespace, tokens[: len(tokens) - 1], cut=not kv_arrives)
            hit_pages, node = match.device_pages, match.last_node
            self.tree.inc_lock_ref(node)  # also protects the host-hit nodes from L2 eviction
            if self.windows is not None:  # may split a host-hit node: before they are listed
                window_lock = self.windows.lock_hit(node, (match.device_hit_tokens + match.host_hit_tokens)
                                                    // self.page_size, len(tokens) if kv_arrives else None)
            host_nodes = list(itertools.takewhile(lambda n: n is not match.last_device_node, node.lineage()))[::-1]
        new_pages = self._alloc(self.pages_for(reserve_tokens) - len(hit_pages), len(hit_pages),
                                self._anchor(hit_pages, host_nodes))
        if new_pages is None:
            if node is not None:
                if self.windows is not None:
                    self.windows.unlock(node, window_lock)
                self.tree.dec_lock_ref(node)
            return None
        loaded = 0
        for hn in host_nodes:
            self.tree.attach_device_pages(hn, new_pages[loaded : loaded + len(hn.host_pages)])
            loaded += len(hn.host_pages)
        # Pages that a prefetch just brought from storage arrive as host hits: report them as such.
        stored = min(storage_tokens, loaded * self.page_size)
        state = KVState(pages=np.concatenate([hit_pages, new_pages]), cached_pages=len(hit_pages) + loaded,
                        node=node, device_hit_tokens=len(hit_pages) * self.page_size,
                        host_hit_tokens=loaded * self.page_size - stored, storage_hit_tokens=stored)
        state.refresh_slots(self.page_size)
        restored = [] if self.windows is None else self.windows.admit(
            state, window_lock, match.parts["window"] if match is not None else None, host_nodes, forward_tokens,
            len(tokens), kv_arrives)
        self.stats.prompt_tokens += len(tokens)
        self.stats.device_hit_tokens += state.device_hit_tokens
        self.stats.host_hit_tokens += state.host_hit_tokens
        self.stats.storage_hit_tokens += state.storage_hit_tokens
        return state, host_nodes, restored

    def _anchor(self, hit_pages: np.ndarray, host_nodes: list[TreeNode]) -> int:
        """Sharded: the rank of the sequence's first page -- its cached path's (device hit, else
        the host-hit path from the root), or for a new sequence the rank with the most room."""
        if self.placement is None:
            return 0
        if len(hit_pages):
            return self.placement.anchor_of(hit_pages)
        if host_nodes:
            return self.placement.anchor_of(host_nodes[0].host_pages)
        return self.allocator.roomiest_owner()

    def _alloc(self, n: int, first_position: int, anchor: int) -> np.ndarray | None:
        """``n`` pages for positions ``first_position ..`` of a sequence, evicting unlocked cache
        while they do not fit."""
        if self.windows is not None and self.windows.shared:  # blocks: windows and whole nodes make room
            return alloc_evicting(self.allocator, n, first_position, self.windows.make_room)[0]
        pages, evicted = alloc_evicting(self.allocator, n, first_position,
                                        self.tree.evict if self.tree is not None else None, anchor)
        self.stats.evicted_device_pages += evicted
        return pages

    def cache_prefix(self, namespace: str, tokens: np.ndarray, state: KVState) -> None:
        """Insert the whole pages of ``tokens`` (whose KV is computed) into the tree and move
        the request's lock to the new boundary, so concurrent requests can share it."""
        n_pages = len(tokens) // self.page_size
        if not self._insert(namespace, tokens, state):
            return
        # (a recurrent model's match would end at a snapshot: its lock moves to the pages' end all the same)
        match = self.tree.match_prefix(namespace, tokens[: n_pages * self.page_size], cut=self.states is None)
        assert len(match.device_pages) == n_pages, "inserted prefix must match in full"
        if not np.array_equal(match.device_pages, state.pages[:n_pages]):
            state.pages[:n_pages] = match.device_pages
            state.refresh_slots(self.page_size)
        self.tree.inc_lock_ref(match.last_device_node)
        self.tree.dec_lock_ref(state.node)
        state.node = match.last_device_node
        state.cached_pages = n_pages
        if self.windows is not None:
            self.windows.after_insert(state, match.parts["window"])
        if self.states is not None:
            self.states.after_insert(namespace, tokens, state.state)

    def release(self, namespace: str, tokens: np.ndarray, state: KVState) -> None:
        """The request is done: cache the whole pages of ``tokens`` (those whose KV is
        computed), free every other page the request held, drop its lock."""
        if self.windows is not None:
            prompt_end = state.window.prompt_end  # where its prompt's checkpoint ends (admission set it)
            if prompt_end < len(tokens) // self.page_size:
                # the prompt's checkpoint ends a node of its own: a host copy keeps each node end's window
                self.cache_prefix(namespace, tokens[: prompt_end * self.page_size], state)
            self.windows.trim_for_release(state, len(tokens))  # the tree gets the checkpoint's window only
        keep = len(tokens) // self.page_size if self._insert(namespace, tokens, state) else state.cached_pages
        if self.states is not None:  # (the tree may hold the pages already: a chunk boundary inserted them)
            if self.tree is not None:
                self.states.after_insert(namespace, tokens, state.state)
            self.states.release(state.state)
            state.state = None
        self.allocator.free(state.pages[keep:])
        if self.windows is not None:
            self.windows.release(state)
        if state.node is not None:
            self.tree.dec_lock_ref(state.node)
        state.pages = state.pages[:0]
        state.node = None

    def cache_copy(self, namespace: str, tokens: np.ndarray, state: KVState,
                   copy: Callable[[np.ndarray, np.ndarray], None]) -> int:
        """Cache the whole pages of ``tokens`` under ``namespace``, another than the one the request
        hit (edit reuse's approximate one): its cached pages are copied into fresh ones (``copy(src,
        dst)``, device pages), its own pages go to the tree and leave ``state``. Before the request's
        release only. Returns the pages cached; 0, nothing changed, when no pages are free for the copies."""
        n, held = len(tokens) // self.page_size, state.cached_pages
        if self.tree is None or n <= held:
            return 0
        copies = self._alloc(held, 0, 0)
        if copies is None:
            return 0
        copy(state.pages[:held], copies)
        pages = np.concatenate([copies, state.pages[held:n]])
        already = self.tree.insert(namespace, tokens, pages) // self.page_size
        self.allocator.free(pages[:already])  # what the namespace held already stays; these were not taken
        state.pages = np.concatenate([state.pages[:held], state.pages[n:]])
        state.refresh_slots(self.page_size)
        if self.lower is not None:
            self.lower.on_insert(self.tree.node_at(namespace, tokens))
        return n

    def _insert(self, namespace: str, tokens: np.ndarray, state: KVState) -> bool:
        """Cache the request's pages for the whole pages of ``tokens``; False (nothing changed) when
        there is no tree, the request's cached pages cover them, or sharded and the tree already holds
        this path on another rotation (two new sequences with the same start were admitted before
        either was cached, on different anchors): joining them would put a device page and its host
        copy, or a gather, on different ranks."""
        n_pages = len(tokens) // self.page_size
        if self.tree is None or n_pages <= state.cached_pages:
            return False
        if self.placement is not None:
            if not self.placement.follows_rotation(state.pages[:n_pages]):
                raise AssertionError("a sequence's pages must follow the owner rotation of their positions")
            existing = path_anchor(self.placement, self.tree.peek_prefix(namespace, tokens).node)  # any tier's
            if existing is not None and existing != self.placement.anchor_of(state.pages):
                logger.debug("not caching %d pages of %s: the cached path starts on rank %d, these on rank %d",
                             n_pages, namespace, existing, self.placement.anchor_of(state.pages))
                return False
        parts = {"window": self.windows.offered(state, n_pages)} if self.windows is not None else {}
        if self.states is not None:  # (snapshots come with DeviceStates.after_insert)
            parts[TreeStates.name] = np.zeros(n_pages, dtype=np.int64)
        already = self.tree.insert(namespace, tokens, state.pages[:n_pages], parts) // self.page_size
        # Pages we computed for a span another request cached first are duplicates: free them.
        if already > state.cached_pages:
            self.allocator.free(state.pages[state.cached_pages : already])
        if self.lower is not None:
            self.lower.on_insert(self.tree.node_at(namespace, tokens))
        return True

    def owned_pages(self) -> list[int]:
        """Pages in use (cached or held by requests) on each shard's pool; one entry unsharded."""
        a = self.allocator
        if self.placement is None:
            return [a.capacity - a.available]
        return [a.pages_per_shard - 1 - a.available_on(o) for o in range(self.placement.num_shards)]

    def usage(self) -> dict:
        tree, capacity = self.tree, self.allocator.capacity
        return {
            "page_size": self.page_size,
            "capacity_pages": capacity,
            "free_pages": self.allocator.available,
            "cached_pages": tree.cached_pages if tree else 0,
            "evictable_pages": tree.evictable_pages if tree else 0,
            "locked_pages": tree.protected_pages if tree else 0,
            "request_pages": capacity - self.allocator.available - (tree.cached_pages if tree else 0),
            "device_pool_bytes": self.pool.total_bytes,
            **({"window": self.windows.usage()} if self.windows is not None else {}),
            **({"recurrent_state": self.states.usage()} if self.states is not None else {}),
        }
