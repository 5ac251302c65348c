"""What one rank runs: a (possibly sharded) model, its KV pools, the cache manager and the
scheduler. The single-rank Engine builds one in its own process; with ``--tp-size`` /
``--pp-size`` every rank process builds one over its slice of the model (hicache.parallel)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..cache.host_pool import HostKVPool
from ..cache.host_transfer import staging_budget
from ..cache.manager import CachePolicy, KVCacheManager, RankLayout
from ..cache.placement import PagePlacement
from ..cache.pools import DeviceKVPool
from ..cache.storage.base import StorageError
from ..cache.storage.prefetch_backup import Agree
from ..cache.storage.registry import create_backend
from ..cache.storage.unified import StorageGrid, UnifiedPlan
from ..config import ConfigError, EngineConfig
from ..device import DTYPES, device_memory_budget
from ..disagg.heads import TPRanks
from ..model.loader import LoadedModel
from ..model.parallel import ModelShard, stage_layers
from ..model.prefix_gather import CPGroup, PrefixGather
from ..model.spec import ModelSpec
from .hybrid_pool import HybridPlan, plan_hybrid
from .mode_registry import build_modes
from .modes import Mode, ModeContext
from .runner import ContextParallel, ModelRunner
from .scheduler import Scheduler
from .speculative import DraftKV, plan_draft_kv
from .storage_layout import plan_index, unified_plans

logger = logging.getLogger(__name__)


@dataclass
class EngineCore:
    pool: DeviceKVPool
    host_pool: HostKVPool | None
    cache: KVCacheManager
    runner: ModelRunner
    scheduler: Scheduler

    def check_alive(self) -> None:
        """Raises EngineDeadError once a thread this rank serves with has died (a mode's)."""
        for mode in self.scheduler.modes:
            mode.check_alive()

    def shutdown(self) -> None:
        """Stop the modes' threads (P/D transfers), then the cache's (pending writes finish)."""
        for mode in self.scheduler.modes:
            mode.close()
        self.cache.shutdown()


def build_core(
    cfg: EngineConfig,
    loaded: LoadedModel,
    device: torch.device,
    dtype: torch.dtype,
    shard: ModelShard | None = None,
    agree: Callable[[list[int]], list[int]] = lambda values: values,
    storage_agree: tuple[Agree, Agree] | None = None,
    memory_share: int = 1,
    staging_bytes: int = 0,
    cp_group: CPGroup | None = None,
    split_tokens: bool = True,
    draft: LoadedModel | None = None,
    draft_row: tuple[int, int] | None = None,
    pd_ranks: TPRanks | None = None,
    share_draws: Callable[[Any], Any] | None = None,
) -> EngineCore:
    """Pools sized from the config, then the cache and the scheduler over ``loaded.model``
    (already cut to ``shard`` when given). ``dtype``: the model's; the pools hold
    ``cfg.kv_cache_dtype`` once resolved (:func:`hicache.device.choose_precision`).

    Several ranks: ``agree`` MIN-reduces the device and host page counts and whether the
    storage backend is reachable, so every rank's allocators and tiers, hence every cache
    decision, are the same; ``memory_share`` ranks size their pools from one memory budget,
    of which ``staging_bytes`` (this rank's buffers outside the pools) are already spent.
    ``cp_group``: this rank's context-parallel group (``--attn-cp-size``; ``split_tokens``
    False: the attention-TP ranks an MLA latent is sharded over, see ``CPBackend.prepare``); with
    ``--enable-kv-cache-sharding`` the pool holds this rank's share of the logical pages and the
    prefix-gather scratch is taken from the budget first (DESIGN invariant 6). ``draft``: the
    speculative draft model; its KV is on the target's pages in every tier and counted in
    every budget (packed: extra layers of the target's pools; sidecar: pools of its own);
    ``draft_row``: its local KV row (kv heads, head dim) when tensor-parallel. With speculation
    on and no ``draft`` (a later pipeline stage) the scheduler still plans verify passes.
    ``pd_ranks``, ``share_draws``: what the modes need of a rank group (runtime/mode_registry.py)."""
    spec = loaded.spec
    # Every KV pool, tier and scratch holds --kv-cache-dtype (the model's dtype while unresolved).
    dtype = dtype if cfg.kv_cache_dtype == "auto" else DTYPES[cfg.kv_cache_dtype]
    layers = len(shard.layers) if shard else spec.num_layers
    kv_heads = len(shard.kv_heads) if shard else spec.num_kv_heads
    draft_kv = plan_draft_kv(cfg, draft, (kv_heads, spec.head_dim), draft_row)
    bytes_per_page = _bytes_per_page(cfg.page_size, layers, kv_heads, spec.head_dim, dtype, draft_kv)
    cp = _context_parallel(cfg, cp_group, split_tokens, kv_heads, spec.head_dim, spec.max_position_embeddings,
                           dtype, device)
    if cp is not None and cp.gather is not None:
        staging_bytes += cp.gather.nbytes
    hybrid = plan_hybrid(cfg, spec, shard.layers if shard else range(spec.num_layers), draft_kv)
    staging_bytes += _transfer_staging(cfg, device, kv_heads, spec.head_dim, dtype, hybrid is not None, draft_kv)
    layer_page = _bytes_per_page(cfg.page_size, 1, kv_heads, spec.head_dim, dtype, None)
    unified = _unified_plan(cfg, spec, shard, cp_group, split_tokens, draft)
    apart = _host_pools_apart(cfg, spec, hybrid, unified.grid if unified else None)
    device_pages, host_pages, storage, hybrid, window_pages = _sized_tiers(
        cfg, device, hybrid, bytes_per_page, layer_page * len(hybrid.window_layers) if hybrid else 0,
        memory_share, staging_bytes, agree, layer_page, host_blocks=apart is None)
    packed = draft_kv.layers if draft_kv is not None and draft_kv.packed else 0
    pool = _device_pool(cfg, layers + packed, (kv_heads, spec.head_dim), device_pages, dtype, device, hybrid,
                        window_pages)
    host_pool = _host_pool(cfg, pool, host_pages, unified.grid if unified else None, apart)
    sidecar = _sidecar_pools(cfg, draft_kv, device_pages, host_pages, dtype, device,
                             unified.draft.grid if unified and unified.draft else None)
    layout = RankLayout(shard=shard.describe() if shard else "", storage_agree=storage_agree,
                        placement=cp.placement if cp is not None else None, shard_rank=cp_group.rank if cp_group else 0,
                        sidecar=sidecar, unified=unified)
    cache = KVCacheManager(pool, host_pool, storage, CachePolicy.from_config(cfg), layout)
    runner = ModelRunner(loaded.model, cache.kv_view, device, cp)
    modes = build_modes(ModeContext(cfg, cache, device, layers, spec.vocab_size, pd_ranks or TPRanks.alone(kv_heads),
                                    draft, packed, share_draws, tokenizer=loaded.tokenizer, samples=shard is None or shard.last_stage))
    return EngineCore(pool, host_pool, cache, runner, _scheduler(cfg, cache, loaded, modes,
                                                                 _prefill_chunk(cfg, hybrid, window_pages)))


def _device_pool(cfg: EngineConfig, layers: int, row: tuple[int, int], pages: int, dtype: torch.dtype,
                 device: torch.device, hybrid: HybridPlan | None, window_pages: int) -> DeviceKVPool:
    """The device KV pool: ``layers`` of ``row`` (KV heads, head dim) per token; a hybrid plan's window
    component beside it (two pools, or shared blocks with its sliding groups)."""
    if hybrid is None:
        return DeviceKVPool(layers, *row, pages, cfg.page_size, dtype, device)
    return DeviceKVPool(layers, *row, pages, cfg.page_size, dtype, device, hybrid.window_layers, window_pages,
                        hybrid.window, dict(enumerate(hybrid.layout)) if hybrid.shared else None, hybrid.groups)


def _sized_tiers(cfg: EngineConfig, device: torch.device, hybrid: HybridPlan | None, bytes_per_page: int,
                 window_page: int, memory_share: int, staging_bytes: int, agree: Callable[[list[int]], list[int]],
                 layer_page: int = 0, host_blocks: bool = False) -> tuple[int, int, Any, HybridPlan | None, int]:
    """``(device pages, host pages, storage backend, hybrid plan, window pages)``, agreed by every rank. A
    hybrid pool's pages cost their full layers' bytes and the ratio's share of ``window_page`` (the
    window layers' bytes of a page); where its window pool could not be smaller than the full one,
    every layer keeps its KV (said in one line) and the pools are sized as such. A shared pool
    (automatic split): device pages are blocks of ``layer_page`` x G bytes (with --max-total-tokens,
    :meth:`HybridPlan.blocks_for_tokens`), window pages the ids they could hold; ``host_blocks``: its
    host pool is one of blocks too (:func:`_host_pools_apart`), whose --hicache-ratio is of the blocks."""
    if hybrid and hybrid.shared:
        block = layer_page * len({t for t, _ in hybrid.layout})
        blocks, host_pages, storage = _agreed_tiers(cfg, device, block, memory_share, staging_bytes, agree)
        if cfg.max_total_tokens is not None:
            blocks = hybrid.blocks_for_tokens(blocks)
            if host_blocks and host_pages and cfg.hicache_size <= 0:  # agreed figures in, the same on every rank
                host_pages = _host_pool_pages(cfg, blocks, block)
        if hybrid.shared_fits(blocks):
            return blocks, host_pages, storage, hybrid, hybrid.window_ids(blocks)
        logger.info("sliding-window layers keep every cached token's KV: %d blocks hold no request's windows "
                    "beside its pages", blocks - 1)
        device_pages = _device_pool_pages(cfg, device, bytes_per_page, memory_share, staging_bytes)
        host_pages = _host_pool_pages(cfg, device_pages, bytes_per_page) if cfg.enable_hierarchical_cache else 0
        device_pages, host_pages = agree([device_pages, host_pages])
        return device_pages, host_pages, storage, None, 0
    page_cost = hybrid.page_cost(bytes_per_page - window_page, window_page) if hybrid else bytes_per_page
    device_pages, host_pages, storage = _agreed_tiers(cfg, device, -(-page_cost // 1), memory_share, staging_bytes,
                                                      agree)
    window_pages = hybrid.window_pages(device_pages) if hybrid else 0
    if hybrid and not hybrid.saves_memory(device_pages, window_pages):
        logger.info("sliding-window layers keep every cached token's KV: a window pool of %d pages (one request's "
                    "window) would not be smaller than the %d-page pool", window_pages - 1, device_pages - 1)
        device_pages = _device_pool_pages(cfg, device, bytes_per_page, memory_share, staging_bytes)
        host_pages = _host_pool_pages(cfg, device_pages, bytes_per_page) if cfg.enable_hierarchical_cache else 0
        device_pages, host_pages = agree([device_pages, host_pages])
        return device_pages, host_pages, storage, None, 0
    return device_pages, host_pages, storage, hybrid, window_pages


def _prefill_chunk(cfg: EngineConfig, hybrid: HybridPlan | None, window_pages: int) -> int:
    """--chunked-prefill-size, cut (and said once) where a chunk's window pages would not fit in
    a hybrid pool's window component."""
    chunk = cfg.chunked_prefill_size if not hybrid else hybrid.shared_chunk((window_pages - 1) * hybrid.groups + 1, cfg.chunked_prefill_size) \
        if hybrid.shared else hybrid.prefill_chunk(window_pages, cfg.chunked_prefill_size)
    if chunk < cfg.chunked_prefill_size:
        logger.info("prefill chunks of %d tokens (--chunked-prefill-size %d): the window pool holds %d pages", chunk,
                    cfg.chunked_prefill_size, window_pages - 1)
    return chunk


def _bytes_per_page(page_size: int, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                    draft_kv: DraftKV | None) -> int:
    """Bytes of one page's K and V over this rank's layers and heads, its draft's share included."""
    elem = torch.empty((), dtype=dtype).element_size()
    draft = draft_kv.bytes_per_page(elem, page_size) if draft_kv is not None else 0
    return 2 * layers * kv_heads * head_dim * elem * page_size + draft


def _transfer_staging(cfg: EngineConfig, device: torch.device, kv_heads: int, head_dim: int, dtype: torch.dtype,
                      hybrid: bool, draft_kv: DraftKV | None) -> int:
    """Device bytes of the host tier's copy staging on a GPU (none on a CPU): a buffer per direction
    for the pools' rows, the window pools' (hybrid) and a sidecar draft's."""
    if device.type != "cuda" or not cfg.enable_hierarchical_cache:
        return 0
    row = _bytes_per_page(cfg.page_size, 1, kv_heads, head_dim, dtype, None) // 2  # one layer's K
    rows = [row] * (2 if hybrid else 1)
    if draft_kv is not None and not draft_kv.packed:
        rows.append(_bytes_per_page(cfg.page_size, 1, *draft_kv.row, dtype, None) // 2)
    return staging_budget(rows)


def _agreed_tiers(cfg: EngineConfig, device: torch.device, bytes_per_page: int, memory_share: int, staging_bytes: int,
                  agree: Callable[[list[int]], list[int]]) -> tuple[int, int, Any]:
    """``(device pages, host pages, storage backend or None)``, the same on every rank: each
    count MIN-agreed, and the storage tier dropped everywhere if one rank cannot reach it."""
    device_pages = _device_pool_pages(cfg, device, bytes_per_page, memory_share, staging_bytes)
    host_pages = _host_pool_pages(cfg, device_pages, bytes_per_page) if cfg.enable_hierarchical_cache else 0
    storage = _storage_backend(cfg)
    device_pages, host_pages, storage_everywhere = agree(
        [device_pages, host_pages, int(storage is not None or not cfg.hicache_storage_backend)])
    if storage is not None and not storage_everywhere:
        logger.warning("storage backend %s is unavailable on another rank; serving without the storage tier",
                       cfg.hicache_storage_backend)
        storage.close()
        storage = None
    return device_pages, host_pages, storage


def _unified_plan(cfg: EngineConfig, spec: ModelSpec, shard: ModelShard | None, cp_group: CPGroup | None,
                  split_tokens: bool, draft: LoadedModel | None) -> UnifiedPlan | None:
    """This rank's cells of the unified storage grid (``--hicache-storage-key-scheme unified``)."""
    plans = unified_plans(cfg, spec, draft.spec if draft is not None else None)
    if not plans:
        return None
    # shard.tp_rank is the attention-TP rank; with CP the full TP rank also counts the CP rank
    tp_rank = 0 if shard is None else shard.tp_rank + (cp_group.rank * shard.tp_size if cp_group and split_tokens
                                                         else 0)
    plan = plans[plan_index(cfg, shard.pp_rank if shard is not None else 0, tp_rank)]
    logger.info("unified storage grid %s: this rank reads %d and writes %d of %d objects per page",
                plan.grid.describe(), len(plan.objects.reads), len(plan.objects.writes), len(plan.grid.cells()))
    return plan


def _host_pools_apart(cfg: EngineConfig, spec: ModelSpec, hybrid: HybridPlan | None,
                      grid: StorageGrid | None) -> str | None:
    """Why the host tier of a shared device pool keeps two pools (full layers; window layers sized by
    the default ratio) rather than one of blocks like the device's; None where it takes blocks. A
    deployment-wide decision (every pipeline stage's layers weighed), so every rank's host tier decides
    alike."""
    if hybrid is None or not hybrid.shared or not cfg.enable_hierarchical_cache:
        return None
    if grid is not None:
        return ("the unified key scheme reads and writes each storage object in place as a slice of a page_unified "
                "host page, and a window page's layers lie in one block per sliding group")
    full = [layer for layer in range(spec.num_layers) if not spec.layer_window(layer)]
    sliding = [layer for layer in range(spec.num_layers) if spec.layer_window(layer)]
    for rank in range(cfg.pp_size):  # a block's rows are a stage's tensors; its full page's object, its full layers
        layers = stage_layers(spec.num_layers, rank, cfg.pp_size)
        if {sliding.index(i) % hybrid.tensors for i in layers if i in sliding} - {full.index(i) for i in layers
                                                                                  if i in full}:
            return f"pipeline stage {rank}'s sliding layers use block tensors none of its full layers has"
    return None


def _host_pool(cfg: EngineConfig, pool: DeviceKVPool, host_pages: int, grid: StorageGrid | None,
               apart: str | None = None) -> HostKVPool | None:
    """The host pool of ``pool`` (None without the host tier); on a unified ``grid`` laid out
    page_unified, whatever --hicache-mem-layout says, so each object is a slice of a page. A shared
    device pool's is one of ``host_pages`` blocks (issue 56) unless ``apart`` says why not."""
    if not cfg.enable_hierarchical_cache:
        return None
    full = tuple(i for i in range(len(pool.k_buffers)) if i not in pool.window_layers)
    if pool.shared and apart is None:  # full pages and window pages (a block per sliding group) from one budget
        return HostKVPool(pool, host_pages, cfg.hicache_mem_layout, layers=full,
                          window_ids=(host_pages - 1) // pool.groups + 1)
    if pool.shared:
        logger.info("host KV pool: two pools (full layers; window layers at --swa-full-tokens-ratio %.1f's size), not "
                    "shared blocks: %s", HybridPlan.DEFAULT_RATIO, apart)
    if pool.hybrid:  # full layers for every host page, window layers for checkpoints (pages of their own)
        layout, cells = (cfg.hicache_mem_layout, None) if grid is None else \
            ("page_unified", 0 if grid.mla else grid.head_partition)  # each object a slice of a page, as below
        host = HostKVPool(pool, host_pages, layout, cell_heads=cells, layers=full)
        ratio = cfg.swa_full_tokens_ratio or HybridPlan.DEFAULT_RATIO  # checkpoints only: the default's rule when apart
        window_pages = max(int(ratio * (host_pages - 1)), 1) + 1
        host.window_pool = HostKVPool(pool, window_pages, layout, cell_heads=cells, layers=tuple(sorted(pool.window_layers)))
        return host
    if grid is None:
        return HostKVPool(pool, host_pages, cfg.hicache_mem_layout)
    logger.info("host KV pool layout page_unified (--hicache-mem-layout %s set aside): the unified key scheme "
                "writes and reads each storage object in place", cfg.hicache_mem_layout)
    return HostKVPool(pool, host_pages, "page_unified", cell_heads=0 if grid.mla else grid.head_partition)


def _sidecar_pools(cfg: EngineConfig, draft_kv: DraftKV | None, device_pages: int, host_pages: int,
                   dtype: torch.dtype, device: torch.device,
                   grid: StorageGrid | None) -> tuple[DeviceKVPool, HostKVPool | None] | None:
    """A sidecar draft's own device (and host) pools, on the target's page ids; None if packed."""
    if draft_kv is None or draft_kv.packed:
        return None
    pool = DeviceKVPool(draft_kv.layers, *draft_kv.row, device_pages, cfg.page_size, dtype, device)
    return pool, _host_pool(cfg, pool, host_pages, grid)


def _scheduler(cfg: EngineConfig, cache: KVCacheManager, loaded: LoadedModel, modes: list[Mode],
               prefill_chunk: int) -> Scheduler:
    return Scheduler(
        cache=cache,
        decode_text=loaded.tokenizer.decode,
        eos_token_ids=set(loaded.tokenizer.eos_token_ids),
        chunked_prefill_size=prefill_chunk,
        max_running_requests=cfg.max_running_requests,
        prefetch_policy=cfg.hicache_storage_prefetch_policy,
        prefetch_timeout=lambda tokens: cfg.hicache_storage_prefetch_timeout_base
        + cfg.hicache_storage_prefetch_timeout_per_1k_tokens * tokens / 1000,
        modes=modes,
        deterministic=cfg.enable_deterministic_inference,
        shared_prefill_wait=cfg.decode_reuses_prefix and not cfg.disable_shared_prefill_wait,
    )


def _context_parallel(cfg: EngineConfig, group: CPGroup | None, split_tokens: bool, kv_heads: int, head_dim: int,
                      max_positions: int, dtype: torch.dtype, device: torch.device) -> ContextParallel | None:
    """This rank's part in a CP (or MLA latent) group; sharded, with its prefix-gather scratch
    sized for the longest context."""
    if group is None:
        return None
    cp = ContextParallel(group, cfg.cp_strategy, cfg.page_size, split_tokens=split_tokens)
    if cfg.enable_kv_cache_sharding:
        cp.placement = PagePlacement(group.size, cfg.page_size)
        context = cfg.context_length or max_positions
        if cfg.max_total_tokens is not None:  # no prefix outgrows the logical pool
            context = min(context, group.size * cfg.max_total_tokens)
        elems = PrefixGather.scratch_elems(group.size, context, cfg.page_size, kv_heads, head_dim)
        cp.gather = PrefixGather(group, elems, dtype, device)
    return cp


def _device_pool_pages(
    cfg: EngineConfig, device: torch.device, bytes_per_page: int, share: int = 1, staging_bytes: int = 0
) -> int:
    """Usable pages + the reserved page 0 (``share`` ranks draw on the same memory; this one
    already holds ``staging_bytes`` of it in buffers outside the pool)."""
    if cfg.max_total_tokens is not None:
        return cfg.max_total_tokens // cfg.page_size + 1
    budget = device_memory_budget(device, cfg.mem_fraction_static) // share - staging_bytes
    pages = budget // bytes_per_page
    if pages < 1:
        staging = f" after {staging_bytes / 2**20:.0f} MiB of staging buffers" if staging_bytes else ""
        raise ConfigError(
            f"the KV budget ({max(budget, 0) / 2**20:.0f} MiB{staging}) holds no page of {bytes_per_page} bytes; "
            "raise --mem-fraction-static or set --max-total-tokens."
        )
    return int(pages) + 1


def _host_pool_pages(cfg: EngineConfig, device_pages: int, bytes_per_page: int) -> int:
    """Host pages + the reserved page 0: --hicache-size GB, else --hicache-ratio x device."""
    if cfg.hicache_size > 0:
        pages = int(cfg.hicache_size * 1e9 // bytes_per_page)
    else:
        pages = int((device_pages - 1) * cfg.hicache_ratio)
    if pages < 1:
        raise ConfigError("the host KV pool would hold no page; raise --hicache-size or --hicache-ratio.")
    return pages + 1


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
