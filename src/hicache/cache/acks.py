"""Counts of ordered acks, per queue of the cache: what background work finished (the input
to agreement) and what the scheduler thread applies (exactly the agreed counts).

Every queue is ordered and counts are *leading* acks: ``backup=2`` means the first two
device->host backups are done, whatever happened behind them. A rank whose cache has no
host or storage tier reports 0 for those queues, so every rank's vector has the same layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class AckCounts:
    backup: int = 0  # device -> host copies (unlock the node; may queue a storage write)
    load: int = 0  # host -> device load-backs (unlock the node being loaded)
    storage_backup: int = 0  # host -> storage writes (release the host copy's protection)
    prefetch_reap: int = 0  # stopped prefetches whose reader has finished (free their spare host pages)

    LENGTH = 4  # entries in :meth:`to_list`

    def to_list(self) -> list[int]:
        """Fixed order: backup, load, storage_backup, prefetch_reap."""
        return [self.backup, self.load, self.storage_backup, self.prefetch_reap]

    @classmethod
    def from_list(cls, values: Sequence[int]) -> "AckCounts":
        if len(values) != cls.LENGTH:
            raise ValueError(f"AckCounts takes {cls.LENGTH} values, got {len(values)}")
        return cls(*(int(v) for v in values))

    def __add__(self, other: "AckCounts") -> "AckCounts":
        """Field-wise sum: each tier fills only its own queues' fields."""
        return AckCounts(*(a + b for a, b in zip(self.to_list(), other.to_list())))

    def __bool__(self) -> bool:
        return any(dataclasses.astuple(self))
