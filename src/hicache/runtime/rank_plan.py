"""Plan, then build: what one rank will hold, decided before any pool is allocated.

:func:`plan_rank` turns the config, the model's spec and this rank's place in its group into a
:class:`RankPlan`: the KV components (:mod:`hicache.cache.components`), the page counts of each
tier (MIN-agreed over the ranks through ``RankContext.agree``), the staging bytes, the prefill
chunk and this rank's cells of the unified storage grid. It allocates nothing and connects to
nothing (with a lone rank's ``agree`` it is a pure function of its inputs and the device's free
memory); :func:`hicache.runtime.core.build_core` builds the pools, tiers and scheduler from it.

Units: pages (of ``--page-size`` tokens) unless named; counts of pages include the reserved page 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..cache.components import KVComponent, PageSpace, Retention
from ..cache.host_transfer import staging_budget
from ..cache.storage.prefetch_backup import Agree
from ..cache.storage.unified import StorageGrid, UnifiedPlan
from ..config import ConfigError, EngineConfig
from ..device import DTYPES, device_memory_budget
from ..disagg.heads import TPRanks
from ..model.parallel import ModelShard, stage_layers
from ..model.prefix_gather import CPGroup, PrefixGather
from ..model.spec import ModelSpec
from .hybrid_pool import HybridPlan, plan_hybrid
from .speculative import DraftKV, plan_draft_kv
from .state_plan import UNBOUNDED, StateBudget, StatePlan, plan_states, verify_scratch
from .storage_layout import plan_index, unified_plans

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankContext:
    """What a rank group tells :func:`~hicache.runtime.core.build_core` of this rank; a lone
    engine: ``RankContext()``.

    ``agree`` MIN-reduces counts over every rank (so every rank's allocators, hence every cache
    decision, are the same); ``memory_share`` ranks draw on one memory budget, of which
    ``staging_bytes`` (this rank's buffers outside the pools) are already spent. ``cp_group``:
    this rank's context-parallel group (``split_tokens`` False: the attention-TP ranks an MLA
    latent is sharded over). ``draft_row``: the draft's local KV row when tensor-parallel.
    ``pd_ranks``, ``share_draws``: what the modes need of the group (runtime/mode_registry.py)."""

    shard: ModelShard | None = None
    agree: Callable[[list[int]], list[int]] = list  # alone: its own counts
    storage_agree: tuple[Agree, Agree] | None = None
    memory_share: int = 1
    staging_bytes: int = 0
    cp_group: CPGroup | None = None
    split_tokens: bool = True
    draft_row: tuple[int, int] | None = None
    pd_ranks: TPRanks | None = None
    share_draws: Callable[[Any], Any] | None = None

    def layers(self, spec: ModelSpec) -> range | list[int]:
        """This rank's layers (global indices)."""
        return self.shard.layers if self.shard else range(spec.num_layers)


@dataclass(frozen=True)
class RankPlan:
    """What one rank holds (see the module docstring). ``layers``: this rank's attention layers (those
    with KV; a recurrent layer's state is in ``states``). ``hybrid``: the window component's split
    (None: every layer keeps every page); ``host_apart``: why a shared device pool's host tier
    keeps two pools (None: blocks, or no shared pool); ``storage``: every rank reached the
    storage backend (False: the tier is off everywhere)."""

    kv_dtype: torch.dtype
    layers: int  # this rank's target layers
    row: tuple[int, int]  # (KV heads, head dim) of this rank
    components: tuple[KVComponent, ...]
    draft_kv: DraftKV | None
    hybrid: HybridPlan | None
    device_pages: int
    host_pages: int
    window_pages: int
    host_apart: str | None
    staging_bytes: int
    gather_elems: int  # one prefix-gather buffer (KV-sharded CP), 0 without
    prefill_chunk: int
    unified: UnifiedPlan | None
    storage: bool
    states: StatePlan | None = None  # the recurrent layers' state slots (issue 59); None: no recurrent layer

    @property
    def packed_layers(self) -> int:
        """A packed draft's layers, which follow the target's in the pools."""
        return self.draft_kv.layers if self.draft_kv is not None and self.draft_kv.packed else 0

    def describe(self) -> str:
        return "; ".join(c.describe() for c in self.components)


@dataclass(frozen=True)
class _PageBytes:
    """Bytes of one page: every layer (``page``), one layer (``layer``), the window layers' share."""

    page: int
    layer: int
    window: int


def plan_rank(cfg: EngineConfig, spec: ModelSpec, rank: RankContext, draft: ModelSpec | None, device: torch.device,
              model_dtype: torch.dtype, storage_reachable: bool) -> RankPlan:
    """This rank's plan. ``draft``: the speculative draft model's spec (None: no draft model on this
    rank); ``storage_reachable``: this rank reached the storage backend (or has none)."""
    # Every KV pool, tier and scratch holds --kv-cache-dtype (the model's dtype while unresolved).
    dtype = model_dtype if cfg.kv_cache_dtype == "auto" else DTYPES[cfg.kv_cache_dtype]
    layers = len([layer for layer in rank.layers(spec) if not spec.is_recurrent(layer)])  # those with KV
    row = (len(rank.shard.kv_heads) if rank.shard else spec.num_kv_heads, spec.head_dim)
    draft_kv = plan_draft_kv(cfg, draft, row, rank.draft_row)
    elem = torch.empty((), dtype=dtype).element_size()
    layer_page = 2 * row[0] * row[1] * elem * cfg.page_size
    gather = _gather_elems(cfg, rank, row, spec.max_position_embeddings)
    hybrid = plan_hybrid(cfg, spec, rank.layers(spec), draft_kv)
    staging = rank.staging_bytes + 2 * gather * elem + _transfer_staging(cfg, device, layer_page, elem,
                                                                         hybrid is not None, draft_kv)
    states = _state_plan(cfg, spec, rank, model_dtype, _Budget(device, rank, staging))
    staging += states.total_bytes if states else 0  # (the KV pages get what the state slots leave)
    unified = _unified_plan(cfg, spec, rank, draft)
    apart = _host_pools_apart(cfg, spec, hybrid, unified.grid if unified else None)
    every_layer = rank_components(spec, rank.layers(spec), row, None, draft_kv, states)  # before a window split
    costs = _PageBytes(sum(c.bytes_per_page(cfg.page_size, elem) for c in every_layer), layer_page,
                       layer_page * len(hybrid.window_layers) if hybrid else 0)
    device_pages, host_pages, storage, hybrid, window_pages = _sized_tiers(
        cfg, _Budget(device, rank, staging), hybrid, costs, storage_reachable, apart is None)
    states = states.with_host(device_pages, host_pages) if states is not None else None
    components = rank_components(spec, rank.layers(spec), row, hybrid, draft_kv, states)
    return RankPlan(dtype, layers, row, components, draft_kv, hybrid, device_pages, host_pages, window_pages, apart,
                    staging, gather, _prefill_chunk(cfg, hybrid, window_pages, states.grid if states else 1), unified,
                    storage, states)


def _state_plan(cfg: EngineConfig, spec: ModelSpec, rank: RankContext, dtype: torch.dtype,
                budget: _Budget) -> StatePlan | None:
    """The recurrent layers' state slots (runtime/state_plan.py), this rank's shard of each state tensor,
    sized against the KV pool they sit beside. The slot counts are MIN-agreed over the ranks, so a slot
    id names the same sequence or snapshot on every rank (a pipeline stage without recurrent layers
    plans a pool of none, which agrees to the other stages' counts)."""
    if not spec.recurrent_layers:
        return None
    free = budget.free(cfg)
    kv_tokens = cfg.max_total_tokens or max(free, 0) // spec.kv_bytes_per_token(dtype)
    plan = plan_states(spec, rank.layers(spec), dtype, cfg.page_size, StateBudget(
        cfg.max_running_requests, kv_tokens, cfg.recurrent_snapshot_ratio, free,
        verify_scratch(cfg.speculative_algorithm, cfg.pp_size)), rank.shard)
    return plan.with_counts(*rank.agree([plan.running, plan.snapshots]))


def rank_components(spec: ModelSpec, layers: range | list[int], row: tuple[int, int], hybrid: HybridPlan | None,
                    draft_kv: DraftKV | None, states: StatePlan | None = None) -> tuple[KVComponent, ...]:
    """The components this rank holds: what the model (and the draft config) declare, as planned."""
    window_layers = len(hybrid.window_layers) if hybrid else 0
    target = len([layer for layer in layers if not spec.is_recurrent(layer)]) - window_layers
    out = []
    if target:
        out.append(KVComponent("latent" if spec.is_mla else "full", target, row))
    if hybrid is not None:
        out.append(KVComponent(
            "window", window_layers, row, space=PageSpace.BLOCKS if hybrid.shared else PageSpace.WINDOW_PAGES,
            retention=Retention.WINDOW, window=hybrid.window, host="checkpoints' windows",
            storage="checkpoints' windows, an object per page beside the full one",
            pd="a fresh window tail after decode_prefix_len"))
    if states is not None:
        out.append(KVComponent(
            "recurrent_state", len(states.layers), (0, 0), PageSpace.STATE_SLOTS, Retention.CHECKPOINTS,
            host="the snapshots of the nodes it holds", storage="a -state object per stored snapshot",
            pd="not supported yet",
            slot_bytes=states.slot_bytes))
    if draft_kv is not None:
        out.append(KVComponent("draft" if draft_kv.packed else "draft-sidecar", draft_kv.layers, draft_kv.row,
                               space=PageSpace.PAGES if draft_kv.packed else PageSpace.SIDECAR))
    return tuple(out)


def model_components(spec: ModelSpec) -> set[str]:
    """The names of the components the model's layers declare, before a plan sizes them (a sliding-window
    model declares its window component even where every layer keeps its KV: its attention still slides)."""
    return ({"latent" if spec.is_mla else "full"} | ({"window"} if spec.has_sliding_layers else set())
            | ({"recurrent_state"} if spec.recurrent_layers else set()))


@dataclass(frozen=True)
class _Budget:
    """Where the device pages' bytes come from: the device's free memory, shared by
    ``rank.memory_share`` ranks, less ``staging`` bytes of buffers outside the pools."""

    device: torch.device
    rank: RankContext
    staging: int

    def free(self, cfg: EngineConfig) -> int:
        """Bytes left for the pools: this rank's share of the device budget less the staging."""
        return device_memory_budget(self.device, cfg.mem_fraction_static) // self.rank.memory_share - self.staging


def _sized_tiers(cfg: EngineConfig, budget: _Budget, hybrid: HybridPlan | None, costs: _PageBytes,
                 storage_reachable: bool, host_blocks: bool) -> tuple[int, int, bool, HybridPlan | None, int]:
    """``(device pages, host pages, storage on every rank, hybrid plan, window pages)``, agreed by
    every rank. A hybrid pool's pages cost their full layers' bytes and the ratio's share of the
    window layers' bytes; where its window pool could not be smaller than the full one, every layer
    keeps its KV (said in one line) and the pools are sized as such. A shared pool (automatic
    split): device pages are blocks of one layer's page x G (with --max-total-tokens,
    :meth:`HybridPlan.blocks_for_tokens`), window pages the ids they could hold; ``host_blocks``: its
    host pool is one of blocks too (:func:`_host_pools_apart`), whose --hicache-ratio is of the blocks."""
    if hybrid and hybrid.shared:
        block = costs.layer * len({t for t, _ in hybrid.layout})
        blocks, host_pages, storage = _agreed_tiers(cfg, budget, block, storage_reachable)
        if cfg.max_total_tokens is not None:
            blocks = hybrid.blocks_for_tokens(blocks)
            if host_blocks and host_pages and cfg.hicache_size <= 0:  # agreed figures in, the same on every rank
                host_pages = _host_pool_pages(cfg, blocks, block)
        if hybrid.shared_fits(blocks):
            return blocks, host_pages, storage, hybrid, hybrid.window_ids(blocks)
        logger.info("sliding-window layers keep every cached token's KV: %d blocks hold no request's windows "
                    "beside its pages", blocks - 1)
        return _agreed_tiers(cfg, budget, costs.page, storage) + (None, 0)
    page_cost = hybrid.page_cost(costs.page - costs.window, costs.window) if hybrid else costs.page
    device_pages, host_pages, storage = _agreed_tiers(cfg, budget, -(-page_cost // 1), storage_reachable)
    window_pages = hybrid.window_pages(device_pages) if hybrid else 0
    if hybrid and window_pages >= device_pages:  # keeping every layer's KV costs less
        logger.info("sliding-window layers keep every cached token's KV: a window pool of %d pages (one request's "
                    "window) would not be smaller than the %d-page pool", window_pages - 1, device_pages - 1)
        return _agreed_tiers(cfg, budget, costs.page, storage) + (None, 0)
    return device_pages, host_pages, storage, hybrid, window_pages


def _agreed_tiers(cfg: EngineConfig, budget: _Budget, bytes_per_page: int,
                  storage_reachable: bool) -> tuple[int, int, bool]:
    """``(device pages, host pages, storage on every rank)``, the same on every rank: each count
    MIN-agreed, and the storage tier dropped everywhere if one rank cannot reach it."""
    device_pages = _device_pool_pages(cfg, budget, bytes_per_page)
    host_pages = _host_pool_pages(cfg, device_pages, bytes_per_page) if cfg.enable_hierarchical_cache else 0
    device_pages, host_pages, storage = budget.rank.agree([device_pages, host_pages, int(storage_reachable)])
    return device_pages, host_pages, bool(storage)


def _device_pool_pages(cfg: EngineConfig, budget: _Budget, bytes_per_page: int) -> int:
    """Usable pages + the reserved page 0."""
    if cfg.max_total_tokens is not None:
        return cfg.max_total_tokens // cfg.page_size + 1
    if not bytes_per_page:
        return UNBOUNDED  # (a stage without attention layers: the other stages' count)
    free = budget.free(cfg)
    pages = free // bytes_per_page
    if pages < 1:
        staging = f" after {budget.staging / 2**20:.0f} MiB of staging buffers" if budget.staging else ""
        raise ConfigError(
            f"the KV budget ({max(free, 0) / 2**20:.0f} MiB{staging}) holds no page of {bytes_per_page} bytes; "
            "raise --mem-fraction-static or set --max-total-tokens."
        )
    return int(pages) + 1


def _host_pool_pages(cfg: EngineConfig, device_pages: int, bytes_per_page: int) -> int:
    """Host pages + the reserved page 0: --hicache-size GB, else --hicache-ratio x device."""
    if not bytes_per_page:
        return UNBOUNDED  # (a stage without attention layers: the other stages' count)
    if cfg.hicache_size > 0:
        pages = int(cfg.hicache_size * 1e9 // bytes_per_page)
    else:
        pages = int((device_pages - 1) * cfg.hicache_ratio)
    if pages < 1:
        raise ConfigError("the host KV pool would hold no page; raise --hicache-size or --hicache-ratio.")
    return pages + 1


def _prefill_chunk(cfg: EngineConfig, hybrid: HybridPlan | None, window_pages: int, grid: int) -> int:
    """--chunked-prefill-size, cut (and said once) where a chunk's window pages would not fit in
    a hybrid pool's window component; a whole number of the recurrent layers' snapshot ``grid``
    (tokens; said once where it changes), since every prompt chunk but the last ends on it."""
    chunk = cfg.chunked_prefill_size if not hybrid else hybrid.shared_chunk((window_pages - 1) * hybrid.groups + 1, cfg.chunked_prefill_size) \
        if hybrid.shared else hybrid.prefill_chunk(window_pages, cfg.chunked_prefill_size)
    if chunk < cfg.chunked_prefill_size:
        logger.info("prefill chunks of %d tokens (--chunked-prefill-size %d): the window pool holds %d pages", chunk,
                    cfg.chunked_prefill_size, window_pages - 1)
    if chunk % grid:
        logger.info("prefill chunks of %d tokens (--chunked-prefill-size %d): a whole number of the recurrent "
                    "layers' %d-token snapshot grid", max(chunk // grid, 1) * grid, cfg.chunked_prefill_size, grid)
        chunk = max(chunk // grid, 1) * grid
    return chunk


def _gather_elems(cfg: EngineConfig, rank: RankContext, row: tuple[int, int], max_positions: int) -> int:
    """One prefix-gather buffer's elements (two are allocated) with --enable-kv-cache-sharding over
    a CP group: sized for the longest context (DESIGN invariant 6); 0 without."""
    if rank.cp_group is None or not cfg.enable_kv_cache_sharding:
        return 0
    context = cfg.context_length or max_positions
    if cfg.max_total_tokens is not None:  # no prefix outgrows the logical pool
        context = min(context, rank.cp_group.size * cfg.max_total_tokens)
    return PrefixGather.scratch_elems(rank.cp_group.size, context, cfg.page_size, *row)


def _transfer_staging(cfg: EngineConfig, device: torch.device, layer_page: int, elem: int, hybrid: bool,
                      draft_kv: DraftKV | None) -> int:
    """Device bytes of the host tier's copy staging on a GPU (none on a CPU): a buffer per direction
    for the pools' rows (one layer's K of a page), the window pools' (hybrid) and a sidecar draft's."""
    if device.type != "cuda" or not cfg.enable_hierarchical_cache:
        return 0
    rows = [layer_page // 2] * (2 if hybrid else 1)
    if draft_kv is not None and not draft_kv.packed:
        rows.append(draft_kv.row[0] * draft_kv.row[1] * elem * cfg.page_size)
    return staging_budget(rows)


def _unified_plan(cfg: EngineConfig, spec: ModelSpec, rank: RankContext, draft: ModelSpec | None) -> UnifiedPlan | None:
    """This rank's cells of the unified storage grid (``--hicache-storage-key-scheme unified``)."""
    plans = unified_plans(cfg, spec, draft)
    if not plans:
        return None
    shard, cp = rank.shard, rank.cp_group
    # shard.tp_rank is the attention-TP rank; with CP the full TP rank also counts the CP rank
    tp_rank = 0 if shard is None else shard.tp_rank + (cp.rank * shard.tp_size if cp and rank.split_tokens else 0)
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
