"""Request-facing cache operations, composed from the tiers: admit (match + lock + reserve),
cache a computed prefix, release, and the step's fixed points for the tiers' queues (submit
transfers, report and consume acks, prefetch lifecycle). The engine calls these on its
scheduler thread only; the manager knows nothing of requests beyond the :class:`KVState` it
hands out.

Composition: :class:`~.device_tier.DeviceTier` (L1) -> :class:`~.host_tier.HostTier` (L2, with
a host pool) -> :class:`~.storage_tier.StorageTier` (L3, with a backend; needs the host tier).
The lower tiers form ``tiers``, in that order: acks are reported, consumed and drained tier by
tier, so a consumed host backup may queue the storage write consumed right after it.

Units: ``tokens`` are token-id sequences; lengths are tokens unless named ``*_pages``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from ..consensus_record import consensus_check
from .acks import AckCounts
from .content_index import Unreadable
from .device_tier import DeviceTier, KVState
from .host_pool import HostKVPool
from .host_tier import HostTier
from .host_transfer import TransferController
from .placement import PagePlacement, ShardedPageAllocator, ShardView
from .pools import DeviceKVPool, PageAllocator
from .retention import RetainedPrefixes
from .device_state import DeviceStates
from .host_state import HostStates
from .state_pool import StatePool
from .storage.base import StorageBackend
from .storage.keys import OBJECT_LAYOUT_V1, KeyNamespace
from .storage.page_objects import DRAFT_PREFIX, WINDOW_SUFFIX, GridCell
from .storage.prefetch_backup import Agree, PrefetchOp
from .storage.state_objects import CellState
from .storage.unified import Cell, RankObjects, RankShard, StorageGrid, UnifiedPlan
from .storage_tier import GridObjects, StorageTier, consume_prefetch_acks
from .tiers import CachePolicy, CacheStats, Tier

__all__ = ["CachePolicy", "KVCacheManager", "KVState", "CacheStats", "RankLayout"]


@dataclass(frozen=True)
class RankLayout:
    """This rank's share of the deployment's KV (defaults: one rank alone).

    ``shard`` names its slice (layers, heads) so ranks never share storage objects;
    ``storage_agree``: MIN-reduce functions for the prefetch and backup threads when several
    ranks share the deployment; ``placement``: device and host pages are page-sharded over a
    shard group of which this rank is ``shard_rank`` (the pools hold its local pages; page ids
    everywhere else are logical; copies and storage objects move its own pages only);
    ``sidecar``: device (and host) pools of more KV on the same page ids with rows of their own
    (a speculative draft's): every copy and storage object of a page carries its share, and the
    model reads it through :attr:`KVCacheManager.sidecar_view`; ``unified``: storage objects
    follow the unified grid (``--hicache-storage-key-scheme unified``): this rank's read and
    write cells, under a namespace every compatible deployment shares; ``states``: the recurrent
    layers' state slots beside the KV pages (issue 59), read through :attr:`KVCacheManager.kv_view`;
    ``host_states``: the host tier's snapshot slots (with a host pool)."""

    shard: str = ""
    storage_agree: tuple[Agree, Agree] | None = None
    placement: PagePlacement | None = None
    shard_rank: int = 0
    sidecar: tuple[DeviceKVPool, HostKVPool | None] | None = None
    unified: UnifiedPlan | None = None
    states: StatePool | None = None
    host_states: StatePool | None = None


class _KVView:
    """The model's view: device buffers, with reads of layer i gated on in-flight loads
    (``offset``: the pool's layers come after that many others in each transfer: a sidecar)."""

    def __init__(self, pool: DeviceKVPool, controller: TransferController | None, offset: int = 0,
                 states: StatePool | None = None) -> None:
        self.k_buffers, self.v_buffers = pool.k_buffers, pool.v_buffers
        self.state_buffers = states.buffers if states is not None else []
        if pool.windows.shared:
            self.window_group = pool.windows.group  # each sliding group reads slots of its own (issue 56)
        if controller is None:
            self.wait_layer, self.layer_ready = pool.wait_layer, pool.layer_ready
        else:
            self.wait_layer = lambda layer: controller.wait_layer(offset + layer)
            self.layer_ready = lambda layer: controller.layer_ready(offset + layer)


def _key_namespace(pool: DeviceKVPool, shard: str, unified: UnifiedPlan | None,
                   states: StatePool | None = None) -> KeyNamespace:
    """What names this rank's page objects: its own layers and KV heads (rank-suffix), or the
    whole model's grid (unified: the same on every rank of every compatible deployment)."""
    if unified is not None:
        return unified.key_namespace(pool.page_size, str(pool.dtype), pool.row[1], pool.windows.window)
    # a hybrid pool's objects: full layers (the page object), window layers (checkpoints' "-window"
    # objects): a namespace of their own, so every-layer objects are never read as these
    w = pool.windows
    layout = f"{OBJECT_LAYOUT_V1};window={w.window}x{len(w.layers)}" if pool.hybrid else OBJECT_LAYOUT_V1
    if states is not None:  # recurrent layers: "-state" objects of this slot size, on this grid
        layout += f";state={states.bytes_per_slot}Bx{len(states.buffers)}@{states.grid}"
    return KeyNamespace(pool.page_size, str(pool.dtype), pool.row, len(pool.k_buffers) - len(w.layers),
                        shard, layout)


Objects = tuple[list[GridCell], list[GridCell]]


def _cut(host: HostKVPool, base: int, grid: StorageGrid, shard: RankShard, objects: RankObjects, prefix: str = "",
         suffix: str = "") -> Objects:
    """(reads, writes) of one component's ``grid`` cut from ``host``: a cell's rows are where ``host``
    keeps its layers (``shard``'s model-global layer g is the device pool's ``base + g - shard's
    first``, or, with recurrent layers, ``base +`` the stage's layers with KV before g); a cell none of
    whose layers ``host`` keeps is no object (writes are among the reads)."""
    kv = shard.kv_layers if shard.kv_layers is not None else shard.layers

    def row(layer: int) -> int:  # the device pool's row of the first layer with KV from ``layer`` on
        return base + bisect.bisect_left(kv, layer) - bisect.bisect_left(kv, shard.layers.start)
    rows = {c: slice(bisect.bisect_left(host.layers, row(c.layer_start)),
                     bisect.bisect_left(host.layers, row(c.layer_end))) for c in objects.reads}

    def cells(of: tuple[Cell, ...]) -> list[GridCell]:
        return [GridCell(host, c, grid, 0, shard.kv_heads.start, prefix, rows[c], suffix) for c in of
                if rows[c].start < rows[c].stop]
    return cells(objects.reads), cells(objects.writes)


def _grid_objects(host_pool: HostKVPool, plan: UnifiedPlan, sidecar_host: HostKVPool | None, pool_layers: int,
                  host_states: StatePool | None) -> GridObjects:
    """This rank's objects cut from its host pages, component by component: of every page, the target's
    layers (a hybrid pool's full ones) and a draft's beside them (packed: the last of the device pool's
    ``pool_layers``, or in the sidecar's host pool; keys ``..._draft_L{a}-{b}``); then, None without a
    window component, its window layers of checkpoint pages from the window host pool (``..._swa``); then,
    None without recurrent layers, the cells of a snapshot in ``host_states`` (``..._G{g}_state``)."""
    s, d, st = plan.shard, plan.draft, plan.states
    reads, writes = _cut(host_pool, 0, plan.grid, s, plan.objects)
    if d is not None:
        base = 0 if sidecar_host is not None else pool_layers - d.grid.num_layers
        draft_reads, draft_writes = _cut(sidecar_host or host_pool, base, d.grid, d.shard, d.objects, DRAFT_PREFIX)
        reads, writes = reads + draft_reads, writes + draft_writes
    window = host_pool.window_pool
    windows = None if window is None else _cut(window, 0, plan.grid, s, plan.objects, suffix=WINDOW_SUFFIX)
    states = None if st is None or host_states is None else tuple(
        [CellState(host_states, st, c) for c in cells] for cells in (st.reads, st.writes))
    return GridObjects((reads, writes), windows, states)


class KVCacheManager:
    """The tiers behind one API. Kept as attributes for callers: the device pool and its
    allocator, the radix tree (None when reuse is off) and, with a host tier, the host pool,
    its allocator and the transfer controller; with storage, its controller (``storage``)."""

    def __init__(self, pool: DeviceKVPool, host_pool: HostKVPool | None = None, storage: StorageBackend | None = None,
                 policy: CachePolicy | None = None, layout: RankLayout | None = None) -> None:
        """``pool``: the device tier's pages; ``host_pool``: the host tier's (None: no host
        tier); ``storage``: the storage tier's backend (needs a host pool); ``policy`` and
        ``layout`` default to :class:`CachePolicy` and :class:`RankLayout` as they come."""
        policy, layout = policy or CachePolicy(), layout or RankLayout()
        if storage is not None and host_pool is None:
            raise ValueError("a storage tier needs a host pool (its prefetches land in host pages)")
        placement, sidecar, unified = layout.placement, layout.sidecar, layout.unified
        sharded = placement is not None and placement.num_shards > 1
        shard_view = ShardView(placement, layout.shard_rank) if sharded else None
        self.pool, self.page_size, self.host_pool = pool, pool.page_size, host_pool
        self.stats = CacheStats()
        self.host_allocator: PageAllocator | ShardedPageAllocator | None = None
        if host_pool is not None:
            self.host_allocator = ShardedPageAllocator(placement, host_pool.num_pages) if sharded \
                else PageAllocator(host_pool.num_pages)
        self.device = DeviceTier(pool, policy.eviction_policy, policy.enable_prefix_cache, self.host_allocator,
                                 self.stats, placement, layout.states)
        self.allocator, self.tree = self.device.allocator, self.device.tree
        self.capacity_pages = self.allocator.capacity
        # usable pages of each component with a page space of its own (the full KV's are capacity_pages)
        self.component_pages = {"full": self.capacity_pages}
        self.cache_generated = policy.cache_generated
        if self.device.windows is not None:
            self.component_pages["window"] = self.device.windows.allocator.capacity
            self.device.windows.prompt_only = not policy.cache_generated
        if self.device.states is not None:
            self.device.states.turn_ends = policy.turn_end_states
        self.keys = _key_namespace(pool, layout.shard, unified, layout.states)
        self.host: HostTier | None = None if host_pool is None else HostTier(
            pool, host_pool, self.host_allocator, self.tree, policy, self.stats, shard_view,
            [sidecar] if sidecar else [])
        tree_states = self.device.states.snapshots if self.device.states is not None else None
        self.host_states = HostStates(layout.host_states, layout.states, tree_states) \
            if self.host is not None and layout.host_states is not None and tree_states is not None else None
        if self.host is not None:
            self.host.states = self.host_states  # (its storage tier reads and writes them)
        self.storage_tier: StorageTier | None = None
        if storage is not None:
            objects = _grid_objects(host_pool, unified, sidecar[1] if sidecar else None, len(pool.k_buffers),
                                    layout.host_states) if unified else None
            self.storage_tier = StorageTier(storage, self.host, self.keys, layout.storage_agree, policy, shard_view,
                                            objects)
            self.host.lower = self.storage_tier
        self.device.lower = self.host
        # clients' retention hints: at most this fraction of each pool (``retention.apply`` at release)
        fraction = policy.retention_max_fraction
        self.retention = RetainedPrefixes(self.tree, [int(fraction * self.capacity_pages), None if self.host is None
                                                      else int(fraction * self.host_allocator.capacity)],
                                          self.storage_tier, fraction)
        # the lower tiers, top down
        self.tiers: list[Tier] = [t for t in (self.host, self.storage_tier) if t is not None]
        if self.host is not None and self.device.windows is not None:
            self.device.windows.settle_backups = self._settle_host
        self.controller = self.host.controller if self.host is not None else None
        self.storage = self.storage_tier.controller if self.storage_tier is not None else None
        self.kv_view = _KVView(pool, self.controller, states=layout.states)
        self.sidecar_view = None if sidecar is None else _KVView(sidecar[0], self.controller, len(pool.k_buffers))

    def window_tail(self, prompt_tokens: int) -> int | None:
        """A hybrid pool: the first token of a prompt's fresh SWA tail (the window its checkpoint and
        first decode step read), which P/D moves for the window layers; None without a window pool."""
        return None if self.device.windows is None else self.device.windows.tail_page(prompt_tokens) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return self.device.pages_for(num_tokens)

    @property
    def device_states(self) -> DeviceStates | None:
        """The device tier's recurrent-state slots (P/D moves a prompt's states); None without recurrent layers."""
        return self.device.states

    # ---- requests ------------------------------------------------------------------------
    @consensus_check("cache.admit", args=lambda self, ns, tokens, reserve, storage=0, forward=0, kv_arrives=False:
                     (ns, len(tokens), reserve, storage, forward, kv_arrives),
                     result=lambda s: None if s is None else (s.device_hit_tokens, s.host_hit_tokens,
                                                              s.storage_hit_tokens, len(s.pages)))
    def admit(self, namespace: str, tokens: np.ndarray, reserve_tokens: int, storage_tokens: int = 0,
              forward_tokens: int = 0, kv_arrives: bool = False) -> KVState | None:
        """Match ``tokens`` (the prompt), lock the hit and reserve pages up to ``reserve_tokens``
        (prompt + most output). A host hit gets device pages and a load-back (submitted with
        :meth:`submit_transfers`). Returns None, with nothing changed, when the pool cannot hold
        the request even after evicting unlocked cache. ``storage_tokens`` of the host hit came
        from a prefetch: they are counted as storage hits.

        At least one prompt token is always left uncomputed so the prompt yields logits.
        ``forward_tokens``: the most tokens one of the request's forwards adds (a hybrid pool
        reserves its window pages for that). ``kv_arrives``: the prompt's KV arrives from
        elsewhere (P/D decode): a hybrid pool hits full layers whatever its windows and holds
        pages for the window of the prompt's end, to receive (``KVState.window.arrival``).
        """
        admitted = self.device.admit(namespace, tokens, reserve_tokens, storage_tokens, forward_tokens, kv_arrives)
        if admitted is None:
            return None
        state, host_nodes, restored = admitted
        if host_nodes or restored:
            self.host.load_back(host_nodes, windows=not kv_arrives, device_hit_windows=restored)
        if state.node is not None and self.host is not None:
            self.host.on_insert(state.node)  # a hit may reach write_through_selective's threshold
        return state

    def cache_prefix(self, namespace: str, tokens: np.ndarray, state: KVState) -> None:
        """Insert the whole pages of ``tokens`` (whose KV is computed) into the tree and move
        the request's lock to the new boundary, so concurrent requests can share it."""
        self.device.cache_prefix(namespace, tokens, state)

    @consensus_check("cache.before_forward", args=lambda self, state, computed, new, later, prompt:
                     (computed, new, later, prompt))
    def before_forward(self, state: KVState, computed: int, new_tokens: int, later_tokens: int,
                       prompt_tokens: int) -> None:
        """Before a forward that adds ``new_tokens`` after ``computed`` (of a prompt of ``prompt_tokens``):
        the components whose pages follow the forward take them (a hybrid pool's window: holds their window
        pages, frees the request's own that fell behind its window; recurrent layers: the snapshot slots a
        prompt pass writes); ``later_tokens``: the most a later forward of the request adds (its reservation
        shrinks to that)."""
        if self.device.windows is not None:
            self.device.windows.step(state, computed, new_tokens, later_tokens)
        if self.device.states is not None:
            self.device.states.step(state.state, computed, new_tokens, prompt_tokens)

    def accept_rows(self, state: KVState, kept: int) -> None:
        """A verify pass's first ``kept`` rows (the last token + the accepted drafts) are the request's
        context now: recurrent layers keep the state after them, not after the rejected drafts."""
        if self.device.states is not None:
            self.device.states.accept(state.state, kept)

    @property
    def chunk_grid(self) -> int:
        """Tokens every prompt chunk but a prompt's last ends on a multiple of: the recurrent layers'
        snapshot grid (1: no constraint)."""
        return self.device.states.grid if self.device.states is not None else 1

    def chunk_tokens(self, computed: int, new_tokens: int, prompt_tokens: int) -> int:
        """A prompt chunk's length, ``new_tokens`` cut so that a chunk before the prompt's last ends on
        :attr:`chunk_grid` (the next one then starts where a hit's would, and its scan blocks are the
        cold run's); 0 where that leaves nothing (the request waits for a step with more budget: a
        chunk off the grid would split a scan block, and a later hit would not give the cold run's bits)."""
        grid, end = self.chunk_grid, computed + new_tokens
        if grid == 1 or end >= prompt_tokens:
            return new_tokens
        return max(end // grid * grid - computed, 0)

    def release(self, namespace: str, tokens: np.ndarray, state: KVState, prompt_tokens: int | None = None) -> None:
        """The request is done: cache the whole pages of ``tokens`` (those whose KV is computed; of
        them only its first ``prompt_tokens``, the prompt's, unless ``policy.cache_generated``:
        decode steps compute a reply's KV with other arithmetic than a prefill, which a later
        prompt hitting it would inherit), free every other page the request held, drop its lock."""
        if prompt_tokens is not None and not self.cache_generated:
            tokens = tokens[:prompt_tokens]
        self.device.release(namespace, tokens, state)

    # ---- the tiers' queues ---------------------------------------------------------------
    def submit_transfers(self) -> None:
        """Submit this step's queued loads and backups, merged into one op per direction."""
        if self.host is not None:
            self.host.submit()

    def ack_counts(self) -> AckCounts:
        """Leading acks ready on this rank, per queue (the input to agreement)."""
        return sum((t.ready_acks() for t in self.tiers), AckCounts())

    @consensus_check("cache.consume_acks", args=lambda self, acks: acks.to_list())
    def consume_acks(self, acks: AckCounts) -> None:
        """Apply exactly the given leading acks: unlock their nodes, count their bytes."""
        for tier in self.tiers:
            tier.consume_acks(acks)

    def unreadable_pages(self) -> Unreadable:
        """Pages whose KV a copy between the tiers may still be writing (none without a host tier)."""
        return self.host.unreadable() if self.host is not None else Unreadable()

    def has_pending_transfers(self) -> bool:
        return any(t.has_pending() for t in self.tiers)

    def drain_ready(self) -> None:
        """Idle housekeeping: submit queued transfers and apply the acks that are ready now,
        never waiting (a hung storage backend must not hold the scheduler thread). Acks that
        are not ready yet stay for a later call; the caller comes back while
        :meth:`has_pending_transfers`."""
        if self.tiers:
            self.submit_transfers()
            self.consume_acks(self.ack_counts())

    def drain(self) -> None:
        """Submit and consume every transfer, storage writes included, waiting for them (flush
        and shutdown only: storage calls are bounded by their deadlines, see storage.guard).
        Tier by tier: host backups consumed first may queue storage writes."""
        self.submit_transfers()
        for tier in self.tiers:
            self.consume_acks(tier.pending_acks())

    def _settle_host(self) -> None:
        """Wait for every host copy in flight and apply its ack (each rank has the same ones queued:
        the same decision everywhere). A hybrid pool's window allocation runs short of pages while
        backups still hold their checkpoints' window locks."""
        self.submit_transfers()
        self.consume_acks(self.host.pending_acks())

    # ---- storage tier (L3) ---------------------------------------------------------------
    def ns_digest(self, namespace: str) -> bytes:
        """Head of the hash chain of ``namespace`` on this rank (see :class:`KeyNamespace`)."""
        return self.keys.digest(namespace)

    def start_prefetch(self, namespace: str, tokens: np.ndarray) -> PrefetchOp | None:
        """Ask storage for the prompt's pages past what the device and host tiers hold, if the
        uncached tail is long enough and prefetches hold few enough host pages."""
        return self.storage_tier.start_prefetch(namespace, tokens) if self.storage_tier is not None else None

    @staticmethod
    def prefetch_ack_count(op: PrefetchOp) -> int:
        """Progress acks published so far (the input to agreement)."""
        return len(op.progress)

    def consume_prefetch_acks(self, op: PrefetchOp, n: int) -> bool:
        """Apply the first ``n`` progress acks; True once the final one is applied."""
        return consume_prefetch_acks(op, n)

    @consensus_check("cache.finish_prefetch", args=lambda self, op, tokens: (op.namespace, op.start_page, op.completed),
                     result=lambda inserted: inserted)
    def finish_prefetch(self, op: PrefetchOp, tokens: np.ndarray) -> int:
        """Stop waiting: insert the pages the consumed acks cover as host-only nodes, release
        the rest (once the reader is done with them). Returns the tokens inserted."""
        return self.storage_tier.finish_prefetch(op, tokens)

    # ---- lifetime and figures ------------------------------------------------------------
    def flush(self) -> None:
        """Drop all cached prefixes in every tier. Only valid when no request holds pages."""
        self.drain()
        if self.tree is not None:
            self.tree.reset()
        if self.allocator.available != self.allocator.capacity:
            raise RuntimeError("flush while requests still hold device pages")

    def shutdown(self) -> None:
        self.drain()
        for tier in self.tiers:
            tier.shutdown()

    def usage(self) -> dict:
        return self.device.usage()

    def host_usage(self) -> dict | None:
        if self.host is None:
            return None
        states = {"recurrent_state": self.host_states.usage()} if self.host_states is not None else {}
        return {**self.host.usage(), **states}
