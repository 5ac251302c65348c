"""The agreement event vector: what a step may apply of the background work that finished.

Each rank reads its own :class:`StepEvents` (``Scheduler.ready_events``); ranks agree on one
vector (TP ``all_reduce(MIN)`` of :meth:`StepEvents.to_list`, then pp_sync downstream) and
every rank applies exactly the agreed one (``Scheduler.consume_events``). The list form is
what collectives, pipeline messages and the rank consensus checker carry:

    [backup, load, storage_backup, prefetch_reap,  n_prefetches,  acks_0, expired_0, ...,
     ready_0, ok_0,  ready_1, ok_1, ...]

one pair per open prefetch, in the waiting queue's order, then one pair per item of the modes'
open background work (e.g. a P/D KV transfer, hicache.runtime.pd_role), mode after mode in the
engine's mode order: every order is the same on every rank, since each is a function of the
request stream. MIN makes an item ready once it is ready on every rank, and not ok once it
failed on any.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

from ..cache.acks import AckCounts


class PrefetchEvent(NamedTuple):
    """One open storage prefetch, as seen by one rank (or as agreed)."""

    acks: int  # progress acks published (monotonic; the last one is final)
    expired: bool  # its wait deadline has come


class WorkEvent(NamedTuple):
    """One item of a mode's open background work (a P/D KV transfer), as seen by one rank (or
    as agreed)."""

    ready: bool  # over on this rank (e.g. rows stored or sent, or failed; the local restore done)
    ok: bool  # not failed


@dataclass(frozen=True)
class StepEvents:
    acks: AckCounts = field(default_factory=AckCounts)
    prefetches: tuple[PrefetchEvent, ...] = ()
    work: tuple[WorkEvent, ...] = ()  # the modes' items, mode after mode

    def to_list(self) -> list[int]:
        pairs = [int(v) for e in (*self.prefetches, *self.work) for v in e]  # (acks, expired), (ready, ok)
        return self.acks.to_list() + [len(self.prefetches)] + pairs

    @classmethod
    def from_list(cls, values: Sequence[int]) -> "StepEvents":
        n = AckCounts.LENGTH
        if len(values) <= n or (len(values) - n - 1) % 2 or len(values) < n + 1 + 2 * values[n]:
            raise ValueError(f"a step's event vector has {n} + 1 + 2 per prefetch and per work item values, "
                             f"got {len(values)}")
        pairs = [(int(values[i]), int(values[i + 1])) for i in range(n + 1, len(values), 2)]
        prefetches, work = pairs[: values[n]], pairs[values[n]:]
        return cls(AckCounts.from_list(values[:n]), tuple(PrefetchEvent(a, bool(e)) for a, e in prefetches),
                   tuple(WorkEvent(bool(r), bool(o)) for r, o in work))


def split_over(events: Sequence[WorkEvent], items: list) -> tuple[list, list[tuple[Any, WorkEvent]]]:
    """A mode's open ``items`` (paired with their agreed ``events`` in order) as (still open, over
    with its event)."""
    pairs = list(zip(items, events, strict=True))
    return [item for item, e in pairs if not e.ready], [(item, e) for item, e in pairs if e.ready]
