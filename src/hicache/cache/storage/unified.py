"""The unified storage layout (seed section 4, Figure 4): every token page is cut on one fixed
grid of model-global layer ranges x KV-head groups, so deployments with different TP / PP
layouts write and read the same L3 objects.

Units: layers and heads are model-global indices; ranges are half-open ``[start, end)``.

* :class:`StorageGrid` -- the grid all compatible deployments agree on: layer ranges of
  ``layer_partition`` layers (the last may be shorter) x groups of ``head_partition`` KV heads
  (MHA), or layer ranges alone (MLA: one latent, the same on every rank).
* :class:`Cell` -- one object of a page: its layer range and head group; ``suffix`` is the tail
  of its key, ``{page_hash}_{namespace_digest}_L{start}-{end}[_H{group}]``.
* :func:`plan_rank` -- what one rank reads (the cells covering its shard) and writes (the cells
  it is the designated writer of: the first rank, in rank order, whose shard covers the cell,
  so each object has exactly one writer). A shard that does not align with the grid is refused
  in one sentence naming the flag to change.

Object byte layout: MHA ``(layer, K/V, token_in_page, head_in_group, head_dim)`` for one head
group (the seed's ``(head_group, layer, K/V, ...)`` restricted to the group), so a layer
sub-range is one contiguous byte span; MLA ``(layer, token_in_page, dim)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ...config import ConfigError
from .keys import KeyNamespace
from .state_cells import StateCells

UNIFIED_LAYOUT_V1 = "unified/v1"


@dataclass(frozen=True)
class Cell:
    """One object of every page: layers ``[layer_start, layer_end)`` of head group ``group``
    (None for MLA, whose latent has no head axis)."""

    layer_start: int
    layer_end: int
    group: Optional[int]

    @property
    def suffix(self) -> str:
        head = f"_H{self.group}" if self.group is not None else ""
        return f"L{self.layer_start}-{self.layer_end}{head}"


@dataclass(frozen=True)
class StorageGrid:
    """Layer ranges x head groups of one model; ``mla``: one latent per token and layer,
    replicated on every TP rank (no head groups)."""

    num_layers: int
    num_kv_heads: int
    layer_partition: int
    head_partition: int
    mla: bool = False

    def __post_init__(self) -> None:
        if self.layer_partition < 1 or self.layer_partition > self.num_layers:
            raise ConfigError(f"--hicache-storage-layer-partition must be in [1, {self.num_layers}] "
                              f"(the model's layers), got {self.layer_partition}.")
        if not self.mla and (self.head_partition < 1 or self.num_kv_heads % self.head_partition):
            raise ConfigError(f"--hicache-storage-head-partition must divide the model's {self.num_kv_heads} KV "
                              f"heads, got {self.head_partition}.")

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        p = self.layer_partition
        return [(a, min(a + p, self.num_layers)) for a in range(0, self.num_layers, p)]

    @property
    def groups(self) -> list[Optional[int]]:
        return [None] if self.mla else list(range(self.num_kv_heads // self.head_partition))

    def cells(self) -> list[Cell]:
        """Every object of a page, layer range by layer range, group by group."""
        return [Cell(a, b, g) for a, b in self.layer_ranges for g in self.groups]

    def heads_of(self, cell: Cell) -> range:
        """The model-global KV heads ``cell`` holds (MLA: the one latent row)."""
        if cell.group is None:
            return range(0, 1)
        return range(cell.group * self.head_partition, (cell.group + 1) * self.head_partition)

    def describe(self) -> str:
        """The grid as the key namespace names it."""
        heads = "mla" if self.mla else f"H{self.head_partition}of{self.num_kv_heads}"
        return f"L{self.layer_partition}of{self.num_layers},{heads}"


@dataclass(frozen=True)
class RankShard:
    """What one rank's KV pool holds, in model-global indices."""

    rank: int
    layers: range
    kv_heads: range
    kv_layers: Optional[tuple[int, ...]] = None  # the layers with KV (a model with recurrent layers); None: all


@dataclass(frozen=True)
class RankObjects:
    """The cells one rank reads (covering its shard) and writes (those it is the writer of)."""

    reads: tuple[Cell, ...]
    writes: tuple[Cell, ...]


@dataclass(frozen=True)
class UnifiedPlan:
    """This rank's part in the unified layout: the grid, its shard, its read and write sets
    (and its draft's, on the first stage of a speculative deployment).

    ``draft``: a speculative draft's KV on the unified layout: a grid of its own (the same partition
    flags, its layers and heads), cells keyed ``..._draft_L{a}-{b}[_H{g}]``; planned on the first
    pipeline stage, where the draft runs. The tree namespace names the draft, so the draft grid
    needs no field of its own in the key namespace."""

    grid: StorageGrid
    shard: RankShard
    objects: RankObjects
    draft: Optional[UnifiedPlan] = None
    states: Optional[StateCells] = None  # a model with recurrent layers: this rank's cells of a snapshot

    def key_namespace(self, page_size: int, kv_dtype: str, head_dim: int, window: int = 0) -> KeyNamespace:
        """The key namespace of unified objects: the whole model's grid and no rank, so every
        compatible deployment computes the same chain head for the same tree namespace.
        ``window``: a hybrid pool's (its cells split into full and window objects, checkpoints'
        only for the latter): a namespace of its own, never read as every-layer objects. Recurrent
        layers: their state grid (:meth:`~.state_cells.StateGrid.describe`; the tree namespace's model
        dtype and page size fix the state's dtypes and snapshot grid). Its object
        layout records the layout version and the grid (which says MHA head groups or a replicated
        MLA latent)."""
        grid = self.grid
        layout = f"{UNIFIED_LAYOUT_V1}:{grid.describe()}" + (f";window={window}" if window else "") \
            + (f";state={self.states.grid.describe()}" if self.states else "")
        return KeyNamespace(page_size, kv_dtype, (grid.num_kv_heads, head_dim), grid.num_layers, "", layout)


def plan_rank(grid: StorageGrid, shards: Sequence[RankShard], rank: int) -> RankObjects:
    """Rank ``rank``'s read and write sets, given every rank's shard (the same list on every
    rank, so every rank agrees on who writes what). Raises :class:`ConfigError` when a shard
    does not align with the grid."""
    for shard in shards:
        _check_aligned(grid, shard)
    mine = next(s for s in shards if s.rank == rank)
    # (a model with recurrent layers: a cell none of whose layers has KV is no object)
    reads = tuple(c for c in grid.cells() if _covers(grid, mine, c) and (
        mine.kv_layers is None or any(c.layer_start <= i < c.layer_end for i in mine.kv_layers)))
    # a cell's writer: the first rank whose shard covers it (an MLA latent or KV heads held by several
    # TP ranks: the lowest of them)
    writes = tuple(c for c in reads if min(s.rank for s in shards if _covers(grid, s, c)) == rank)
    return RankObjects(reads, writes)


def _covers(grid: StorageGrid, shard: RankShard, cell: Cell) -> bool:
    heads = grid.heads_of(cell)
    return (shard.layers.start <= cell.layer_start and cell.layer_end <= shard.layers.stop
            and (cell.group is None or (shard.kv_heads.start <= heads.start and heads.stop <= shard.kv_heads.stop)))


def _check_aligned(grid: StorageGrid, shard: RankShard) -> None:
    """A shard must be a union of whole cells: its layers start on a layer-range boundary and
    end on one (or at the model's last layer), its KV heads are whole head groups."""
    p = grid.layer_partition
    a, b = shard.layers.start, shard.layers.stop
    if a % p or (b % p and b != grid.num_layers):
        raise ConfigError(f"a pipeline stage holds layers {a}-{b - 1}, which do not start and end on the storage "
                          f"grid's layer ranges of {p}; set --hicache-storage-layer-partition to a divisor of every "
                          "stage's first layer (or change --pp-size).")
    if grid.mla:
        return
    h = grid.head_partition
    if shard.kv_heads.start % h or shard.kv_heads.stop % h:
        raise ConfigError(f"a tensor-parallel rank holds KV heads {shard.kv_heads.start}-{shard.kv_heads.stop - 1}, "
                          f"which are not whole groups of {h}; set --hicache-storage-head-partition to a divisor of "
                          "every rank's KV heads (or change --tp-size).")
