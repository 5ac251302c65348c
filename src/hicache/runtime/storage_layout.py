"""The unified storage layout of a deployment (``--hicache-storage-key-scheme unified``): every
rank's cells of the grid, planned from every rank's shard, and the report external routers read
(``GET /get_hicache_l3_cache_layout``)."""

from __future__ import annotations

from typing import Any

import torch

from ..cache.storage.page_objects import DRAFT_PREFIX, NAMESPACE_KEY_HEX, WINDOW_SUFFIX
from ..cache.storage.state_cells import StateCells, StateGrid, StateLayer, StateShard, plan_states
from ..cache.storage.unified import RankShard, StorageGrid, UnifiedPlan, plan_rank
from ..config import EngineConfig
from ..model.parallel import ModelShard, model_shard, state_axis
from ..model.spec import ModelSpec

KEY_PATTERN = "{page_hash}_{namespace_digest}_L{start_layer}-{end_layer}[_H{head_group}]"
# a recurrent-state snapshot's cells, at its boundary's page
STATE_PATTERN = "{page_hash}_{namespace_digest}_L{start_layer}-{end_layer}_G{state_group}_state (at snapshots)"


def stage_holders(cfg: EngineConfig) -> int:
    """How many ranks of a pipeline stage plan their objects together: every TP rank when each
    holds every page (the lowest holder of a cell writes it); with page-sharded KV (CP) only the
    attention-TP ranks of one CP rank, which together hold the pages that CP rank owns (its
    owner writes a page's objects); an MLA latent sharded over the TP ranks: one."""
    if not cfg.enable_kv_cache_sharding:
        return cfg.tp_size
    return cfg.tp_size // cfg.attn_cp_size if cfg.attn_cp_size > 1 else 1


def plan_index(cfg: EngineConfig, pp_rank: int, tp_rank: int) -> int:
    """Which of :func:`unified_plans` is the rank at (``pp_rank``, ``tp_rank``)'s."""
    holders = stage_holders(cfg)
    return pp_rank * holders + tp_rank % holders


def unified_plans(cfg: EngineConfig, spec: ModelSpec, draft: ModelSpec | None = None) -> list[UnifiedPlan]:
    """The plans of a stage's holders (:func:`stage_holders`), stage after stage; [] when the
    key scheme is not unified. ``draft``: the speculative draft's spec (its cells are planned
    on the first stage). Raises ConfigError when a shard does not align with a grid."""
    if cfg.hicache_storage_key_scheme != "unified" or not cfg.hicache_storage_backend:
        return []
    grid, shards = _grid_and_shards(cfg, spec, cfg.pp_size)
    drafts: list[UnifiedPlan | None] = [None] * len(shards)
    if draft is not None:
        draft_grid, draft_shards = _grid_and_shards(cfg, draft, 1)
        for s in draft_shards:
            drafts[s.rank] = UnifiedPlan(draft_grid, s, plan_rank(draft_grid, draft_shards, s.rank))
    states = _state_cells(cfg, spec, grid)
    return [UnifiedPlan(grid, s, plan_rank(grid, shards, s.rank), d, st) for s, d, st in zip(shards, drafts, states)]


def _model_shards(cfg: EngineConfig, spec: ModelSpec, pp_size: int) -> list[ModelShard]:
    """``spec``'s shards over ``pp_size`` stages of :func:`stage_holders` ranks (rank = stage x
    holders + position)."""
    holders, attn_tp = stage_holders(cfg), cfg.tp_size // cfg.attn_cp_size
    # CP ranks hold the same heads
    return [model_shard(spec, t % attn_tp, attn_tp, p, pp_size) for p in range(pp_size) for t in range(holders)]


def _grid_and_shards(cfg: EngineConfig, spec: ModelSpec, pp_size: int) -> tuple[StorageGrid, list[RankShard]]:
    """The grid the partition flags give ``spec``, and its shards over ``pp_size`` stages (a model with
    recurrent layers: the layers of each stage with KV named, its KV pool holds only those)."""
    grid = StorageGrid(spec.num_layers, spec.num_kv_heads,
                       min(cfg.hicache_storage_layer_partition or spec.num_layers, spec.num_layers),
                       cfg.hicache_storage_head_partition, spec.is_mla)
    recurrent = bool(spec.recurrent_layers)
    return grid, [RankShard(r, s.layers, s.kv_heads,
                            tuple(i for i in s.layers if not spec.is_recurrent(i)) if recurrent else None)
                  for r, s in enumerate(_model_shards(cfg, spec, pp_size))]


def _state_cells(cfg: EngineConfig, spec: ModelSpec, grid: StorageGrid) -> list[StateCells | None]:
    """Each rank's cells of a snapshot of the recurrent layers (None without any): the page grid's layer
    ranges x state groups, as many as the grid's KV head groups hold attention heads (at most the units of
    a layer), so the TP sizes that cut the attention heads evenly hold whole groups."""
    model_shards = _model_shards(cfg, spec, cfg.pp_size)
    if not spec.recurrent_layers:
        return [None] * len(model_shards)
    layers = tuple(StateLayer(i, *state_axis(spec, i), spec.state_shapes(i)) for i in spec.recurrent_layers)
    groups = max(1, min(spec.num_heads // cfg.hicache_storage_head_partition, *(s.units for s in layers)))
    state_grid = StateGrid(layers, tuple(grid.layer_ranges), groups)
    shards = [StateShard(r, tuple(m.state_units(spec, s.layer) if s.layer in m.layers else range(0) for s in layers))
              for r, m in enumerate(model_shards)]
    return [plan_states(state_grid, shards, s.rank) for s in shards]


def layout_report(cfg: EngineConfig, spec: ModelSpec, dtype: torch.dtype, tree_namespace: str,
                  draft: ModelSpec | None = None, hybrid: bool = False) -> dict[str, Any]:
    """The storage layout as JSON for routers: namespace digest (of requests without a
    cache_salt; a salt changes it), key pattern, grid, and each rank's read and write sets
    (draft cells prefixed ``draft_``). ``hybrid``: the pools were built with a window component
    (a sliding-window model may still keep every layer: the objects are then every-layer ones)."""
    plans = unified_plans(cfg, spec, draft)
    if not plans:
        return {"key_scheme": cfg.hicache_storage_key_scheme, "storage_backend": cfg.hicache_storage_backend}
    grid = plans[0].grid
    # a hybrid pool's objects (full and "_swa" window cells) have a namespace of their own
    window = spec.sliding_window if hybrid else 0
    keys = plans[0].key_namespace(cfg.page_size, str(dtype), spec.head_dim, window)
    holders = stage_holders(cfg)
    return {
        "key_scheme": "unified", "storage_backend": cfg.hicache_storage_backend, "namespace": tree_namespace,
        "namespace_digest": keys.digest(tree_namespace).hex(), "key_pattern": KEY_PATTERN,
        "key_namespace_digest_chars": NAMESPACE_KEY_HEX, "page_size": cfg.page_size,
        "object_layout": keys.object_layout,
        "window_cells": f"{KEY_PATTERN}{WINDOW_SUFFIX} (checkpoint pages only)" if window else None,
        "state_cells": STATE_PATTERN if plans[0].states else None,
        "grid": {"layer_ranges": grid.layer_ranges, "head_groups": len(grid.groups), "mla": grid.mla,
                 "layer_partition": grid.layer_partition, "head_partition": None if grid.mla else grid.head_partition,
                 "objects_per_page": len(grid.cells())},
        # one entry per holder of a stage (stage_holders: with page-sharded KV each page's owner)
        "ranks": [{"rank": p.shard.rank, "tp_rank": p.shard.rank % holders, "pp_rank": p.shard.rank // holders,
                   "layers": [p.shard.layers.start, p.shard.layers.stop],
                   "kv_heads": [p.shard.kv_heads.start, p.shard.kv_heads.stop],
                   **{which: _suffixes(p, which) for which in ("reads", "writes")}} for p in plans],
    }


def _suffixes(plan: UnifiedPlan, which: str) -> list[str]:
    """The cells ``plan`` reads or writes (``which``), its draft's prefixed ``draft_``, then a snapshot's
    (``..._state``: recurrent layers)."""
    own = [c.suffix for c in getattr(plan.objects, which)]
    states = [c.suffix for c in getattr(plan.states, which)] if plan.states else []
    return own + ([DRAFT_PREFIX + c.suffix for c in getattr(plan.draft.objects, which)] if plan.draft else []) + states
