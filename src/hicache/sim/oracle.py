"""The offline-optimal eviction order (Belady): a tier that must evict takes the leaf whose next
use is farthest in the future, the ones never used again first.

The oracle reads the whole trace up front: for each block (a dense index of the trace's chained
``hash_ids``: an equal id is an equal block *and* an equal prefix) the sorted indices of the
requests that use it. A tree node's next use is the next use of its first page's block at or
after the request being served (:attr:`NextUse.now`, set by the replay before each request): a
request that uses any page of the node uses its first one (prefixes), and the tree evicts whole
leaves. Plugged into the tree as :attr:`~hicache.cache.leaf_eviction.LeafEviction.eviction_order`,
it orders device and host eviction alike.

Units: request indices in arrival order from 0; synthetic token ids as
:func:`hicache.sim.engine.block_token_ids` makes them (block b: ``b * block_tokens + 1 ...``;
a request's own token is negative and never starts a cached page).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import Iterable, Sequence

from ..cache.tree_node import TreeNode

NEVER = math.inf


class NextUse:
    """Next-use times of blocks, for the requests ``blocks[i]`` (dense block ids of request i,
    prompt order) replayed in order."""

    def __init__(self, blocks: Iterable[Sequence[int]], block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._uses: dict[int, list[int]] = {}
        for i, ids in enumerate(blocks):
            for b in ids:
                uses = self._uses.setdefault(b, [])
                if not uses or uses[-1] != i:  # a block named twice in one prompt is one use
                    uses.append(i)
        self.now = 0  # the request being served

    def next_use(self, block: int, after_now: bool = False) -> float:
        """The index of the first request at or after :attr:`now` (``after_now``: after it) that
        uses ``block``; ``NEVER``."""
        uses = self._uses.get(block, ())
        j = bisect_left(uses, self.now + after_now)
        return uses[j] if j < len(uses) else NEVER

    def block_of(self, token: int) -> int | None:
        """The block a synthetic token id belongs to (None for a request's own token)."""
        return (token - 1) // self.block_tokens if token > 0 else None

    def key(self, node: TreeNode) -> tuple:
        """Eviction order, smallest first: never used again, then farthest next use; node id
        breaks ties (deterministic)."""
        block = self.block_of(int(node.key[0]))
        nxt = NEVER if block is None else self.next_use(block)
        return (-nxt, node.id)
