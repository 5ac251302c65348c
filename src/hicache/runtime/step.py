"""One step, for every rank layout: agree -> schedule -> forward -> hand on -> apply.

This is the only place the phases are written down. Whoever runs the loop builds the one
:class:`StepDriver` over its scheduler (the single-rank backend, hicache.frontend.backend; each
rank of a TP / PP group, hicache.parallel.worker) and calls :meth:`StepDriver.step`; the
scheduler exposes the phases and never calls its driver. What differs between layouts is
plugged in:

- an :class:`Agreement` turns this rank's :class:`StepEvents` into the agreed ones: nothing to
  agree on one rank (:data:`ALONE`), ``all_reduce(MIN)`` over the stage's TP group on stage 0,
  and on a later pipeline stage the vector stage 0 sent with the step (pp_sync);
- an :class:`Output` says what the stage does with its forward's output: sample and apply at
  once (the only stage), send hidden states down the pipeline, or sample and send the tokens
  back to stage 0 (the last of several stages), where they are applied ``pp_size`` steps later.

The step, in order (DESIGN invariant 3: cache state changes only at fixed points, as agreed)::

    events = agreement.agree(scheduler.ready_events(), inbound)
    finished = scheduler.consume_events(events)  # storage acks, P/D transfers: as agreed
    batch = scheduler.schedule()            # the same batch on every rank
    cache.submit_transfers()                # load-backs in flight before the forward reads them
    mode.before_forward(batch, handed)      # every mode (runtime/modes.py): e.g. the drafts
    out = forward(batch, inbound.hidden)    # logits, or hidden states mid-pipeline
    mode.after_forward(batch)               # e.g. the draft follows a prefill chunk
    finished += output.hand_on(batch, out)  # sample + apply | send down | sample + send back
    cache.submit_transfers()                # backups of what finished

Command intake (add / abort, then one command) is :func:`apply_intake`, shared by the
single-rank :class:`~hicache.frontend.loop.EngineLoop` and the multi-rank leader.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from .batch import Batch, BatchKind, Sampled
from .events import StepEvents
from .request import Request
from .scheduler import Scheduler

# forward(input_ids per seq, cached prefix len per seq, context slots per seq, hidden in,
#         logits="last" | "all") -> output
ForwardFn = Callable[..., torch.Tensor]


@dataclass
class Inbound:
    """A group rank's per-step data (None on a single rank)."""

    events: Optional[StepEvents] = None  # later pipeline stages: the events stage 0 agreed
    hidden: Optional[torch.Tensor] = None  # later pipeline stages: the previous stage's output
    context: Any = None  # the layout's own data (e.g. what the step message carries on)
    proposal: Any = None  # later pipeline stages: what stage 0's modes attached (a verify batch's drafts)


class Agreement(Protocol):
    def agree(self, local: StepEvents, inbound: Optional[Inbound]) -> StepEvents:
        """The events every rank of the group applies this step."""

    def confirm(self, batch: Optional[Batch], inbound: Optional[Inbound]) -> None:
        """Raise if this rank scheduled something other than its group (before the forward)."""


class _Alone:
    """One rank: its own view is the agreement."""

    def agree(self, local: StepEvents, inbound: Optional[Inbound]) -> StepEvents:
        return local

    def confirm(self, batch: Optional[Batch], inbound: Optional[Inbound]) -> None:
        """Nothing to compare with."""


ALONE: Agreement = _Alone()


class Output(Protocol):
    def hand_on(self, batch: Optional[Batch], out: Optional[torch.Tensor], events: StepEvents,
                inbound: Optional[Inbound]) -> list[Request]:
        """Do this stage's part with the forward's output (``batch`` None: nothing ran, but a
        pipeline stage still passes the step on). Returns the requests that finished."""


@dataclass
class SampleAndApply:
    """The only stage: sample the batch's next tokens and apply them at once.
    ``share_draws``: with several TP ranks, one rank's random draws for the whole stage."""

    scheduler: Scheduler
    share_draws: Optional[Callable[[Any], Any]] = None

    def hand_on(self, batch: Optional[Batch], out: Optional[torch.Tensor], events: StepEvents,
                inbound: Optional[Inbound]) -> list[Request]:
        if batch is None:
            return []
        return self.scheduler.apply_results(batch, sample_batch(self.scheduler, batch, out, self.share_draws))


def sample_batch(sched: Scheduler, batch: Batch, logits: torch.Tensor,
                 share_draws: Optional[Callable[[Any], Any]]) -> Sampled:
    """The batch's tokens (a verify batch: each request's accepted tokens) and logprobs; random
    draws come from one rank when ``share_draws`` is given, so every rank of a stage gets the same
    tokens whatever its own RNG state."""
    sampled = sched.sample(batch, logits)
    if share_draws is not None and any(not r.sampling.greedy for r in batch.reqs):
        sampled = share_draws(sampled)
    return sampled


class StepDriver:
    """Runs the phases of a step on one rank (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, forward: ForwardFn, agreement: Agreement = ALONE,
                 output: Optional[Output] = None) -> None:
        self.scheduler, self.forward, self.agreement = scheduler, forward, agreement
        self.output = output if output is not None else SampleAndApply(scheduler)

    def step(self, inbound: Optional[Inbound] = None) -> tuple[Optional[Batch], list[Request]]:
        """One step; returns the batch it ran (None if nothing was ready) and the requests that
        finished in it."""
        sched, cache = self.scheduler, self.scheduler.cache
        events = self.agreement.agree(sched.ready_events(), inbound)
        finished = sched.consume_events(events)
        batch = sched.schedule()
        self.agreement.confirm(batch, inbound)
        cache.submit_transfers()  # load-backs must be in flight before the forward waits on them
        out = None
        t0 = time.perf_counter()
        if batch is not None:
            handed = inbound.proposal if inbound is not None else None
            for mode in sched.modes:
                mode.before_forward(batch, handed)
            out = self.forward(batch.input_ids(), batch.prefix_lens(), batch.context_slots(),
                               inbound.hidden if inbound is not None else None,
                               logits="all" if batch.kind == BatchKind.VERIFY else "last",  # a verify pass: every row
                               window_slots=batch.window_slots(), generated=batch.generated,
                               state_slots=batch.state_slots())
            for mode in sched.modes:
                mode.after_forward(batch)
        finished += self.output.hand_on(batch, out, events, inbound)
        if batch is not None:  # its output has been sampled or sent on: the forward is done
            if batch.kind == BatchKind.PREFILL:  # a chunk that samples nothing leaves its kernels queued on a GPU
                wait_for_device(cache.pool.device)
            sched.observe_forward(batch, time.perf_counter() - t0)
        cache.submit_transfers()  # backups of what finished in this step
        return batch, finished


# ---- command intake ------------------------------------------------------------------------
@dataclass(frozen=True)
class Add:
    """Queue ``requests`` at one step, in order (Requests on one rank; their RequestSpecs on the
    way to a rank group): one ``Engine.generate`` call's prompts travel as one command, so a
    leader never schedules the first of them before the others arrived."""

    requests: tuple[Any, ...]


@dataclass(frozen=True)
class Abort:
    """Drop request ``rid`` wherever it is."""

    rid: int


@dataclass
class Intake:
    """Commands taken from a queue for one step: adds and aborts (adds first: a client may
    abort a request in the step it arrived), then at most one command that ends the intake."""

    adds: list[Any] = field(default_factory=list)
    aborts: list[int] = field(default_factory=list)
    command: Any = None


def take_intake(get: Callable[[], Any], get_nowait: Callable[[], Any], empty: tuple[type, ...]) -> Intake:
    """Everything queued now: ``get()`` for the first item (it may wait), then ``get_nowait()``
    until the queue raises one of ``empty``. Items are :class:`Add`, :class:`Abort` or the
    queue's own command type, which ends the intake."""
    intake, take = Intake(), get
    while True:
        try:
            item = take()
        except empty:
            return intake
        take = get_nowait
        if isinstance(item, Add):
            intake.adds.extend(item.requests)
        elif isinstance(item, Abort):
            intake.aborts.append(item.rid)
        else:
            intake.command = item
            return intake


def apply_intake(sched: Scheduler, adds: Sequence[Request], aborts: Sequence[int],
                 on_abort: Callable[[Request], None] | None = None) -> None:
    """Add, then abort, in this order on every rank. ``on_abort(req)``: a request that was
    found and dropped (e.g. to count it as finished)."""
    for req in adds:
        sched.add(req)
    for rid in aborts:
        req = sched.abort(rid)
        if req is not None and on_abort is not None:
            on_abort(req)


def wait_for_device(device: torch.device) -> None:
    """Block until the work queued on ``device``'s current stream has run (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
