"""An engine's cache manager and scheduler over a model's pool geometry, its forward a no-op:
capacity, admission, eviction and hits do not depend on the numbers a forward computes, so the
hybrid pool's claims (issue 48, issue 56) are measured and tested at real sizes in seconds.

Gemma 3 270M's geometry by default: 18 layers, 15 of them attending a 512-token window, one KV
head, pages of 16 tokens. Units: tokens unless named pages or bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hicache.cache.manager import KVCacheManager
from hicache.cache.pools import DeviceKVPool
from hicache.runtime.hybrid_pool import HybridPlan
from hicache.runtime.scheduler import SchedulePolicy
from hicache.sim.engine import NoForwardEngine


@dataclass(frozen=True)
class Geometry:
    """A model's KV pool shape: ``layers``, which of them attend a ``window`` of tokens, one KV head
    of ``head_dim`` in ``dtype``, pages of ``page`` tokens."""

    layers: int = 18
    window_layers: frozenset[int] = frozenset(i for i in range(18) if i % 6 != 5)
    window: int = 512
    head_dim: int = 256
    dtype: torch.dtype = torch.float16
    page: int = 16

    @property
    def row_bytes(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.head_dim * torch.finfo(self.dtype).bits // 8

    @property
    def full_page_bytes(self) -> int:
        return self.row_bytes * self.page * (self.layers - len(self.window_layers))

    @property
    def window_page_bytes(self) -> int:
        return self.row_bytes * self.page * len(self.window_layers)


GEMMA3_270M = Geometry()


AUTO = "auto"  # the default: full and window pages share one pool of blocks (issue 56)


def shared_plan(g: Geometry) -> HybridPlan:
    """The shared pool of ``g`` as ``plan_hybrid`` makes it (:mod:`hicache.runtime.hybrid_pool`)."""
    full = [i for i in range(g.layers) if i not in g.window_layers]
    sliding = sorted(g.window_layers)
    n = len(full)
    layout = tuple((full.index(i), 0) if i in full else (sliding.index(i) % n, 1 + sliding.index(i) // n)
                   for i in range(g.layers))
    return HybridPlan(g.window, g.window_layers, None, g.page, layout, n, -(-len(sliding) // n))


class CacheOnly(NoForwardEngine):
    """The cache manager and scheduler of an engine over ``geometry``, pools sized for ``pool_bytes``;
    ``ratio`` None keeps every layer's KV, :data:`AUTO` shares blocks between full and window pages
    (the engine's default), else window pages per full page (``--swa-full-tokens-ratio``)."""

    namespace = "bench"

    def __init__(self, pool_bytes: int, ratio: float | str | None, geometry: Geometry = GEMMA3_270M,
                 chunk: int = 2048, max_running_requests: int = 1) -> None:
        g, windows = geometry, None
        if ratio is None:
            pages = int(pool_bytes // (g.full_page_bytes + g.window_page_bytes)) + 1
        elif ratio == AUTO:
            plan = shared_plan(g)
            pages = int(pool_bytes // (g.row_bytes * g.page * plan.tensors)) + 1  # blocks
            windows, chunk = plan.pool_part(plan.window_ids(pages)), plan.shared_chunk(pages, chunk)
        else:
            plan = HybridPlan(g.window, g.window_layers, ratio, g.page)
            pages = int(pool_bytes // plan.page_cost(g.full_page_bytes, g.window_page_bytes)) + 1
            windows = plan.pool_part(plan.window_pages(pages))
            chunk = plan.prefill_chunk(windows.pages, chunk)
        self.geometry = g
        self.pool = DeviceKVPool(g.layers, 1, g.head_dim, pages, g.page, g.dtype, "cpu", windows)
        super().__init__(KVCacheManager(self.pool), SchedulePolicy(chunk, max_running_requests))

    def serve(self, tokens: list[int]) -> int:
        """Serve one prompt to its first token; its device hit tokens."""
        return super().serve(tokens)["device"]

    def held(self, tokens: list[int]) -> int:
        """Tokens of ``tokens`` a next request would hit (whole pages, window cut-back included)."""
        return self.cache.tree.peek_prefix(self.namespace, np.asarray(tokens, dtype=np.int32)).device_hit_tokens

    def full_use(self) -> float:
        a = self.cache.allocator
        return 1 - a.available / a.capacity
