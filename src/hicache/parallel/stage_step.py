"""What a rank of a TP / PP group plugs into the one step driver (runtime/step.py).

- :class:`StageAgreement`: stage 0 MIN-reduces its ranks' event vectors over the stage's TP
  group; a later stage applies exactly the vector stage 0 sent with the step (pp_sync: no
  barrier; a stage waits for its own copies of those acks where needed, extra ready acks stay
  queued) and checks it scheduled the batch stage 0 scheduled.
- The stage's output: the only stage samples and applies at once; a stage before the last
  sends hidden states down with the step's message; the last of several samples and sends the
  tokens back to stage 0, which applies them ``pp_size`` steps later (``StageLoop``).

Random sampling on several TP ranks: one rank's draws go to the whole stage, so every rank
gets the same tokens whatever its own RNG state.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..errors import HicacheError
from ..runtime.batch import Batch
from ..runtime.events import StepEvents
from ..runtime.request import Request
from ..runtime.scheduler import Scheduler
from ..runtime.step import Inbound, SampleAndApply, sample_batch
from .groups import ParallelGroups, RankInfo
from .messages import StageMessage, batch_key

# Test switch (never set in production): a later stage uses its own ready counts instead of the
# agreed ones, to show what pp_sync prevents.
DISABLE_PP_SYNC_ENV = "HICACHE_TEST_DISABLE_PP_SYNC"


class RankDivergenceError(HicacheError):
    """A later stage scheduled something other than what stage 0 scheduled."""


@dataclass
class StageAgreement:
    """TP MIN on stage 0, pp_sync on later stages (see the module docstring). Counts the
    agreement's cost for ``Engine.stats()["agreement"]``."""

    info: RankInfo
    groups: ParallelGroups
    pp_sync: bool = field(default_factory=lambda: os.environ.get(DISABLE_PP_SYNC_ENV) != "1")
    steps: int = 0
    seconds: float = 0.0  # in stage 0's tp_min

    def agree(self, local: StepEvents, inbound: Optional[Inbound]) -> StepEvents:
        self.steps += 1
        if self.info.pp_rank == 0:
            t0 = time.perf_counter()
            events = StepEvents.from_list(self.groups.tp_min(local.to_list()))
            self.seconds += time.perf_counter() - t0
            return events
        return inbound.events if self.pp_sync else local

    def confirm(self, batch: Optional[Batch], inbound: Optional[Inbound]) -> None:
        if self.info.pp_rank > 0 and batch_key(batch) != inbound.context.batch:
            raise RankDivergenceError(
                f"{self.info.label} scheduled {batch_key(batch)} where stage 0 scheduled {inbound.context.batch}")


def stage_output(info: RankInfo, groups: ParallelGroups, sched: Scheduler, on_sent: Callable[[Batch], None]):
    """The output of this rank's stage; ``on_sent(batch)``: a batch went down the pipeline
    (its tokens come back to stage 0 later)."""
    share = groups.tp_broadcast if info.tp_size > 1 else None
    if info.pp_size == 1:
        return SampleAndApply(sched, share)
    if info.pp_rank < info.pp_size - 1:
        return SendDown(groups, info.rank_of(info.pp_rank + 1, info.tp_rank), on_sent)
    return SampleAndReturn(sched, groups, info.rank_of(0, info.tp_rank), share, on_sent)


@dataclass
class SendDown:
    """A stage before the last: the step's message, with the hidden states, to the next stage."""

    groups: ParallelGroups
    next_rank: int
    on_sent: Callable[[Batch], None]

    def hand_on(self, batch: Optional[Batch], out: Optional[torch.Tensor], events: StepEvents,
                inbound: Optional[Inbound]) -> list[Request]:
        ctx: StageMessage = inbound.context  # the step's message as this stage got it (stage 0: its own)
        self.groups.send(self.next_rank, StageMessage(ctx.inputs, ctx.results, events, batch_key(batch), out,
                                                      time.perf_counter(), batch.proposal if batch else None))
        if batch is not None:
            self.on_sent(batch)
        return []


@dataclass
class SampleAndReturn:
    """The last of several stages: sample and send the tokens back to stage 0."""

    scheduler: Scheduler
    groups: ParallelGroups
    head_rank: int
    share_draws: Optional[Callable[[Any], Any]]
    on_sent: Callable[[Batch], None]

    def hand_on(self, batch: Optional[Batch], out: Optional[torch.Tensor], events: StepEvents,
                inbound: Optional[Inbound]) -> list[Request]:
        if batch is not None:
            self.groups.send(self.head_rank, sample_batch(self.scheduler, batch, out, self.share_draws))
            self.on_sent(batch)
        return []
