"""Recurrent-state snapshots in storage (issue 59, docs/hybrid_kv.md "Recurrent state"): the snapshot
at a stored node's end, one ``<page hash hex>-state`` object beside the page objects of the page it
ends (checksummed and namespaced like them: :mod:`.objects`), written from its host snapshot slot.

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
import warnings
from typing import Callable

import torch

from ..state_pool import StatePool
from .guard import GuardedBackend
from .keys import object_key
from .objects import decode_checked, encode
from .storage_ops import BackupOp, PrefetchOp, StorageStats

logger = logging.getLogger(__name__)

SUFFIX = "-state"
PROBES = 4  # state objects a prefetch looks for (no batch existence call: each is a read)


def state_key(page_hash: bytes) -> str:
    return object_key(page_hash) + SUFFIX


class StoredStates:
    """Reads and writes the snapshots of ``pool`` (the host state pool) at ``grid``-token boundaries."""

    name = "recurrent_state"

    def __init__(self, pool: StatePool, page_size: int) -> None:
        self.pool, self.page_size = pool, page_size

    def payload(self, slot: int) -> bytes:
        """One slot's every state tensor, in the pool's one order, as bytes."""
        return b"".join(t[slot].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                        for layer in self.pool.buffers for t in layer)

    def load(self, slot: int, payload: memoryview) -> bool:
        """Put a payload back into ``slot``; False (nothing written) when its length is not a slot's."""
        if payload.nbytes != self.pool.bytes_per_slot:
            return False
        at = 0
        with warnings.catch_warnings():  # read-only source: torch warns, but it is only read
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(payload, dtype=torch.uint8)
            for layer in self.pool.buffers:
                for t in layer:
                    n = t[slot].numel() * t.element_size()
                    t[slot].copy_(raw[at:at + n].view(t.dtype).view(t[slot].shape))
                    at += n
        return True

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
            # a pipeline stage without recurrent layers has nothing to read: the other stages decide
            ok = self._probe(guard, op, k, int(part.host_pages[0]), stats) if self.pool.buffers else 1
            if agree([ok])[0]:
                part.first = k
                stats.prefetch_bytes += self.pool.bytes_per_slot
                return

    def _probe(self, guard: GuardedBackend, op: PrefetchOp, k: int, slot: int, stats: StorageStats) -> int:
        """1 when the state object at the end of the op's page ``k`` arrived intact into ``slot``, else 0."""
        try:
            blob = guard.batch_get([state_key(op.hashes[k - 1])])[0]
            payload, status = decode_checked(blob, op.ns_digest, op.hashes[k - 1])
            if payload is None and status.value != "missing":
                stats.failures[f"state_{status.value}"] += 1
            return int(payload is not None and self.load(slot, payload))
        except Exception as e:  # the pages stand; the hit is cut back to a snapshot held elsewhere
            logger.warning("prefetch op=%d: reading a state at page %d failed: %s", op.op_id, k, e)
            return 0

    def write(self, guard: GuardedBackend, op: BackupOp, stats: StorageStats) -> None:
        """The snapshot at the end of the op's last page (``part.index``), from its host slot."""
        part = op.parts.get(self.name)
        if part is None or not self.pool.buffers:  # (a pipeline stage without recurrent layers: nothing to store)
            return
        i, slot = int(part.index[0]), int(part.host_pages[0])
        blob = encode(op.ns_digest, op.hashes[i], self.payload(slot))
        if guard.batch_set([state_key(op.hashes[i])], [blob]) == 1:
            stats.backup_bytes += len(blob)
