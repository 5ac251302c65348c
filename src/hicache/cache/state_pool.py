"""The device pool's recurrent-state slots (issue 59): per recurrent layer, its state tensors.

A recurrent layer (LFM2's short convolution; later gated DeltaNet and Mamba2) keeps no KV history:
its per-sequence state at position t summarises every token before t. Every layer's state of one
sequence sits at the same *slot* index of each of that layer's tensors; a slot is the unit every
mover (device copies, later the host tier, storage objects and P/D) moves, enumerated from
:attr:`StatePool.buffers` alone so no mover forgets a side tensor.

Units: slots (one sequence's whole state over this rank's recurrent layers). Slot 0 is the zero
state: read by a sequence starting at position 0, never written, never handed out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch


logger = logging.getLogger(__name__)

# One recurrent layer's state: each tensor's per-slot shape and dtype (LFM2: one conv tensor)
LayerState = tuple[tuple[tuple[int, ...], torch.dtype], ...]


@dataclass
class StateHold:
    """One request's hold on the state pool: its running ``slot``, read and written in place by each
    of its forwards but the first, which reads ``source`` (0: the zero state; else a snapshot the
    request's tree lock keeps) as the state after the first ``start`` tokens of its context.
    ``branch``: a boundary past its hit where the tree's path branches (0: none), which its forward
    snapshots. ``forward``: the snapshots its next forward writes, ``(position, slot)``; ``taken``:
    those written and not yet handed to the tree (the next insert reaching a position takes it).
    ``rows``: in a speculative verify pass, the scratch slots its state after each of its rows but the
    last is written to (the running slot takes the state after them all), held until acceptance."""

    slot: int
    source: int = 0
    start: int = 0
    branch: int = 0
    forward: tuple[tuple[int, int], ...] = ()
    taken: list[tuple[int, int]] = field(default_factory=list)
    rows: tuple[int, ...] = ()

    def slots(self, computed: int) -> tuple[int, int, tuple[tuple[int, int], ...], tuple[int, ...]]:
        """``(source, running, snapshots, row slots)`` of a forward whose context has ``computed`` tokens
        before it (:class:`~hicache.model.batch.StateSlots`)."""
        return (self.source if computed == self.start else self.slot), self.slot, self.forward, self.rows


def slot_bytes(layers: Sequence[LayerState]) -> int:
    """Bytes of one slot over ``layers``."""
    return sum(torch.Size(shape).numel() * dtype.itemsize for layer in layers for shape, dtype in layer)


class SlotRange:
    """A deterministic free list of the slot ids ``first .. first + count - 1``."""

    def __init__(self, first: int, count: int) -> None:
        self.first, self.capacity = first, count
        self._free = list(range(first + count - 1, first - 1, -1))  # popped from the end: lowest first
        self._held: set[int] = set()

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def free(self, slot: int) -> None:
        self._held.remove(slot)  # (a KeyError: a slot freed twice, or never handed out)
        self._free.append(slot)


class StatePool:
    """``buffers[i]``: recurrent layer i's (compact index, this rank's recurrent layers in order)
    state tensors, each ``[slots, *shape]``; satisfies the model's ``KVView.state_buffers``. Slots
    ``1 .. running`` are the running requests' (:attr:`running`), the next ``snapshots`` hold
    snapshots the tree keeps (:attr:`snapshots`), the last ``scratch`` the states a speculative
    verify pass leaves after each row (:attr:`scratch`; 0 without speculation); each handed out
    deterministically (the same ids on every rank that applies the same operations, as pages are). A
    pipeline stage without recurrent layers holds a pool of none (no buffers, no bytes): its slot ids
    are handed out as every stage's are, so its tree decides as theirs do."""

    def __init__(self, layers: Sequence[LayerState], running: int, snapshots: int, grid: int,
                 device: torch.device | str, scratch: int = 0) -> None:
        self.grid = grid  # tokens: snapshots are taken at multiples of it (runtime/state_plan.py)
        self.num_slots = 1 + running + snapshots + scratch
        self.running, self.snapshots = SlotRange(1, running), SlotRange(1 + running, snapshots)
        self.scratch = SlotRange(1 + running + snapshots, scratch)
        self.buffers = [tuple(torch.zeros((self.num_slots, *shape), dtype=dtype, device=device) for shape, dtype in layer)
                        for layer in layers]
        self.bytes_per_slot = slot_bytes(layers)
        logger.info("state pool (%s): %d running, %d snapshot and %d scratch slots x %d recurrent layers, %.1f KiB a "
                    "slot, %.1f MiB", torch.device(device).type, running, snapshots, scratch, len(layers),
                    self.bytes_per_slot / 2**10, self.total_bytes / 2**20)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    def usage(self) -> dict:
        """What ``/stats`` shows of the pool (slots; bytes)."""
        run, snap = self.running, self.snapshots
        return {"running_slots": run.capacity, "running_slots_held": run.capacity - run.available,
                "snapshot_slots": snap.capacity, "snapshots_free": snap.available, "scratch_slots": self.scratch.capacity,
                "scratch_slots_held": self.scratch.capacity - self.scratch.available, "slot_bytes": self.bytes_per_slot,
                "pool_bytes": self.total_bytes}

    def copy_slot(self, source: int, target: int) -> None:
        """Every layer's state at slot ``source`` copied to slot ``target``."""
        for layer in self.buffers:
            for buffer in layer:
                buffer[target].copy_(buffer[source])
