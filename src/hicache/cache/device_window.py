"""The device tier's sliding-window component (a hybrid pool, issue 48): each running request's
window pages, and the budget that admission reserves for them.

A request holds window pages only for the positions its next forward reads or writes: from the
first page of the window of its last page boundary (:func:`~.window_tree.window_first_page`; kept
so that boundary is a usable hit when the request finishes: the turn's checkpoint) through its new
tokens, and the window of its prompt's last boundary (the prompt's checkpoint: the same prompt
again, a regenerated answer, hit it; at release it ends a node of the tree, so each checkpoint is
a node's end, which is what a host copy keeps of the window layers). Pages it owns fall behind and are freed as it advances;
pages in the tree (a hit, a chunk it cached) are locked through the tree only while its window
reaches them, then stay as evictable cache.

The budget: a request never holds more than ``footprint(n)`` window pages while its forwards add
at most ``n`` tokens each, nor more than one per page of its sequence (prompt and most output), so
admission reserves the smaller (:meth:`DeviceWindows.budget`; all running requests' reservations fit
in the component) and every later allocation succeeds after evicting unlocked window pages. A
waiting request's next forward is its first prompt chunk, not a decode step: the scheduler says so.

Units: pages unless named tokens; page indices count from the sequence's start.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .placement import alloc_evicting
from .pools import DeviceKVPool, PageAllocator, SharedWindowAllocator, free_held, pages_to_slots
from .radix import RadixCache
from .tiers import CacheStats
from .window_tree import path_spans, window_first_page


def window_footprint(window: int, page_size: int, forward_tokens: int) -> int:
    """Most window pages a request holds while each forward adds <= ``forward_tokens``: the tree
    span it locks (at most a window, from its last cached boundary), its prompt's checkpoint and
    its own pages from its checkpoint's window (a window and a page behind its next token) through
    the new tokens; each range may straddle one page more."""
    ps = page_size
    span = -(-(window - 1) // ps) + 1  # one window's pages
    return 2 * span + -(-(window - 1 + ps + forward_tokens) // ps) + 1  # + the prompt's checkpoint


def largest_forward(window: int, page_size: int, pages: int) -> int:
    """The most tokens (whole pages, >= 0) one forward may add for a request's footprint to fit in
    ``pages`` window pages: each page a forward adds grows the footprint by exactly one page."""
    return max(pages - window_footprint(window, page_size, 0), 0) * page_size


@dataclass
class WindowHold:
    """One request's hold on the window component (``KVState.window``). ``pages[i]``: page i's window
    page (0: not held for this request), the tree's below the state's ``cached_pages`` (locked from
    ``lock``'s first page to its end page through the state's node), its own above; ``slots``: their
    slots in order (``[groups, tokens]`` on shared blocks); ``budget``: window pages reserved (its
    ``len(pages)`` pages are counted in ``DeviceWindows.held_pages``); ``keep``: the page range
    of its own window pages kept to the end (its prompt's checkpoint, see ``DeviceWindows.prompt_only``);
    ``prompt_end``: the last boundary (pages) a match of its prompt reaches, where the checkpoint
    ends a node at release; ``arrival`` (P/D decode): (first token, slot per token) where the
    prompt's window tail arrives."""

    pages: np.ndarray
    slots: torch.Tensor | None = None
    budget: int = 0
    lock: tuple[int, int] | None = None  # (end page, first page) of the tree span window-locked
    keep: tuple[int, int] | None = None
    prompt_end: int = 0
    arrival: tuple[int, torch.Tensor] | None = None


class DeviceWindows:
    """Window pages of running requests over ``allocator`` (the component's page ids) of ``pool``'s
    window layers, with the tree (None: prefix reuse off) holding those of cached pages."""

    def __init__(self, allocator: PageAllocator | SharedWindowAllocator, tree: RadixCache | None, stats: CacheStats,
                 pool: DeviceKVPool) -> None:
        self.allocator, self.tree, self.stats, self.pool = allocator, tree, stats, pool
        self.window, self.page_size = pool.windows.window, pool.page_size
        self.cached = tree.windows if tree is not None else None  # the window pages of cached pages (TreeWindows)
        self.reserved = 0  # window pages reserved by running requests (the sum of their budgets)
        # A shared pool (issue 56): window pages take ``groups`` blocks each from the full pages' allocator;
        # admission keeps room for the running requests' pages and their budgets' blocks (see :meth:`fits`).
        self.shared = isinstance(allocator, SharedWindowAllocator)
        self.held_pages = 0  # shared: full pages of running requests (hits included; shared hits counted twice)
        # Waits for the host backups in flight and applies their acks (set by the cache with a host tier): a
        # backup window-locks its node's checkpoint until its copy has read it, which no budget counts.
        self.settle_backups: Callable[[], None] | None = None
        # Finished requests cache their prompt's pages only (--cache-generated-kv; set by the cache): the last
        # boundary they cache is the prompt's last whole page, which the next turn hits, so a request keeps its
        # window too (a page more than the prompt's checkpoint where the prompt fills its last page; within the
        # footprint's allowance for the checkpoint, which may straddle one page more).
        self.prompt_only = False

    def first_page(self, boundary_tokens: int) -> int:
        return window_first_page(boundary_tokens, self.window, self.page_size)

    def footprint(self, forward_tokens: int) -> int:
        return window_footprint(self.window, self.page_size, forward_tokens)

    def budget(self, forward_tokens: int, sequence_pages: int) -> int:
        """Window pages a request reserves: its footprint while forwards add <= ``forward_tokens``,
        at most one per page of its sequence (``sequence_pages``: prompt and most output), since
        every window page it holds or locks is the window KV of one of its positions."""
        return min(self.footprint(forward_tokens), sequence_pages)

    # ---- a request's life ------------------------------------------------------------------
    def fits(self, forward_tokens: int, sequence_pages: int) -> bool:
        """Whether a request whose forwards add <= ``forward_tokens`` fits beside the reservations
        of the running ones. Shared: its ``sequence_pages`` and every budget's blocks fit beside the
        running requests' pages (all else -- tree pages and windows no one locks -- can be evicted)."""
        need = self.reserved + self.budget(forward_tokens, sequence_pages)
        if self.shared:
            a = self.allocator
            return self.held_pages + sequence_pages + need * a.groups <= a.blocks.capacity
        return need <= self.allocator.capacity

    def tail_page(self, prompt_tokens: int) -> int:
        """First page of a prompt's fresh SWA tail: the window of its last boundary (its checkpoint),
        which also covers what its first decode step reads."""
        return self.first_page((prompt_tokens - 1) // self.page_size * self.page_size)

    def lock_hit(self, node, end_page: int, arriving: int | None = None) -> tuple[int, int] | None:
        """Window-lock the span a hit of ``end_page`` pages ending at ``node`` reads (splitting the
        node that holds its first page: done before the hit's host nodes are listed); the lock.
        ``arriving``: the prompt's length when its window arrives from elsewhere (P/D): the span
        locked is the part of its tail the hit covers."""
        if self.tree is None or end_page == 0:
            return None
        first = self.first_page(end_page * self.page_size) if arriving is None else self.tail_page(arriving)
        if first >= end_page:
            return None
        self.cached.lock(node, end_page, first)
        return end_page, first

    def admit(self, state, lock: tuple[int, int] | None, device_window: np.ndarray | None, host_nodes: list,
              forward_tokens: int, prompt_tokens: int, arriving: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
        """Reserve ``state``'s budget (see :meth:`fits`) and take the hit's window under ``lock``
        (:meth:`lock_hit`): ``device_window``, the device hit's window pages in the tree, where the
        device holds a tombstone a device window page for its host copy; then, for ``host_nodes``
        (the host hit, given device pages and loaded back), device window pages for the host
        windows inside the hit's window (the host tier loads them with the rest). Returns the
        (device, host) window pages of the device hit to load from the host."""
        budget = self.budget(forward_tokens, len(state.pages))
        self.reserved += budget
        self.held_pages += len(state.pages)
        device_hit = len(device_window) if device_window is not None else 0
        prompt_end = (prompt_tokens - 1) // self.page_size  # the last boundary a match of the prompt reaches
        keep_end = prompt_tokens // self.page_size if self.prompt_only else prompt_end  # (see prompt_only)
        # the lock was taken before allocating: tombstoning spares the hit's window
        state.window = WindowHold(np.zeros(len(state.pages), dtype=np.int64), budget=budget, lock=lock,
                                  keep=(self.tail_page(prompt_tokens), keep_end), prompt_end=prompt_end)
        if device_hit:
            state.window.pages[:device_hit] = device_window
        if arriving:
            self._hold_tail(state, prompt_tokens)
            return []
        restored = self._from_host(state, self.first_page(state.cached_pages * self.page_size), device_hit, host_nodes)
        state.window.slots = self._slots(state.window.pages)
        return restored

    def _from_host(self, state, first: int, device_hit: int, host_nodes: list) -> list[tuple[np.ndarray, np.ndarray]]:
        """Device window pages for the hit's pages ``first ..`` whose host copy holds their window and
        the device does not (the match counted those as held): the device hit's tombstones, then the
        host hit's pages, given to their nodes; the (device, host) pairs of the device hit's to load
        (the host tier loads the host hit's with the rest)."""
        # (node, its first page, in the device hit): the device hit's nearest first
        last = host_nodes[0].parent if host_nodes else state.node
        spans = [(node, start, True) for node, start in path_spans(last, device_hit, first, self.page_size)]
        starts = itertools.accumulate((node.num_pages for node in host_nodes), initial=device_hit)
        spans += [(node, start, False) for node, start in zip(host_nodes, starts)]  # then the host hit's, in path order
        loads = []
        for node, start, device_hit_node in spans:
            part = self.cached.of(node)
            if part.host is None:
                continue
            idx = np.arange(max(first - start, 0), node.num_pages)
            idx = idx[(part.device[idx] == 0) & (part.host[idx] != 0)]
            if len(idx):
                self.cached.give(node, idx, self.alloc(len(idx)))
                state.window.pages[start + idx] = part.device[idx]
                if device_hit_node:
                    loads.append((part.device[idx], part.host[idx]))
        return loads

    def _hold_tail(self, state, prompt_tokens: int) -> None:
        """P/D decode: window pages for the prompt's fresh SWA tail (``state.window.arrival``: its
        first token, and the slot of each token's arriving row). Cached pages of the tail whose
        window the tree holds keep it (their rows land in the padding page); tombstoned ones get a
        page, given to their node; the request's own get theirs."""
        ps, wp = self.page_size, state.window.pages
        tail, hit = self.tail_page(prompt_tokens), state.cached_pages
        arriving = np.zeros(len(wp), dtype=np.int64)
        for node, start in path_spans(state.node, hit, tail, self.page_size):  # the hit's part (split at the tail)
            idx = np.arange(max(tail - start, 0), node.num_pages)
            node_window = self.cached.of(node).device  # filled in place by give()
            fresh = idx[node_window[idx] == 0]
            self.cached.give(node, fresh, self.alloc(len(fresh)))
            wp[start + idx] = node_window[idx]
            arriving[start + fresh] = node_window[fresh]
        own = np.arange(max(tail, hit), -(-prompt_tokens // ps))
        wp[own] = arriving[own] = self.alloc(len(own))
        state.window.arrival = (tail * ps, self._slots(arriving))
        state.window.slots = self._slots(wp)

    def step(self, state, computed: int, new_tokens: int, later_tokens: int) -> None:
        """Before a forward that adds ``new_tokens`` after ``computed``: free the request's own
        pages behind its checkpoint's window, hold pages for the new tokens, and shrink the budget
        to what forwards of <= ``later_tokens`` need from now on."""
        keep = self.first_page(computed - computed % self.page_size)
        self._free_own(state, keep)
        wp = state.window.pages
        wp[:min(keep, state.cached_pages)] = 0  # the tree's, unread from now on (evictable once unlocked)
        span = slice(computed // self.page_size, -(-(computed + new_tokens) // self.page_size))
        missing = np.flatnonzero(wp[span] == 0) + span.start
        if len(missing):
            if missing[0] < state.cached_pages:
                raise AssertionError("a request's window reaches a cached page whose window KV is not held")
            wp[missing] = self.alloc(len(missing))
            # only the new pages' slots change (freed pages' slots are never read again): no O(context) rebuild
            rows = torch.from_numpy((missing[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1))
            state.window.slots[..., rows] = self._slots(wp[missing])  # shared: each sliding group's row
        budget = self.budget(max(new_tokens, later_tokens), len(wp))
        if budget < state.window.budget:
            self.reserved -= state.window.budget - budget
            state.window.budget = budget

    def unlock(self, node, lock: tuple[int, int] | None) -> None:
        """Take off a window lock of :meth:`lock_hit` (None: it took none)."""
        if lock is not None:
            self.cached.unlock(node, *lock)

    def before_insert(self, state) -> None:
        """The request's pages are about to join the tree: its window lock comes off (it is placed
        again over the new boundary by :meth:`after_insert`)."""
        self.unlock(state.node, state.window.lock)
        state.window.lock = None

    def offered(self, state, n_pages: int) -> np.ndarray:
        """The window pages an insert of the first ``n_pages`` gives the tree: the request's own
        (from its cached boundary on), 0 for the pages the tree has (it keeps its own). Its window
        lock comes off first (:meth:`after_insert` places it again over the new boundary)."""
        self.before_insert(state)
        offer = state.window.pages[:n_pages].copy()
        offer[:state.cached_pages] = 0
        state.window.pages[state.cached_pages:n_pages] = 0  # handed over: the tree keeps or frees each
        return offer

    def after_insert(self, state, hit_window: np.ndarray) -> None:
        """``state`` now holds the tree's first ``cached_pages`` (their window: ``hit_window``):
        lock the window of its new boundary."""
        n = state.cached_pages
        first = self.first_page(n * self.page_size)
        state.window.pages[first:n] = hit_window[first:n]
        state.window.lock = self.lock_hit(state.node, n)
        state.window.slots = self._slots(state.window.pages)

    def release(self, state) -> None:
        """The request is done: every window page it still owns goes back, its reservation too."""
        self.before_insert(state)
        self._free_own(state, len(state.window.pages))  # its prompt's checkpoint too
        self.reserved -= state.window.budget
        state.window.budget = 0
        self.held_pages -= len(state.window.pages)

    def trim_for_release(self, state, computed: int) -> None:
        """Before the final insert: free own pages behind the window of the last boundary of the
        ``computed`` tokens, so the tree receives just that boundary's window (the checkpoint)."""
        self._free_own(state, self.first_page(computed - computed % self.page_size))

    # ---- helpers ---------------------------------------------------------------------------
    def _slots(self, pages: np.ndarray) -> torch.Tensor:
        """The slots of window ``pages`` (0: not held): ``[tokens]``, or ``[groups, tokens]`` shared."""
        if not self.shared:
            return pages_to_slots(pages, self.page_size)
        return torch.stack([pages_to_slots(self.pool.windows.rows(pages, k), self.page_size)
                            for k in range(self.pool.windows.groups)])

    def alloc(self, n: int) -> np.ndarray:
        """``n`` window pages, tombstoning unlocked windows while they do not fit (the running
        requests' budgets guarantee they do then)."""
        pages = self._alloc_evicting(n)
        if pages is None and self.settle_backups is not None:  # the rest is locked by copies still reading it
            self.settle_backups()
            pages = self._alloc_evicting(n)
        if pages is None:
            raise AssertionError(f"the window component cannot hold {n} pages within the reserved budgets")
        return pages

    def _alloc_evicting(self, n: int) -> np.ndarray | None:
        if self.shared:  # (make_room counts what it evicts)
            groups = self.allocator.groups
            return alloc_evicting(self.allocator, n, 0, lambda short: self.make_room(short * groups))[0]
        pages, evicted = alloc_evicting(self.allocator, n, 0, self.cached.evict if self.cached is not None else None)
        self.stats.evicted_window_pages += evicted
        return pages

    def make_room(self, blocks: int) -> int:
        """Shared pool: free at least ``blocks`` blocks if the tree can: window pages no checkpoint needs
        first, then whole nodes (tombstoned leaves first, then least recently used), then checkpoints
        of nodes a running request holds but whose window no one locks. Returns the blocks freed."""
        a = self.allocator.blocks
        if self.tree is None:
            return 0
        start, g = a.available, self.allocator.groups
        for step in ("spare", "nodes", "checkpoints"):
            short = blocks - (a.available - start)
            if short <= 0:
                break
            if step == "nodes":
                self.stats.evicted_device_pages += self.tree.evict(short)
            else:
                self.stats.evicted_window_pages += self.cached.evict(-(-short // g), spare_only=step == "spare")
        return a.available - start

    def _free_own(self, state, before: int) -> None:
        """Free the request's own window pages (those past its cached pages) before page ``before``,
        but its prompt's checkpoint (``keep``) while the request lasts."""
        own = np.zeros(len(state.window.pages), dtype=bool)
        own[state.cached_pages:before] = True
        if state.window.keep is not None and before < len(state.window.pages):
            own[slice(*state.window.keep)] = False
        free_held(self.allocator, state.window.pages, own)

    def usage(self) -> dict:
        """The window component's pages and bytes (``/stats``' ``window``; the device tier's own fields are
        the full component's). A shared pool: capacity_pages are the window pages the blocks could hold,
        pool_bytes the whole pool's."""
        a, pool, w, ps = self.allocator, self.pool, self.pool.windows, self.page_size
        out = {"capacity_pages": a.capacity, "free_pages": a.available, "reserved_pages": self.reserved}
        if self.tree is not None:
            out.update(self.cached.usage())
        out.update(evicted_pages=self.stats.evicted_window_pages, window_tokens=self.window,
                   capacity_tokens=a.capacity * ps, cached_tokens=out.get("cached_pages", 0) * ps,
                   page_bytes=w.bytes_per_page)
        if self.shared:
            out.update(pool_bytes=pool.total_bytes, full_pool_bytes=pool.total_bytes, shared_blocks=True,
                       groups=w.groups)
        else:
            out.update(pool_bytes=w.bytes_per_page * w.pages,
                       full_pool_bytes=pool.bytes_per_page * pool.num_pages)
        return out
