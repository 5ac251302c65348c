"""How a hybrid model's device pool is split (issue 48): its full-attention layers keep every
cached page, its sliding-window layers a component of their own sized by
``--swa-full-tokens-ratio`` (see :mod:`hicache.cache.device_window`) -- or, by default, the split
follows demand (issue 56): one pool of blocks both draw from (:class:`~hicache.cache.pools.
SharedWindowAllocator`). G = the model's full-attention layer count (global, so every rank agrees),
plus a packed speculative draft's layers (they keep every page, as full layers do); a block is one
page of G layers. The full layers are group 0 (layer of full index j in tensor j, then the draft's
layer d in tensor F + d: a full page is one block); the sliding layers groups 1.. of G (sliding
index s: group 1 + s // G, tensor s % G; the last group may be short), and a window page is one
block of each.

Units: pages (of ``--page-size`` tokens) unless named tokens; layer indices are this rank's.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ..cache.device_window import largest_forward, window_footprint
from ..cache.pools import WindowLayout
from ..config import EngineConfig
from ..model.spec import ModelSpec
from .speculative import DraftKV

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HybridPlan:
    """A window component for ``window_layers`` (this rank's sliding layers) of ``window`` tokens,
    ``ratio`` of its pages per page of the full layers."""

    window: int
    window_layers: frozenset[int]
    ratio: float | None  # None: shared blocks (the split follows demand)
    page_size: int
    layout: tuple[tuple[int, int], ...] = ()  # shared: (tensor, group) of each of this rank's layers
    tensors: int = 0  # shared: G
    groups: int = 0  # shared: sliding groups of the model (blocks per window page)

    # With --max-total-tokens N (its full layers' tokens) a shared pool holds N's pages and as many
    # window pages as the default ratio gives (the bytes a fixed split at the default would take).
    DEFAULT_RATIO = 0.8

    @property
    def shared(self) -> bool:
        return self.ratio is None

    def pool_part(self, pages: int) -> WindowLayout:
        """The device pool's window part, of ``pages`` window pages (+ page 0)."""
        shared = dict(enumerate(self.layout)) if self.shared else None
        return WindowLayout(self.window_layers, pages, self.window, shared, self.groups or 1)

    def blocks_for_tokens(self, full_pages: int) -> int:
        """Blocks (+ page 0) of a shared pool sized by --max-total-tokens (``full_pages`` + page 0)."""
        return full_pages + math.ceil(self.groups * self.DEFAULT_RATIO * (full_pages - 1))

    def window_ids(self, blocks: int) -> int:
        """Window page ids (+ page 0) of a shared pool of ``blocks`` (+ page 0): as many as the blocks hold."""
        return (blocks - 1) // self.groups + 1

    def shared_chunk(self, blocks: int, chunk: int) -> int:
        """The prefill chunk of a shared pool: a lone request's window footprint takes at most half the blocks."""
        return self.prefill_chunk((blocks - 1) // (2 * self.groups) + 1, chunk)

    def shared_fits(self, blocks: int) -> bool:
        """Whether half a shared pool holds one request's windows a window at a time (else keep every layer)."""
        least = window_footprint(self.window, self.page_size, max(self.window, self.page_size))
        return (blocks - 1) // (2 * self.groups) >= least

    def page_cost(self, full_page_bytes: int, window_page_bytes: int) -> float:
        """Bytes the pool spends per full-layer page, its share of window pages included."""
        return full_page_bytes + self.ratio * window_page_bytes

    def window_pages(self, full_pages: int) -> int:
        """Window pages (+ the reserved page 0) beside ``full_pages`` (+ page 0): the ratio's, at
        least the footprint of one request computing its prompt a window (or a page) at a time."""
        least = window_footprint(self.window, self.page_size, max(self.window, self.page_size))
        return max(int(self.ratio * (full_pages - 1)), least) + 1

    def prefill_chunk(self, window_pages: int, chunk: int) -> int:
        """The prefill chunk (tokens), at most ``chunk``, whose footprint fits in the component (at
        least a page: :meth:`window_pages` leaves room for a window's)."""
        return max(min(chunk, largest_forward(self.window, self.page_size, window_pages - 1)), self.page_size)


def plan_hybrid(cfg: EngineConfig, spec: ModelSpec, layers: range, draft_kv: DraftKV | None = None) -> HybridPlan | None:
    """The window component of a model with sliding-window layers (``layers``: this rank's, global
    indices; ``draft_kv``: a speculative draft's KV on this rank, whose packed layers follow them);
    None when every layer keeps its KV (a full-attention model, or the flag)."""
    if not spec.has_sliding_layers or cfg.disable_hybrid_swa_memory:
        return None
    local = frozenset(i for i, layer in enumerate(layers) if spec.layer_window(layer))
    full = [layer for layer in range(spec.num_layers) if not spec.layer_window(layer)]
    ratio = cfg.swa_full_tokens_ratio
    uncovered = _not_shared(cfg, bool(full), draft_kv)
    if ratio is None and uncovered:
        ratio = HybridPlan.DEFAULT_RATIO
        logger.info("the window pool is sized by the default --swa-full-tokens-ratio %.1f (shared blocks do not cover "
                    "%s yet)", ratio, uncovered)
    if ratio is not None:
        return HybridPlan(spec.sliding_window, local, ratio, cfg.page_size)
    sliding = [layer for layer in range(spec.num_layers) if spec.layer_window(layer)]
    draft = draft_kv.layers if draft_kv is not None else 0  # packed here (a sidecar took the fixed split)
    g = len(full) + draft
    layout = tuple((full.index(layer), 0) if layer in full else (sliding.index(layer) % g, 1 + sliding.index(layer) // g)
                   for layer in layers) + tuple((len(full) + d, 0) for d in range(draft))
    return HybridPlan(spec.sliding_window, local, None, cfg.page_size, layout, g, -(-len(sliding) // g))


def _not_shared(cfg: EngineConfig, has_full: bool, draft_kv: DraftKV | None) -> str:
    """What keeps a default pool off shared blocks, for the log line ("": nothing)."""
    if not has_full:
        return "a model without full-attention layers"
    if draft_kv is not None and not draft_kv.packed:
        return "a sidecar draft model (its pool is indexed by page id: it would need a row per block)"
    if cfg.uses_draft_model and cfg.pp_size > 1:
        return "a draft model across pipeline stages (later stages do not load it: their G would differ)"
    return ""
