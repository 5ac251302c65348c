"""The unified storage layout of a deployment (``--hicache-storage-key-scheme unified``): every
rank's cells of the grid, planned from every rank's shard, and the report external routers read
(``GET /get_hicache_l3_cache_layout``)."""

from __future__ import annotations

from typing import Any

import torch

from ..cache.storage.page_objects import NAMESPACE_KEY_HEX
from ..cache.storage.unified import RankShard, StorageGrid, UnifiedPlan, plan_rank
from ..config import EngineConfig
from ..model.parallel import model_shard
from ..model.spec import ModelSpec

KEY_PATTERN = "{page_hash}_{namespace_digest}_L{start_layer}-{end_layer}[_H{head_group}]"


def unified_plans(cfg: EngineConfig, spec: ModelSpec) -> list[UnifiedPlan]:
    """Every rank's plan, by rank (``pp_rank * tp_size + tp_rank``); [] when the key scheme is
    not unified. Raises ConfigError when a rank's shard does not align with the grid."""
    if cfg.hicache_storage_key_scheme != "unified" or not cfg.hicache_storage_backend:
        return []
    grid = StorageGrid(spec.num_layers, spec.num_kv_heads, cfg.hicache_storage_layer_partition or spec.num_layers,
                       cfg.hicache_storage_head_partition, spec.is_mla)
    tp, pp = cfg.tp_size, cfg.pp_size
    shards = []
    for p in range(pp):
        for t in range(tp):
            s = model_shard(spec, t, tp, p, pp)
            shards.append(RankShard(p * tp + t, s.layers, s.kv_heads))
    return [UnifiedPlan(grid, s, plan_rank(grid, shards, s.rank)) for s in shards]


def layout_report(cfg: EngineConfig, spec: ModelSpec, dtype: torch.dtype, tree_namespace: str) -> dict[str, Any]:
    """The storage layout as JSON for routers: namespace digest (of requests without a
    cache_salt; a salt changes it), key pattern, grid, and each rank's read and write sets."""
    plans = unified_plans(cfg, spec)
    if not plans:
        return {"key_scheme": cfg.hicache_storage_key_scheme, "storage_backend": cfg.hicache_storage_backend}
    grid = plans[0].grid
    digest = plans[0].key_namespace(cfg.page_size, str(dtype), spec.head_dim).digest(tree_namespace)
    return {
        "key_scheme": "unified",
        "storage_backend": cfg.hicache_storage_backend,
        "namespace": tree_namespace,
        "namespace_digest": digest.hex(),
        "key_pattern": KEY_PATTERN,
        "key_namespace_digest_chars": NAMESPACE_KEY_HEX,
        "page_size": cfg.page_size,
        "object_layout": plans[0].object_layout,
        "grid": {"layer_ranges": grid.layer_ranges, "head_groups": len(grid.groups), "mla": grid.mla,
                 "layer_partition": grid.layer_partition, "head_partition": None if grid.mla else grid.head_partition,
                 "objects_per_page": len(grid.cells())},
        "ranks": [{"rank": p.shard.rank, "tp_rank": p.shard.rank % cfg.tp_size, "pp_rank": p.shard.rank // cfg.tp_size,
                   "layers": [p.shard.layers.start, p.shard.layers.stop],
                   "kv_heads": [p.shard.kv_heads.start, p.shard.kv_heads.stop],
                   "reads": [c.suffix for c in p.objects.reads], "writes": [c.suffix for c in p.objects.writes]}
                  for p in plans],
    }
