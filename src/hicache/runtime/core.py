"""What one rank runs: a (possibly sharded) model, its KV pools, the cache manager and the
scheduler. The single-rank Engine builds one in its own process; with ``--tp-size`` /
``--pp-size`` every rank process builds one over its slice of the model (hicache.parallel)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch

from ..cache.host_pool import HostKVPool
from ..cache.manager import CachePolicy, KVCacheManager, RankLayout
from ..cache.placement import PagePlacement
from ..cache.pools import DeviceKVPool
from ..cache.state_pool import StatePool
from ..cache.storage.base import StorageError
from ..cache.storage.registry import create_backend
from ..cache.storage.unified import StorageGrid
from ..config import ConfigError, EngineConfig
from ..device import available_host_memory
from ..disagg.heads import TPRanks
from ..model.loader import LoadedModel
from ..model.prefix_gather import PrefixGather
from .hybrid_pool import HybridPlan
from .mode_registry import build_modes
from .modes import ModeContext
from .rank_plan import RankContext, RankPlan, plan_rank
from .runner import ContextParallel, ModelRunner
from .scheduler import SchedulePolicy, Scheduler
from .state_plan import StatePlan

logger = logging.getLogger(__name__)


@dataclass
class EngineCore:
    pool: DeviceKVPool
    host_pool: HostKVPool | None
    cache: KVCacheManager
    runner: ModelRunner
    scheduler: Scheduler
    plan: RankPlan

    def check_alive(self) -> None:
        """Raises EngineDeadError once a thread this rank serves with has died (a mode's)."""
        for mode in self.scheduler.modes:
            mode.check_alive()

    def shutdown(self) -> None:
        """Stop the modes' threads (P/D transfers), then the cache's (pending writes finish)."""
        for mode in self.scheduler.modes:
            mode.close()
        self.cache.shutdown()


def build_core(cfg: EngineConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
               rank: RankContext = RankContext(), draft: LoadedModel | None = None) -> EngineCore:
    """The rank's plan (:func:`~hicache.runtime.rank_plan.plan_rank`), then its pools, the cache
    and the scheduler over ``loaded.model`` (already cut to ``rank.shard`` when given). ``dtype``:
    the model's; the pools hold ``cfg.kv_cache_dtype`` once resolved
    (:func:`hicache.device.choose_precision`). ``draft``: the speculative draft model; its KV is
    on the target's pages in every tier and counted in every budget (packed: extra layers of the
    target's pools; sidecar: pools of its own). With speculation on and no ``draft`` (a later
    pipeline stage) the scheduler still plans verify passes."""
    storage = _storage_backend(cfg)
    plan = plan_rank(cfg, loaded.spec, rank, draft.spec if draft is not None else None, device, dtype,
                     storage is not None or not cfg.hicache_storage_backend)
    if storage is not None and not plan.storage:
        logger.warning("storage backend %s is unavailable on another rank; serving without the storage tier",
                       cfg.hicache_storage_backend)
        storage.close()
        storage = None
    logger.info("rank plan: %s; device pages %d, host pages %d, window pages %d", plan.describe(),
                plan.device_pages - 1, max(plan.host_pages - 1, 0), max(plan.window_pages - 1, 0))
    cp = _context_parallel(cfg, rank, plan, device)
    # the target's layers and a packed draft's; a hybrid plan's window component beside them (two pools, or
    # shared blocks with its sliding groups)
    windows = plan.hybrid.pool_part(plan.window_pages) if plan.hybrid is not None else None
    s = plan.states
    states = StatePool(s.layers, s.running, s.snapshots, s.grid, device, s.scratch) if s is not None else None
    pool = DeviceKVPool(plan.layers + plan.packed_layers, *plan.row, plan.device_pages, cfg.page_size, plan.kv_dtype,
                        device, windows)
    unified = plan.unified
    host_pool = _host_pool(cfg, pool, plan.host_pages, unified.grid if unified else None, plan.host_apart)
    host_states = _host_states(s, host_pool)
    sidecar = _sidecar_pools(cfg, plan, device, unified.draft.grid if unified and unified.draft else None)
    layout = RankLayout(shard=rank.shard.describe() if rank.shard else "", storage_agree=rank.storage_agree,
                        placement=cp.placement if cp is not None else None,
                        shard_rank=rank.cp_group.rank if rank.cp_group else 0, sidecar=sidecar, unified=unified,
                        states=states, host_states=host_states)
    cache = KVCacheManager(pool, host_pool, storage, CachePolicy.from_config(cfg), layout)
    runner = ModelRunner(loaded.model, cache.kv_view, device, cp)
    modes = build_modes(ModeContext(cfg, cache, device, plan.layers, loaded.spec.vocab_size,
                                    rank.pd_ranks or TPRanks.alone(plan.row[0]), draft, plan.packed_layers,
                                    rank.share_draws, tokenizer=loaded.tokenizer,
                                    samples=rank.shard is None or rank.shard.last_stage, spec=loaded.spec))
    scheduler = Scheduler(cache, loaded.tokenizer.decode, set(loaded.tokenizer.eos_token_ids), SchedulePolicy(
        plan.prefill_chunk, cfg.max_running_requests, cfg.hicache_storage_prefetch_policy,
        lambda tokens: cfg.hicache_storage_prefetch_timeout_base
        + cfg.hicache_storage_prefetch_timeout_per_1k_tokens * tokens / 1000,
        cfg.enable_deterministic_inference, cfg.decode_reuses_prefix and not cfg.disable_shared_prefill_wait), modes)
    return EngineCore(pool, host_pool, cache, runner, scheduler, plan)


def _host_pool(cfg: EngineConfig, pool: DeviceKVPool, host_pages: int, grid: StorageGrid | None,
               apart: str | None = None) -> HostKVPool | None:
    """The host pool of ``pool`` (None without the host tier); on a unified ``grid`` laid out
    page_unified, whatever --hicache-mem-layout says, so each object is a slice of a page. A shared
    device pool's is one of ``host_pages`` blocks (issue 56) unless ``apart`` says why not."""
    if not cfg.enable_hierarchical_cache:
        return None
    full = tuple(i for i in range(len(pool.k_buffers)) if i not in pool.windows.layers)
    if pool.windows.shared and apart is None:  # full pages and window pages (a block per sliding group) from one budget
        return HostKVPool(pool, host_pages, cfg.hicache_mem_layout, layers=full,
                          window_ids=(host_pages - 1) // pool.windows.groups + 1)
    if pool.windows.shared:
        logger.info("host KV pool: two pools (full layers; window layers at --swa-full-tokens-ratio %.1f's size), not "
                    "shared blocks: %s", HybridPlan.DEFAULT_RATIO, apart)
    layout, cells = cfg.hicache_mem_layout, None
    if grid is not None:  # each storage object a slice of a page
        layout, cells = "page_unified", 0 if grid.mla else grid.head_partition
        logger.info("host KV pool layout page_unified (--hicache-mem-layout %s set aside): the unified key scheme "
                    "writes and reads each storage object in place", cfg.hicache_mem_layout)
    host = HostKVPool(pool, host_pages, layout, cell_heads=cells, layers=full)  # (every layer unless hybrid)
    if pool.hybrid:  # full layers for every host page, window layers for checkpoints (pages of their own)
        ratio = cfg.swa_full_tokens_ratio or HybridPlan.DEFAULT_RATIO  # checkpoints only: the default's rule when apart
        window_pages = max(int(ratio * (host_pages - 1)), 1) + 1
        host.window_pool = HostKVPool(pool, window_pages, layout, cell_heads=cells,
                                      layers=tuple(sorted(pool.windows.layers)))
    return host


def _host_states(plan: StatePlan | None, host_pool: HostKVPool | None) -> StatePool | None:
    """The host tier's snapshot slots (None without a host tier or recurrent layers), refused in one sentence
    where they and the host KV pool would not fit in the host's memory (DESIGN invariant 6)."""
    if plan is None or host_pool is None or not plan.host_snapshots:
        return None
    need, available = host_pool.total_bytes + plan.slot_bytes * (1 + plan.host_snapshots), available_host_memory()
    if need > 0.9 * available:
        raise ConfigError(f"the host KV pool and its {plan.host_snapshots} recurrent-state snapshots need "
                          f"{need / 2**30:.2f} GiB but only {available / 2**30:.2f} GiB of host memory is available; "
                          "lower --hicache-ratio, --hicache-size or --recurrent-snapshot-ratio.")
    return StatePool(plan.layers, 0, plan.host_snapshots, plan.grid, "cpu")


def _sidecar_pools(cfg: EngineConfig, plan: RankPlan, device: torch.device,
                   grid: StorageGrid | None) -> tuple[DeviceKVPool, HostKVPool | None] | None:
    """A sidecar draft's own device (and host) pools, on the target's page ids; None if packed."""
    draft_kv = plan.draft_kv
    if draft_kv is None or draft_kv.packed:
        return None
    pool = DeviceKVPool(draft_kv.layers, *draft_kv.row, plan.device_pages, cfg.page_size, plan.kv_dtype, device)
    return pool, _host_pool(cfg, pool, plan.host_pages, grid)


def _context_parallel(cfg: EngineConfig, rank: RankContext, plan: RankPlan,
                      device: torch.device) -> ContextParallel | None:
    """This rank's part in a CP (or MLA latent) group; sharded, with its prefix-gather scratch
    sized for the longest context (``plan.gather_elems``)."""
    if rank.cp_group is None:
        return None
    cp = ContextParallel(rank.cp_group, cfg.cp_strategy, cfg.page_size, split_tokens=rank.split_tokens)
    if cfg.enable_kv_cache_sharding:
        cp.placement = PagePlacement(rank.cp_group.size, cfg.page_size)
        cp.gather = PrefixGather(rank.cp_group, plan.gather_elems, plan.kv_dtype, device)
    return cp


def _storage_backend(cfg: EngineConfig):
    """The L3 backend, or None. A backend that is down at start is reported and skipped:
    the engine serves without storage rather than not at all."""
    if not cfg.hicache_storage_backend:
        return None
    extra = json.loads(cfg.hicache_storage_backend_extra_config or "{}")
    try:
        return create_backend(cfg.hicache_storage_backend, extra)
    except StorageError as e:
        logger.warning("storage backend %s is unavailable (%s); serving without the storage tier",
                       cfg.hicache_storage_backend, e)
        return None
