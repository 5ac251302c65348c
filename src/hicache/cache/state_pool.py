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
from dataclasses import dataclass
from typing import Sequence

import torch

from .pools import PageAllocator

logger = logging.getLogger(__name__)

# One recurrent layer's state: each tensor's per-slot shape and dtype (LFM2: one conv tensor)
LayerState = tuple[tuple[tuple[int, ...], torch.dtype], ...]


@dataclass
class StateHold:
    """One request's hold on the state pool: its running ``slot``, read and written in place by each
    of its forwards but the first, which reads ``source`` (0: the zero state) as the state after the
    first ``start`` tokens of its context."""

    slot: int
    source: int = 0
    start: int = 0

    def slots(self, computed: int) -> tuple[int, int]:
        """``(source, running)`` slots of a forward whose context has ``computed`` tokens before it."""
        return (self.source if computed == self.start else self.slot), self.slot


def slot_bytes(layers: Sequence[LayerState]) -> int:
    """Bytes of one slot over ``layers``."""
    return sum(torch.Size(shape).numel() * dtype.itemsize for layer in layers for shape, dtype in layer)


class StatePool:
    """``buffers[i]``: recurrent layer i's (compact index, this rank's recurrent layers in order)
    state tensors, each ``[num_slots, *shape]``; satisfies the model's ``KVView.state_buffers``.
    Slots are handed out by a deterministic allocator (the same ids on every rank that applies
    the same operations, as pages are)."""

    def __init__(self, layers: Sequence[LayerState], num_slots: int, device: torch.device | str) -> None:
        if not layers:
            raise ValueError("a state pool needs at least one recurrent layer")
        self.num_slots = num_slots
        self.allocator = PageAllocator(num_slots)
        self.buffers = [tuple(torch.zeros((num_slots, *shape), dtype=dtype, device=device) for shape, dtype in layer)
                        for layer in layers]
        self.bytes_per_slot = slot_bytes(layers)
        logger.info("device state pool: %d slots x %d recurrent layers, %.1f KiB a slot, %.1f MiB", num_slots - 1,
                    len(layers), self.bytes_per_slot / 2**10, self.total_bytes / 2**20)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    def alloc(self) -> int | None:
        """A free slot, or None when every one is held."""
        got = self.allocator.alloc(1)
        return None if got is None else int(got[0])

    def free(self, slot: int) -> None:
        self.allocator.free([slot])

    def usage(self) -> dict:
        """What ``/stats`` shows of the pool (slots; bytes)."""
        capacity = self.allocator.capacity
        return {"slots": capacity, "free_slots": self.allocator.available,
                "running_slots": capacity - self.allocator.available, "slot_bytes": self.bytes_per_slot,
                "pool_bytes": self.total_bytes}
