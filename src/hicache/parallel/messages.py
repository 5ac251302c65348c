"""What travels between the frontend, the leader rank and the pipeline stages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..cache_hints import RetentionHint, RetentionOutcome
from ..disagg.bootstrap import Bootstrap
from ..runtime.batch import Sampled
from ..runtime.events import StepEvents
from ..runtime.request import PDState, Request, SpecState, Status
from ..runtime.sampling import SamplingParams
from ..runtime.step import Intake


@dataclass
class RequestSpec:
    """A validated request as every rank rebuilds it (same rid, same seeded sampler)."""

    rid: int
    prompt_ids: list[int]
    sampling: SamplingParams
    namespace: str
    max_new_tokens: int
    arrival_time: float  # perf_counter of the frontend (CLOCK_MONOTONIC: one clock per machine)
    bootstrap: Optional[Bootstrap] = None  # P/D: where its other half runs
    waits_for: Optional[int] = None  # n > 1: the sibling whose prompt it shares
    hints: tuple[RetentionHint, ...] = ()  # cache hints (the frontend's wall_time stamps them)
    wall_time: float = 0.0

    @classmethod
    def of(cls, req: Request) -> "RequestSpec":
        return cls(req.rid, req.prompt_ids, req.sampling, req.namespace, req.max_new_tokens, req.arrival_time,
                   req.pd.bootstrap if req.pd is not None else None, req.waits_for, req.hints, req.wall_time)

    def request(self) -> Request:
        return Request(rid=self.rid, prompt_ids=list(self.prompt_ids), sampling=self.sampling, namespace=self.namespace,
                       max_new_tokens=self.max_new_tokens, arrival_time=self.arrival_time,
                       pd=PDState(self.bootstrap) if self.bootstrap is not None else None, waits_for=self.waits_for,
                       hints=self.hints, wall_time=self.wall_time)


@dataclass(frozen=True)
class RankCall:
    """The frontend's command to the leader: it runs at one step on every rank, after the step's
    adds and aborts; the leader's :class:`Reply` carries ``call_id``."""

    call_id: int


class Flush(RankCall):
    """Empty every tier (refused while a request holds pages); the reply: whether it did."""


@dataclass(frozen=True)
class ReleaseRetention(RankCall):
    """Drop the retention of the cached prefix of ``tokens`` in ``namespace``; the reply: the tokens released."""

    namespace: str = ""
    tokens: tuple[int, ...] = ()


class Stats(RankCall):
    """The reply: the leader's stats (with its group's per-rank figures)."""


class Shutdown(RankCall):
    """Abort what is left, drain and stop every rank (no reply)."""


BatchKey = Optional[tuple[str, list[int], list[int]]]  # (kind, rids, new tokens) of a scheduled batch


@dataclass
class StageMessage:
    """One step, from stage p to stage p+1 (rank to rank of the same TP position)."""

    inputs: Intake  # what the leader took from the frontend for the step: every rank applies it at the same
    # logical point (after the returned batches' results, before the cache check); ``command`` ends it
    results: list[Sampled]  # tokens (and logprobs) of the in-flight batches that returned at this step, oldest first
    events: StepEvents  # the agreed events (pp_sync): later stages consume exactly these
    batch: BatchKey  # what stage 0 scheduled, so a later stage can check it scheduled the same
    hidden: Optional[torch.Tensor]  # the previous stage's output for that batch
    sent_at: float = 0.0  # perf_counter just before the send (CLOCK_MONOTONIC: one clock per machine)
    proposal: Any = None  # what stage 0's modes attached to that batch (a verify batch's drafts)


@dataclass
class RequestUpdate:
    """Leader -> frontend: one request's new tokens and, when finished, its final state."""

    rid: int
    token_ids: list[int]
    finished: bool
    finish_reason: str = ""
    text: str = ""
    cached: Optional[dict[str, int]] = None
    admitted_time: float = 0.0
    first_token_time: float = 0.0
    finish_time: float = 0.0
    spec: tuple[int, int] = (0, 0)  # speculative decoding: (verify steps, accepted tokens) so far
    error: str = ""  # finish_reason "error": why
    transfer: tuple[int, int, int] = (0, 0, 0)  # P/D: (decode_prefix_len, KV tokens, KV bytes) moved
    logprobs: list = field(default_factory=list)  # the new tokens' TokenLogprob entries (when asked)
    error_code: str = ""  # finish_reason "error": what failed (runtime.request.Request.error_code)
    retention: Optional[RetentionOutcome] = None  # finished: what the cache gave its hints

    @property
    def admission(self) -> bool:
        """The update a request makes once admitted, before its first token (no tokens, not finished)."""
        return not self.token_ids and not self.finished

    @classmethod
    def of(cls, req: Request, sent: int) -> "RequestUpdate":
        done = req.status is Status.FINISHED
        return cls(req.rid, req.output_ids[sent:], done, req.finish_reason, req.text if done else "", req.cached,
                   req.admitted_time, req.first_token_time, req.finish_time,
                   (req.spec.verify_steps, req.spec.accepted_tokens) if req.spec else (0, 0), req.error,
                   (req.pd.decode_prefix_len, req.pd.transferred_tokens, req.pd.transferred_bytes) if req.pd
                   else (0, 0, 0), req.logprobs[sent:], req.error_code, req.retention if done else None)

    def apply(self, req: Request) -> None:
        req.output_ids.extend(self.token_ids)
        req.logprobs.extend(self.logprobs)
        req.cached = self.cached
        req.error, req.error_code = self.error, self.error_code
        req.retention = self.retention or req.retention
        if req.pd is not None:
            req.pd.decode_prefix_len, req.pd.transferred_tokens, req.pd.transferred_bytes = self.transfer
        req.admitted_time, req.first_token_time = self.admitted_time, self.first_token_time
        if self.spec[0]:  # the frontend's copy: the figures the leader's request holds
            req.spec = req.spec or SpecState()
            req.spec.verify_steps, req.spec.accepted_tokens = self.spec
        if self.cached is not None and req.status is Status.WAITING:
            req.status = Status.PREFILL
        if self.first_token_time and req.status is not Status.FINISHED:
            req.status = Status.DECODE
        if self.finished:
            req.status, req.finish_reason, req.text, req.finish_time = \
                Status.FINISHED, self.finish_reason, self.text, self.finish_time


@dataclass(frozen=True)
class Updates:
    """Leader -> frontend: requests' updates, in order."""

    updates: list[RequestUpdate]


@dataclass(frozen=True)
class Reply:
    """Leader -> frontend: what the :class:`RankCall` ``call_id`` returned."""

    call_id: int
    value: Any


@dataclass(frozen=True)
class Ready:
    """A rank -> its node's process: it started; its device pool's pages per component."""

    rank: int
    capacity: dict[str, int]


@dataclass(frozen=True)
class RankError:
    """A rank -> its node's process: it failed (``message``: one line; ``trace``: the traceback)."""

    rank: int
    message: str
    trace: str


def batch_key(batch: Any) -> BatchKey:
    return None if batch is None else (str(batch.kind), batch.rids(), list(batch.new_tokens))
