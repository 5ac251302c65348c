"""A request's state as it moves through the scheduler, and what the user gets back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..cache_hints import RetentionHint, RetentionOutcome
from ..edit_reuse_outcome import EditReuseOutcome
from ..cache.manager import KVState, PrefetchOp
from ..disagg.bootstrap import Bootstrap
from .sampling import SamplingParams

DRAFT_SEED_OFFSET = 0x9E3779B97F4A7C15  # the draft stream's seed = seed + this (mod 2**64)


class Status(enum.Enum):
    WAITING = "waiting"  # queued, holds nothing
    PREFILL = "prefill"  # admitted; prompt (possibly chunked) being computed
    RECEIVING = "receiving"  # P/D decode side: admitted, its prompt's KV arriving from prefill
    DECODE = "decode"  # first token sampled; one token per step
    FINISHED = "finished"


@dataclass
class PrefetchWait:
    """A storage prefetch the request waits for: the cache's operation, when the scheduler
    stops waiting (perf_counter), and whether every rank agreed that time has come."""

    op: PrefetchOp
    deadline: float
    expired: bool = False


@dataclass
class SpecState:
    """Speculative decoding: a draft model has KV for the first ``draft_computed`` tokens (never
    more than the target's ``computed``; None: drafts without KV, NGRAM); the verify passes the
    request took part in and the tokens they gave it (accepted drafts + the target's own).
    ``generator``: a seeded request's draft draws, a stream of its own so that the target's draws
    follow the same sequence on one rank or across pipeline stages. ``drafting``: the algorithm's
    own per-request state (NGRAM: its text index and draft length)."""

    draft_computed: Optional[int] = 0
    verify_steps: int = 0
    accepted_tokens: int = 0
    generator: Optional[torch.Generator] = None
    drafting: Any = None

    @classmethod
    def admitted(cls, req: "Request", draft_kv: bool = True) -> "SpecState":
        seed = req.sampling.seed
        gen = None if seed is None else torch.Generator().manual_seed((seed + DRAFT_SEED_OFFSET) % 2**64)
        return cls(draft_computed=req.computed if draft_kv else None, generator=gen)

    @property
    def accept_length(self) -> float:
        """Mean tokens per verify pass, the target's own token included."""
        return self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0


@dataclass
class PDState:
    """Prefill/decode disaggregation: where the request's other half runs; on the decode side
    the prompt tokens its own tiers supplied (whole pages); the KV that crossed for it."""

    bootstrap: Bootstrap
    decode_prefix_len: int = 0
    transferred_tokens: int = 0
    transferred_bytes: int = 0


@dataclass
class Request:
    """Invariant: ``computed`` tokens of ``all_ids`` have KV in the pool at ``kv.slots`` (with
    speculative decoding the draft's KV covers ``draft_computed <= computed`` of them)."""

    rid: int
    prompt_ids: list[int]
    sampling: SamplingParams
    namespace: str
    max_new_tokens: int  # sampling.max_new_tokens clamped to the context length
    arrival_time: float = field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    computed: int = 0
    kv: Optional[KVState] = None
    generator: Optional[torch.Generator] = None
    admitted_time: float = 0.0
    first_token_time: float = 0.0
    finish_time: float = 0.0
    finish_reason: str = ""
    error: str = ""  # why the engine failed it (finish_reason "error")
    error_code: str = ""  # what failed: "" the engine, or a mode's code (kv_transfer_failed, grammar_failed)
    text: str = ""
    # Called on the scheduler thread after each new token and once more when finished
    # (status FINISHED); a server uses it to stream. Must be cheap and must not raise.
    on_update: Optional[Callable[["Request"], None]] = field(default=None, repr=False)
    # Each mode's state lives in an object of its own (None: the mode is off for the request).
    prefetch: Optional["PrefetchWait"] = field(default=None, repr=False)  # storage prefetch in flight
    storage_tokens: int = 0  # prompt tokens its prefetch brought into the host tier
    in_flight: bool = False  # in a batch whose results have not been applied yet (pipeline)
    cached: Optional[dict[str, int]] = None  # prompt tokens hit per tier (device/host/storage), set at admission
    spec: Optional["SpecState"] = None  # speculative decoding (set at admission)
    pd: Optional["PDState"] = None  # prefill/decode disaggregation (set with a bootstrap)
    grammar: Any = None  # structured output: runtime.grammar_state.GrammarState (set at admission)
    penalty: Any = None  # penalties / logit_bias / min_tokens: runtime.penalties.PenaltyState (at admission)
    stop_scan: Any = None  # stop strings: runtime.stopping.StopScan, how far its text was searched (first check)
    # sampling.logprobs: one runtime.logprobs.TokenLogprob per output token, on the rank that reports
    logprobs: list = field(default_factory=list, repr=False)
    # n > 1: a sibling waits to be admitted until this request's prompt is computed and cached, so
    # the prompt is computed once (its pages are shared) and each sibling only decodes
    waits_for: Optional[int] = None
    # cache hints (cache/hints.py): prefixes to keep cached a while; stamped with the frontend's unix
    # time at arrival (every rank of a group gets the same stamp: the tree's retention clock)
    hints: tuple[RetentionHint, ...] = ()
    wall_time: float = field(default_factory=time.time)
    retention: Optional[RetentionOutcome] = None  # what the cache gave its hints (set when released)
    # reuse after an edit (runtime/edit_reuse.py): its plan (set at admission), and where its KV stops being
    # exact (None: exact throughout): only the tokens before ``kv_exact`` are ever cached
    edit: Any = None
    kv_exact: Optional[int] = None
    tokens_np: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Converted once on arrival: the tree compares pages as int32 arrays.
        self.tokens_np = np.asarray(self.prompt_ids, dtype=np.int32)
        if self.sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)

    def notify(self) -> None:
        """Call ``on_update``, if set."""
        if self.on_update is not None:
            self.on_update(self)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens_with_kv(self, approximate: bool = False) -> np.ndarray:
        """Token ids whose KV has been computed (the last sampled token has none yet) -- by the
        draft too, with speculative decoding -- and is exact: only those may be cached in the
        request's namespace. ``approximate``: past ``kv_exact`` too (edit reuse's own namespace)."""
        draft = None if self.spec is None else self.spec.draft_computed
        n = self.computed if draft is None else min(self.computed, draft)
        if self.kv_exact is not None and not approximate:  # approximate KV past it (edit reuse): never cached
            n = min(n, self.kv_exact)
        if not self.output_ids:
            return self.tokens_np[:n]
        return np.asarray(self.all_ids[:n], dtype=np.int32)


@dataclass
class GenerateResult:
    """What :meth:`Engine.generate` returns for one prompt."""

    rid: int
    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_details: dict[str, int]  # device / host / storage hit tokens
    finish_reason: str  # "stop" (EOS, stop string or stop token) | "length" | "abort" | "error"
    ttft_s: float  # arrival -> first token
    queue_time_s: float  # arrival -> admitted
    forward_time_s: float  # admitted -> first token
    e2e_s: float
    error: str = ""  # with finish_reason "error": what failed
    error_code: str = ""  # "" (the engine failed), "kv_transfer_failed" (P/D), "grammar_failed"
    spec_accept_length: float = 0.0  # speculative decoding: mean tokens per verify pass (0: off)
    spec_verify_steps: int = 0
    disaggregated: bool = False  # P/D: the request had a bootstrap
    decode_prefix_len: int = 0  # P/D decode side: prompt tokens its own tiers supplied
    kv_transferred_tokens: int = 0  # P/D: prompt tokens whose KV crossed between the servers
    kv_transferred_bytes: int = 0
    logprobs: list = field(default_factory=list)  # sampling.logprobs: a TokenLogprob per output token
    retention: Optional[RetentionOutcome] = None  # what the cache gave the request's hints (None: it had none)
    edit_reuse: Optional[EditReuseOutcome] = None  # reuse after an edit (None: not tried)

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose KV came from cached pages at other positions (not in ``cached_tokens``)."""
        return self.edit_reuse.reused_tokens if self.edit_reuse is not None else 0

    @classmethod
    def from_request(cls, req: Request) -> "GenerateResult":
        admitted = req.cached is not None  # False when aborted before admission: it never held anything
        details = dict(req.cached) if admitted else {"device": 0, "host": 0, "storage": 0}
        started = req.first_token_time > 0
        spec, pd = req.spec or SpecState(), req.pd or PDState(None)
        return cls(
            rid=req.rid, text=req.text, output_ids=list(req.output_ids),
            prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
            cached_tokens=sum(details.values()), cached_tokens_details=details, finish_reason=req.finish_reason,
            ttft_s=req.first_token_time - req.arrival_time if started else 0.0,
            queue_time_s=req.admitted_time - req.arrival_time if admitted else 0.0,
            forward_time_s=req.first_token_time - req.admitted_time if started else 0.0,
            e2e_s=req.finish_time - req.arrival_time if req.finish_time else 0.0, error=req.error,
            error_code=req.error_code, spec_accept_length=spec.accept_length, spec_verify_steps=spec.verify_steps,
            disaggregated=req.pd is not None, decode_prefix_len=pd.decode_prefix_len,
            kv_transferred_tokens=pd.transferred_tokens, kv_transferred_bytes=pd.transferred_bytes,
            logprobs=list(req.logprobs), retention=req.retention,
            edit_reuse=req.edit.outcome if req.edit is not None else None)
