"""Recurrent-state snapshots in storage (issue 59, docs/hybrid_kv.md "Recurrent state"): the snapshot
at a stored node's end, written beside the page objects of the page it ends (checksummed and namespaced
like them: :mod:`.objects`) from its host snapshot slot. Rank-suffix key scheme: one
``<page hash hex>-state`` object of this rank's slot (:class:`WholeState`); unified: the cells of the
state grid (:mod:`.state_cells`, :class:`CellState`), each rank writing the cells it is the writer of
and reading every cell it holds units of, of which it takes its slice.

A prefetch reads its pages, then probes the state objects of the grid boundaries in its range,
deepest first (at most :data:`PROBES`): the first found lands in the host snapshot slot reserved
for the op, and the node ending there takes it; a hit is cut back to a boundary with a snapshot
(``TreeStates.usable``), never served a state that did not arrive whole. Every rank agrees on
each probe, all or nothing.

:class:`StoredStates` is the state component's part of the storage controller (its ``parts``):
an op carries the snapshot under ``op.parts["recurrent_state"]`` (:class:`~.storage_ops.PartRead`:
its host slot, ``first`` = the op page count the state ends; :class:`~.storage_ops.PartWrite`: the
op page whose end it is, its host slot).

Units: pages of an op (indices into its hashes); slots of the host state pool.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Callable, Sequence

import torch

from ..state_pool import StatePool
from .guard import GuardedBackend
from .keys import object_key
from .objects import decode_checked, encode
from .page_objects import NAMESPACE_KEY_HEX
from .state_cells import StateCell, StateCells, block_rows
from .storage_ops import BackupOp, PrefetchOp, StorageStats

logger = logging.getLogger(__name__)

SUFFIX = "-state"
PROBES = 4  # state objects a prefetch looks for (no batch existence call: each is a read)


def state_key(page_hash: bytes) -> str:
    return object_key(page_hash) + SUFFIX


class WholeState:
    """Rank-suffix: this rank's whole slot, every state tensor in the pool's one order, ``<hash hex>-state``."""

    def __init__(self, pool: StatePool) -> None:
        self.pool = pool

    def key(self, page_hash: bytes, ns_digest: bytes) -> str:
        return state_key(page_hash)

    def payload(self, slot: int) -> bytes:
        return b"".join(_bytes(t[slot]) for layer in self.pool.buffers for t in layer)

    def load(self, slot: int, payload: memoryview) -> bool:
        """Put a payload back into ``slot``; False (nothing written) when its length is not a slot's."""
        if payload.nbytes != self.pool.bytes_per_slot:
            return False
        raw, at = _raw(payload), 0
        for layer in self.pool.buffers:
            for t in layer:
                n = t[slot].numel() * t.element_size()
                t[slot].copy_(raw[at:at + n].view(t.dtype).view(t[slot].shape))
                at += n
        return True


class CellState:
    """Unified: one cell of the state grid (``plan``: this rank's :class:`~.state_cells.StateCells`),
    ``{hash hex}_{namespace digest}_L{a}-{b}_G{g}_state``. Each of its state tensors is kept as a rank
    holding exactly the cell's units would keep it; this rank writes it (a cell it holds whole) from its
    rows of a slot, and loads the rows of the cell's units it holds into a slot."""

    def __init__(self, pool: StatePool, plan: StateCells, cell: StateCell) -> None:
        self.cell = cell
        grid, shard = plan.grid, plan.shard
        # per state tensor of the cell's layers: (this rank's buffer, its rows, the cell's rows, the cell's shape)
        self.parts: list[tuple[torch.Tensor, list[slice], list[slice], tuple[int, ...]]] = []
        for layer in grid.layers_of(cell):
            want, held = grid.units(layer, cell.group), shard.units[grid.layers.index(layer)]
            lo, hi = max(want.start, held.start), min(want.stop, held.stop)
            take = range(lo, max(lo, hi))  # the units of the cell this rank holds
            buffers = pool.buffers[shard.local(grid, layer)]
            for t, blocks in enumerate(layer.blocks):
                shape = (sum(blocks) * len(want), *layer.shapes[t][1:])
                self.parts.append((buffers[t], block_rows(blocks, held, take) if take else [],
                                   block_rows(blocks, want, take) if take else [], shape))
        self.nbytes = sum(math.prod(shape) * buffer.element_size() for buffer, _, _, shape in self.parts)

    def key(self, page_hash: bytes, ns_digest: bytes) -> str:
        return f"{object_key(page_hash)}_{ns_digest.hex()[:NAMESPACE_KEY_HEX]}_{self.cell.suffix}"

    def payload(self, slot: int) -> bytes:
        """The cell's bytes (this rank holds it whole: its rows are the cell's, block after block)."""
        return b"".join(_bytes(torch.cat([buffer[slot][rows] for rows in mine])) for buffer, mine, _, _ in self.parts)

    def load(self, slot: int, payload: memoryview) -> bool:
        """This rank's rows of the cell into ``slot``; False (nothing written) when the length is not the cell's."""
        if payload.nbytes != self.nbytes:
            return False
        raw, at = _raw(payload), 0
        for buffer, mine, theirs, shape in self.parts:
            n = math.prod(shape) * buffer.element_size()
            cell = raw[at:at + n].view(buffer.dtype).view(shape)
            for dst, src in zip(mine, theirs):
                buffer[slot][dst].copy_(cell[src])
            at += n
        return True


StateObject = WholeState | CellState


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _raw(payload: memoryview) -> torch.Tensor:
    """A payload as uint8 (read-only source: torch warns, but it is only read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=torch.uint8)


class StoredStates:
    """Reads and writes the snapshots of ``pool`` (the host state pool) at ``pool.grid``-token boundaries:
    ``objects`` (reads, writes) of a snapshot (default: one :class:`WholeState`, both ways)."""

    name = "recurrent_state"

    def __init__(self, pool: StatePool, page_size: int,
                 objects: tuple[Sequence[StateObject], Sequence[StateObject]] | None = None) -> None:
        self.pool, self.page_size = pool, page_size
        self.reads, self.writes = objects if objects is not None else ([WholeState(pool)],) * 2

    def _load(self, guard: GuardedBackend, op: PrefetchOp, k: int, stats: StorageStats) -> int:
        """1 when every object of the state at the end of op page ``k`` arrived intact and was loaded."""
        part, h = op.parts[self.name], op.hashes[k - 1]
        blobs = guard.batch_get([obj.key(h, op.ns_digest) for obj in self.reads])
        for obj, blob in zip(self.reads, blobs):
            payload, status = decode_checked(blob, op.ns_digest, h)
            if payload is None:
                if status.value != "missing":
                    stats.failures[f"state_{status.value}"] += 1
                return 0
            if not obj.load(int(part.host_pages[0]), payload):
                return 0
        return 1

    def read(self, guard: GuardedBackend, op: PrefetchOp, stats: StorageStats,
             agree: Callable[[list[int]], list[int]]) -> None:
        """Probe the grid boundaries of the pages read, deepest first; the first every rank found
        intact is the op's (``part.first``: pages of the op before it)."""
        part = op.parts.get(self.name)
        done = op.progress[-1][0] if op.progress else 0
        grid_pages = self.pool.grid // self.page_size
        ends = [k for k in range(done, 0, -1) if (op.start_page + k) % grid_pages == 0][:PROBES] \
            if part is not None and not op.stop.is_set() else []
        for k in ends:
            ok = 0
            try:  # (a pipeline stage without recurrent layers has nothing to read: the other stages decide)
                ok = self._load(guard, op, k, stats) if self.pool.buffers else 1
            except Exception as e:  # the pages stand; the hit is cut back to a snapshot held elsewhere
                logger.warning("prefetch op=%d: reading a state at page %d failed: %s", op.op_id, k, e)
            if agree([ok])[0]:
                part.first = k
                stats.prefetch_bytes += self.pool.bytes_per_slot
                return

    def write(self, guard: GuardedBackend, op: BackupOp, stats: StorageStats) -> None:
        """The snapshot at the end of the op's last page (``part.index``), from its host slot: this
        rank's objects of it (none: another rank writes them all)."""
        part = op.parts.get(self.name)
        if part is None or not self.writes or not self.pool.buffers:  # (a pipeline stage without recurrent layers)
            return
        i, slot = int(part.index[0]), int(part.host_pages[0])
        blobs = [encode(op.ns_digest, op.hashes[i], obj.payload(slot)) for obj in self.writes]
        stored = guard.batch_set([obj.key(op.hashes[i], op.ns_digest) for obj in self.writes], blobs)
        stats.backup_bytes += sum(len(b) for b in blobs[:stored])
