"""Recurrent-state snapshots on the unified storage grid (issue 59; docs/unified_layout.md): a snapshot is
cut into cells of the page grid's layer ranges x *state groups*, so deployments with other TP sizes
write and read the same objects, as they do a page's.

Units: layers are model-global; a state's *units* are what tensor parallelism splits it by
(:func:`hicache.model.parallel.state_axis`: LFM2's conv channels, a gated DeltaNet's key heads with
the value heads that read them, one for an unsplit Mamba2 layer); ranges are half-open.

* :class:`StateGrid` -- the recurrent layers, the page grid's layer ranges, and ``groups``: each
  layer's units cut into that many contiguous groups (``split``), the same in every deployment.
* :class:`StateCell` -- one object of a snapshot: the recurrent layers of a layer range, their units
  of one group; key ``{page_hash}_{namespace_digest}_L{a}-{b}_G{group}_state`` (the boundary's page).
* :func:`plan_states` -- what one rank reads (every cell with units it holds: it takes its slice of
  each) and writes (the cells it holds whole and is the first rank, in rank order, to hold whole).

Object bytes: for each recurrent layer of the range in order, each state tensor as a rank holding
exactly the group's units would keep it (:func:`block_rows`: each block's rows of the units, block
after block), row-major.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...config import ConfigError
from ...model.parallel import split

STATE_SUFFIX = "_state"


def block_rows(blocks: Sequence[int], held: range, units: range) -> list[slice]:
    """The rows of ``units`` (inside ``held``) in the first axis of a state tensor whose holder keeps
    units ``held`` and whose axis is ``blocks`` (rows per unit, block after block): one slice a block."""
    out, at = [], 0
    for rows in blocks:
        out.append(slice(at + (units.start - held.start) * rows, at + (units.stop - held.start) * rows))
        at += rows * len(held)
    return out


@dataclass(frozen=True)
class StateLayer:
    """One recurrent layer: its model-global index, its ``units`` and each state tensor's ``blocks``
    (:func:`~hicache.model.parallel.state_axis`), and the whole model's tensor shapes (named by the key
    namespace)."""

    layer: int
    units: int
    blocks: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class StateCell:
    """The state of recurrent layers ``[layer_start, layer_end)``, units of group ``group``."""

    layer_start: int
    layer_end: int
    group: int

    @property
    def suffix(self) -> str:
        return f"L{self.layer_start}-{self.layer_end}_G{self.group}{STATE_SUFFIX}"


@dataclass(frozen=True)
class StateGrid:
    """``layers``: every recurrent layer of the model, in order; ``layer_ranges``: the page grid's;
    ``groups``: state groups per layer (at most any layer's units)."""

    layers: tuple[StateLayer, ...]
    layer_ranges: tuple[tuple[int, int], ...]
    groups: int

    def units(self, layer: StateLayer, group: int) -> range:
        return split(layer.units, self.groups, group)

    def layers_of(self, cell: StateCell) -> list[StateLayer]:
        return [s for s in self.layers if cell.layer_start <= s.layer < cell.layer_end]

    def cells(self) -> list[StateCell]:
        """Every object of a snapshot: the layer ranges with a recurrent layer, group by group."""
        return [StateCell(a, b, g) for a, b in self.layer_ranges
                if any(a <= s.layer < b for s in self.layers) for g in range(self.groups)]

    def describe(self) -> str:
        """The state layout as the key namespace names it: groups, then each layer's tensors' shapes."""
        shapes = ",".join(f"{s.layer}:" + "+".join("x".join(map(str, t)) for t in s.shapes) for s in self.layers)
        return f"G{self.groups}[{shapes}]"


@dataclass(frozen=True)
class StateShard:
    """What one rank's state pool holds: ``units[i]``, its units of ``grid.layers[i]`` (``range(0)``
    outside its pipeline stage); its pool's buffers are its layers with units, in order."""

    rank: int
    units: tuple[range, ...]

    def local(self, grid: StateGrid, layer: StateLayer) -> int:
        """Index of ``layer`` among this rank's state buffers."""
        index = grid.layers.index(layer)
        return sum(1 for held in self.units[:index] if held)


@dataclass(frozen=True)
class StateCells:
    """One rank's part of a snapshot on the grid: its shard, the cells it reads and writes."""

    grid: StateGrid
    shard: StateShard
    reads: tuple[StateCell, ...]
    writes: tuple[StateCell, ...]


def _holds(grid: StateGrid, shard: StateShard, cell: StateCell, whole: bool) -> bool:
    """Whether ``shard`` holds units of ``cell`` (all of them: ``whole``)."""
    found = []
    for layer in grid.layers_of(cell):
        want, held = grid.units(layer, cell.group), shard.units[grid.layers.index(layer)]
        found.append(held.start <= want.start and want.stop <= held.stop if whole
                     else max(want.start, held.start) < min(want.stop, held.stop))
    return all(found) if whole else any(found)


def plan_states(grid: StateGrid, shards: Sequence[StateShard], rank: int) -> StateCells:
    """Rank ``rank``'s state cells, given every rank's shard (the same list on every rank). A cell's
    writer is the first rank holding it whole; raises :class:`ConfigError` when no rank does."""
    for cell in grid.cells():
        if not any(_holds(grid, s, cell, whole=True) for s in shards):
            raise ConfigError(f"no tensor-parallel rank holds the whole state group {cell.group} of recurrent layers "
                              f"{cell.layer_start}-{cell.layer_end - 1} to write it (the storage grid cuts each "
                              f"recurrent layer's state into {grid.groups} groups, the model's attention heads over "
                              "--hicache-storage-head-partition); change --hicache-storage-head-partition or "
                              "--tp-size.")
    mine = next(s for s in shards if s.rank == rank)
    reads = tuple(c for c in grid.cells() if _holds(grid, mine, c, whole=False))
    writes = tuple(c for c in reads if min(s.rank for s in shards if _holds(grid, s, c, whole=True)) == rank)
    return StateCells(grid, mine, reads, writes)
