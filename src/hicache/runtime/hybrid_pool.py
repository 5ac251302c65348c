"""How a hybrid model's device pool is split (issue 48): its full-attention layers keep every
cached page, its sliding-window layers a component of their own sized by
``--swa-full-tokens-ratio`` (see :mod:`hicache.cache.device_window`).

Units: pages (of ``--page-size`` tokens) unless named tokens; layer indices are this rank's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..cache.device_window import largest_forward, window_footprint
from ..config import ConfigError, EngineConfig
from ..model.spec import ModelSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HybridPlan:
    """A window component for ``window_layers`` (this rank's sliding layers) of ``window`` tokens,
    ``ratio`` of its pages per page of the full layers."""

    window: int
    window_layers: frozenset[int]
    ratio: float
    page_size: int

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

    def saves_memory(self, full_pages: int, window_pages: int) -> bool:
        """Whether the component holds fewer pages than the full layers (else keeping every layer's
        KV costs less)."""
        return window_pages < full_pages


def plan_hybrid(cfg: EngineConfig, spec: ModelSpec, layers: range) -> HybridPlan | None:
    """The window component of a model with sliding-window layers (``layers``: this rank's, global
    indices); None when every layer keeps its KV (a full-attention model, or the flag). A mode the
    window component does not cover is refused in one sentence."""
    if not spec.has_sliding_layers or cfg.disable_hybrid_swa_memory:
        return None
    if cfg.hicache_storage_key_scheme == "unified" and cfg.hicache_storage_backend and cfg.speculative_algorithm \
            and cfg.speculative_algorithm != "NGRAM":
        raise ConfigError(f"{cfg.model} has sliding-window layers, and a speculative draft model's cells on the unified "
                          "storage grid are not planned beside a window pool yet; use --hicache-storage-key-scheme "
                          "rank-suffix, or --disable-hybrid-swa-memory to keep every layer's KV.")
    local = frozenset(i for i, layer in enumerate(layers) if spec.layer_window(layer))
    return HybridPlan(spec.sliding_window, local, cfg.swa_full_tokens_ratio, cfg.page_size)
