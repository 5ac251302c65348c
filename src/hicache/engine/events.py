"""The agreement event vector: what a step may apply of the background work that finished.

Each rank reads its own :class:`StepEvents` (``Scheduler.ready_events``); ranks agree on one
vector (TP ``all_reduce(MIN)`` of :meth:`StepEvents.to_list`, then pp_sync downstream) and
every rank applies exactly the agreed one (``Scheduler.consume_events``). The list form is
what collectives, pipeline messages and the rank consensus checker carry:

    [backup, load, storage_backup, prefetch_reap,  acks_0, expired_0,  acks_1, expired_1, ...]

one pair per open prefetch, in the waiting queue's order (the same on every rank, since it is
a function of the request stream).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..cache.acks import AckCounts


@dataclass(frozen=True)
class PrefetchEvent:
    """One open storage prefetch, as seen by one rank (or as agreed)."""

    acks: int  # progress acks published (monotonic; the last one is final)
    expired: bool  # its wait deadline has come


@dataclass(frozen=True)
class StepEvents:
    acks: AckCounts = field(default_factory=AckCounts)
    prefetches: tuple[PrefetchEvent, ...] = ()

    def to_list(self) -> list[int]:
        out = self.acks.to_list()
        for p in self.prefetches:
            out += [p.acks, int(p.expired)]
        return out

    @classmethod
    def from_list(cls, values: Sequence[int]) -> "StepEvents":
        head, rest = values[: AckCounts.LENGTH], values[AckCounts.LENGTH:]
        if len(rest) % 2:
            raise ValueError(f"a step's event vector has {AckCounts.LENGTH} + 2 per prefetch values, got {len(values)}")
        pairs = tuple(PrefetchEvent(int(rest[i]), bool(rest[i + 1])) for i in range(0, len(rest), 2))
        return cls(AckCounts.from_list(head), pairs)
