"""Page placement for KV sharded across ranks (context parallelism; MLA latent sharding).

Every rank of a shard group keeps the same logical radix tree, request tables and logical page
ids; only the pool translates, at the copy boundary. Logical page ``q`` lives on rank
``q mod N`` at that rank's local page ``q // N`` -- arithmetic, no table. Local page 0 of every
rank is the padding page, so logical pages ``0 .. N-1`` are never handed out.

Ownership follows the sequence: the page at position ``i`` of a sequence (0-based, in pages)
belongs to rank ``(anchor + i) mod N``, where the anchor is the owner of the sequence's first
page. A new sequence (nothing cached) is anchored on the rank with the most free pages, so
short sequences spread over the ranks; a sequence that extends a cached path takes that path's
anchor. Two sequences that share a prefix therefore agree on its owners, an extension continues
the rotation (seed, Figure 1a: A/B/C on ranks 0, 1, 0, so D goes to rank 1), and every rank
contributes about 1/N of any long prefix to the per-layer gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class PagePlacement:
    """Where logical pages and slots live among ``num_shards`` ranks (``page_size`` tokens a page)."""

    num_shards: int
    page_size: int

    def __post_init__(self) -> None:
        if self.num_shards < 1 or self.page_size < 1:
            raise ValueError(f"placement needs >= 1 shard and page size >= 1, got {self.num_shards}, {self.page_size}")

    def owner(self, page):
        """The rank that holds logical ``page`` (int or array)."""
        return page % self.num_shards

    def local_page(self, page):
        """The page's index in its owner's pool (int or array)."""
        return page // self.num_shards

    def logical_page(self, owner: int, local_page: int) -> int:
        return local_page * self.num_shards + owner

    def locate(self, slot):
        """``(owner, local row)`` of logical ``slot``: page ``q = slot // p`` on rank ``q mod N``,
        row ``(q // N) * p + slot mod p`` of that rank's buffers."""
        q = slot // self.page_size
        return q % self.num_shards, (q // self.num_shards) * self.page_size + slot % self.page_size

    def owner_at(self, position, anchor: int = 0):
        """The owner of the page at ``position`` (pages from a sequence's start) of a sequence
        whose first page is on rank ``anchor``."""
        return (anchor + position) % self.num_shards

    def anchor_of(self, pages: np.ndarray, first_position: int = 0) -> int:
        """The anchor of the sequence whose pages from ``first_position`` on are ``pages``."""
        return int((self.owner(int(pages[0])) - first_position) % self.num_shards)

    def follows_rotation(self, pages: np.ndarray, first_position: int = 0, anchor: int | None = None) -> bool:
        """Whether ``pages`` (a sequence's pages from ``first_position`` on) sit on the owners the
        rotation gives their positions (from ``anchor``; None: the one their first page implies);
        a tree insert or a reload must never break it."""
        if len(pages) == 0:
            return True
        anchor = self.anchor_of(pages, first_position) if anchor is None else anchor
        positions = np.arange(first_position, first_position + len(pages))
        return bool(np.array_equal(self.owner(np.asarray(pages, dtype=np.int64)), self.owner_at(positions, anchor)))


class ShardedPageAllocator:
    """Logical page ids for a shard group: one free list per owner, ``pages_per_shard`` local
    pages each (local page 0 reserved). :meth:`alloc` hands out pages that continue a sequence's
    owner rotation. Like :class:`~hicache.cache.pools.PageAllocator`, the order is a pure
    function of the alloc/free sequence, so every rank computes the same ids (DESIGN invariant 3).
    """

    def __init__(self, placement: PagePlacement, pages_per_shard: int) -> None:
        if pages_per_shard < 2:
            raise ValueError("each shard needs at least one usable page besides its padding page 0")
        self.placement = placement
        self.pages_per_shard = pages_per_shard
        self.num_pages = placement.num_shards * pages_per_shard  # logical ids 0 .. num_pages-1
        self.capacity = self.num_pages - placement.num_shards  # usable logical pages (no shard's padding page)
        n = placement.num_shards  # each owner's free pages, in descending order
        self._free = [list(range(self.num_pages + owner - n, owner, -n)) for owner in range(n)]

    @property
    def available(self) -> int:
        return sum(len(free) for free in self._free)

    def available_on(self, owner: int) -> int:
        return len(self._free[owner])

    def roomiest_owner(self) -> int:
        """The owner with the most free pages (the lowest on ties): where a new sequence starts."""
        return max(range(self.placement.num_shards), key=lambda o: (len(self._free[o]), -o))

    def alloc(self, n: int, first_position: int = 0, anchor: int = 0) -> np.ndarray | None:
        """``n`` logical pages for positions ``first_position ..`` of a sequence anchored on rank
        ``anchor``, each on the owner the rotation gives it; None (and no change) when an owner
        runs short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        owners = self.placement.owner_at(np.arange(first_position, first_position + n), anchor)
        need = np.bincount(owners, minlength=self.placement.num_shards)
        if any(need[o] > len(self._free[o]) for o in range(self.placement.num_shards)):
            return None
        # Each free list is kept in descending order: pop() hands out the lowest id first.
        return np.array([self._free[o].pop() for o in owners], dtype=np.int64)

    def free(self, pages: np.ndarray) -> None:
        pages = np.asarray(pages, dtype=np.int64)
        if len(pages) and pages.min() < self.placement.num_shards:
            raise ValueError("a shard's padding page (logical 0 .. N-1) is never allocated, so never freed")
        owners = self.placement.owner(pages)
        for owner in np.unique(owners).tolist():
            # Descending order: pop() hands out the lowest id, a pure function of the operations.
            self._free[owner] = sorted(self._free[owner] + pages[owners == owner].tolist(), reverse=True)


@dataclass(frozen=True)
class GatherPlan:
    """How a sharded prefix is gathered for one layer (seed, Figure 1b).

    Each rank contributes ``contributions[rank]``: the local pages it owns of the prefix, in
    sequence order, padded with its padding page 0 to the longest rank's count, so every rank
    sends the same number of pages. The all-gather lays them out owner after owner; ``page_table``
    gives, for the prefix's pages in logical order, their page index in that gathered buffer, so
    attention reads A, B, C in order without moving a page.
    """

    contributions: list[np.ndarray]  # [N] local page ids per rank, each of length pages_per_rank
    page_table: np.ndarray  # [len(prefix)] index into the gathered [N * pages_per_rank] pages

    @classmethod
    def for_prefix(cls, placement: PagePlacement, pages: np.ndarray) -> "GatherPlan":
        pages = np.asarray(pages, dtype=np.int64)
        owners = placement.owner(pages)
        counts = np.bincount(owners, minlength=placement.num_shards)
        width = int(counts.max()) if len(pages) else 0
        contributions = [np.zeros(width, dtype=np.int64) for _ in range(placement.num_shards)]
        page_table = np.empty(len(pages), dtype=np.int64)
        for owner, local in enumerate(contributions):  # each rank's pages, in sequence order
            idx = np.flatnonzero(owners == owner)
            local[: len(idx)] = placement.local_page(pages[idx])
            page_table[idx] = owner * width + np.arange(len(idx))
        return cls(contributions, page_table)


@dataclass(frozen=True)
class ShardView:
    """One rank's side of a placement: which of a list of logical pages it holds, and where.
    Copies between tiers (device <-> host <-> storage) move only these pages: a sequence's
    device and host pages follow the same rotation, so both ends of a copy share an owner."""

    placement: PagePlacement
    rank: int

    def owned_indices(self, pages: np.ndarray) -> np.ndarray:
        """Indices of the ``pages`` (logical ids) this rank holds."""
        return np.flatnonzero(self.owned(pages))

    def owned(self, pages: np.ndarray) -> np.ndarray:
        """Mask of ``pages`` (logical ids) held by this rank."""
        return self.placement.owner(np.asarray(pages, dtype=np.int64)) == self.rank

    def local(self, pages: np.ndarray) -> np.ndarray:
        """This rank's pool page ids of ``pages`` (meaningful for owned ones only)."""
        return self.placement.local_page(np.asarray(pages, dtype=np.int64))


def alloc_evicting(allocator: "ShardedPageAllocator | object", n: int, first_position: int,
                   evict: Callable[..., int] | None, anchor: int = 0) -> tuple[np.ndarray | None, int]:
    """``n`` pages for positions ``first_position ..`` of a sequence (anchored on ``anchor``), calling ``evict(pages)``
    (returns the pages it freed) while they do not fit. Sharded, every owner needs its share:
    ``evict(pages, wanted)`` takes only leaves holding a page on a short owner, repeated until
    they fit or nothing is left to evict.
    Returns the pages (None: they do not fit) and the pages evicted."""
    evicted = 0
    while (pages := allocator.alloc(n, first_position, anchor)) is None and evict is not None:
        if isinstance(allocator, ShardedPageAllocator):
            placement = allocator.placement
            need = np.bincount(placement.owner_at(np.arange(first_position, first_position + n), anchor),
                               minlength=placement.num_shards)
            missing = [max(0, int(need[o]) - allocator.available_on(o)) for o in range(placement.num_shards)]
            owners = [o for o, m in enumerate(missing) if m]
            freed = evict(sum(missing), lambda pages: bool(np.isin(placement.owner(pages), owners).any()))
        else:
            freed = evict(max(0, n - allocator.available))
        evicted += freed
        if freed == 0:
            return None, evicted
    return pages, evicted


def path_anchor(placement: PagePlacement, node) -> int | None:
    """The rotation anchor of the cached tree path through ``node`` (its first node's device or
    host pages; a path keeps one rotation in every tier), or None when there is no node."""
    if node is None or node.is_root:
        return None
    *_, node = node.lineage()  # the path's first node
    return placement.anchor_of(node.device_pages if node.device_pages is not None else node.host_pages)
