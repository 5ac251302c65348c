"""The scheduler's phases: events, admission, continuous batching with chunked prefill,
sampling, finish handling. The order they run in, for every rank layout, is runtime/step.py.

Every cache decision (match, lock, evict, insert) happens here, on the scheduler thread, as
a function of the request stream alone (DESIGN invariant 3): ranks that feed the same requests
to the same scheduler make the same decisions.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from ..cache.manager import KVCacheManager
from ..consensus_record import consensus_check
from .events import PrefetchEvent, StepEvents
from .prefetch_policy import PrefetchPolicy
from .request import Request, Status
from .sampling import sample
from .step import ForwardFn, StepDriver

if TYPE_CHECKING:
    from .pd_role import PDRole
    from .speculative import Proposal, Speculator

logger = logging.getLogger(__name__)

class Scheduler:
    def __init__(
        self,
        cache: KVCacheManager,
        forward: ForwardFn,
        decode_text: Callable[[Sequence[int]], str],
        eos_token_ids: set[int],
        chunked_prefill_size: int,
        max_running_requests: int,
        prefetch_policy: str = "adaptive",
        prefetch_timeout: Callable[[int], float] = lambda tokens: 1.0,
        speculator: Optional["Speculator"] = None,
        pd: Optional["PDRole"] = None,
    ) -> None:
        """``speculator``: speculative decoding is on; decode steps become verify passes.
        ``pd``: this server's role in prefill/decode disaggregation (hicache.runtime.pd_role)."""
        self.cache = cache
        self.decode_text = decode_text
        self.eos_token_ids = eos_token_ids
        self.chunked_prefill_size = chunked_prefill_size
        self.max_running_requests = max_running_requests
        self.prefetch_policy = prefetch_policy
        # Wait deadlines per prefetch; prefetch_timeout: seconds the timeout policy allows N tokens.
        self.prefetch_rule = PrefetchPolicy(prefetch_policy, prefetch_timeout)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.speculator = speculator
        # k extra slots per request: a verify pass writes KV for drafts past the last token
        self.spec_steps = speculator.num_steps if speculator is not None else 0
        self.spec_request_verify_steps = 0  # verify passes, counted once per request in each
        self.spec_accepted_tokens = 0
        self.pd = pd
        # The phases of a step on this rank alone; a rank of a group replaces it with one that
        # agrees with its peers and hands its output on (hicache.parallel.worker).
        self.driver = StepDriver(self, forward)

    # ---- queue ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.prefetch = self.cache.start_prefetch(req.namespace, req.tokens_np)
        if req.prefetch is not None:
            pages = len(req.prefetch.hashes)
            req.prefetch_deadline = self.prefetch_rule.deadline(
                req.rid, pages, pages * self.cache.page_size, self.cache.storage.read_page_s, time.perf_counter())
        self.waiting.append(req)

    def observe_forward(self, batch: "Batch", seconds: float) -> None:
        """``batch``'s forward pass took ``seconds`` on this rank (up to where its output was
        used, so that an asynchronous device has finished it). Prefill passes feed the
        throughput estimate of the adaptive prefetch policy; decode passes say nothing about
        the cost of recomputing a prompt."""
        if batch.kind == "prefill":
            self.prefetch_rule.prefill.observe(sum(batch.new_tokens), seconds)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or (self.pd is not None and self.pd.busy))

    def abort(self, rid: int) -> bool:
        """Drop a request wherever it is, freeing what it holds. True if it was found."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                if req.prefetch is not None:
                    self.cache.finish_prefetch(req.prefetch, req.tokens_np)
                    req.prefetch = None
                req.status, req.finish_reason = Status.FINISHED, "abort"
                if req.on_update is not None:
                    req.on_update(req)
                return True
        for req in self.running:
            if req.rid == rid:
                self._finish(req, "abort")
                return True
        return False

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One step (agree -> schedule -> forward -> sample -> apply: see runtime/step.py);
        returns the requests that finished in it."""
        batch, finished = self.driver.step()
        if batch is None and ((not self.running and self.waiting) or (self.pd is not None and self.pd.busy)):
            time.sleep(0.001)  # only prefetches or KV transfers to wait for: do not spin
        return finished

    # ---- events: what background work finished, applied only as agreed ----------------
    def pending_prefetches(self) -> list[Request]:
        """Waiting requests whose storage prefetch is still open, in queue order (the order
        of their entries in the event vector)."""
        return [r for r in self.waiting if r.prefetch is not None]

    def ready_events(self) -> StepEvents:
        """This rank's view of finished background work (ranks MIN-reduce its list form):
        ready leading acks per cache queue, then per open prefetch its published progress
        acks and whether its wait deadline has come."""
        now = time.perf_counter()
        return StepEvents(self.cache.ack_counts(), tuple(
            PrefetchEvent(self.cache.prefetch_ack_count(r.prefetch), now >= r.prefetch_deadline)
            for r in self.pending_prefetches()), self.pd.local_events() if self.pd is not None else ())

    @consensus_check("scheduler.consume_events", args=lambda self, events: events.to_list())
    def consume_events(self, events: StepEvents) -> list[Request]:
        """Apply exactly the agreed ``events``. Transfer acks change lock state only here, at a
        fixed point of the step; so do P/D transfers that ended. Returns the requests that
        finished here (a failed transfer)."""
        self.cache.consume_acks(events.acks)
        for req, p in zip(self.pending_prefetches(), events.prefetches, strict=True):
            self.cache.consume_prefetch_acks(req.prefetch, p.acks)
            req.prefetch_expired = p.expired
        finished: list[Request] = []
        if self.pd is not None:
            self.pd.apply(self, events.transfers, finished)
        return finished

    # ---- scheduling ------------------------------------------------------------------------
    @consensus_check("scheduler.schedule", result=lambda b: None if b is None else (b.kind, b.rids(), b.new_tokens))
    def schedule(self) -> "Batch | None":
        """One prefill batch if any prompt work is ready, else one decode batch, else None.
        Requests whose previous batch has not returned yet (``in_flight``) sit this one out."""
        prefill = self._schedule_prefill()
        if prefill:
            batch = Batch("prefill", [r for r, _ in prefill], [n for _, n in prefill])
        else:
            decode = [r for r in self.running if r.status is Status.DECODE and not r.in_flight]
            if not decode:
                return None
            if self.speculator is not None:  # k drafts + the last token, all checked in one pass
                batch = Batch("verify", decode, [self.spec_steps + 1] * len(decode))
            else:
                batch = Batch("decode", decode, [1] * len(decode))
        for req in batch.reqs:
            req.in_flight = True
        return batch

    def _schedule_prefill(self) -> list[tuple[Request, int]]:
        """(request, new tokens this step) within the chunked-prefill token budget."""
        budget = self.chunked_prefill_size
        batch: list[tuple[Request, int]] = []
        for req in self.running:
            if req.status is Status.PREFILL and not req.in_flight and budget > 0:
                n = min(len(req.prompt_ids) - req.computed, budget)
                batch.append((req, n))
                budget -= n
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_running_requests:
                break
            if not self._prefetch_settled(req):
                continue  # its storage read is still arriving; later requests may go first
            if not self._admit(req):
                break  # first-come first-served for memory: later requests wait behind it
            self.waiting.remove(req)
            self.running.append(req)
            if self.pd is not None and self.pd.on_admit(req):
                req.status = Status.RECEIVING  # its prompt's KV comes from the prefill server
                continue
            n = min(len(req.prompt_ids) - req.computed, budget)
            batch.append((req, n))
            budget -= n
        return batch

    def _prefetch_settled(self, req: Request) -> bool:
        """True once the policy stops waiting for the request's prefetch, after inserting
        what arrived (the agreed acks) into the cache."""
        op = req.prefetch
        if op is None:
            return True
        if not (op.final_applied or self.prefetch_policy == "best_effort" or req.prefetch_expired):
            return False
        req.storage_tokens = self.cache.finish_prefetch(op, req.tokens_np)
        req.prefetch = None
        return True

    def _admit(self, req: Request) -> bool:
        kv = self.cache.admit(req.namespace, req.tokens_np, len(req.prompt_ids) + req.max_new_tokens + self.spec_steps,
                              req.storage_tokens)
        if kv is None:
            return False
        req.kv = kv
        req.cached = {"device": kv.device_hit_tokens, "host": kv.host_hit_tokens, "storage": kv.storage_hit_tokens}
        req.computed = kv.device_hit_tokens + kv.host_hit_tokens + kv.storage_hit_tokens
        if self.speculator is not None:  # a cached page holds the draft's KV too
            req.draft_computed = req.computed
        req.status = Status.PREFILL
        req.admitted_time = time.perf_counter()
        logger.info(
            "admit rid=%d prompt=%d cached(device=%d host=%d storage=%d) queue=%.3fs",
            req.rid, len(req.prompt_ids), kv.device_hit_tokens, kv.host_hit_tokens, kv.storage_hit_tokens,
            req.admitted_time - req.arrival_time,
        )
        return True

    # ---- results ---------------------------------------------------------------------------
    def sample(self, batch: "Batch", logits: torch.Tensor) -> list:
        """One entry per request of ``batch``: its next token, or -1 when the batch only
        computed a chunk of its prompt. ``logits``: ``[len(batch.reqs), vocab]``. A verify
        batch: each request's accepted tokens (a list), from ``logits`` at every verify row."""
        if batch.kind == "verify":
            return self.speculator.verify(batch, logits)
        rows = batch.result_rows()
        out = [-1] * len(batch.reqs)
        if rows:
            reqs = [batch.reqs[i] for i in rows]
            for i, tok in zip(rows, sample(logits[rows], [r.sampling for r in reqs], [r.generator for r in reqs])):
                out[i] = tok
        return out

    @consensus_check("scheduler.apply_results", args=lambda self, batch, tokens: (batch.rids(), list(tokens)))
    def apply_results(self, batch: "Batch", tokens: Sequence[int]) -> list[Request]:
        """``batch`` has returned with ``tokens`` (see :meth:`sample`): advance its requests,
        append their tokens, finish what stopped. Returns the finished requests."""
        finished: list[Request] = []
        now = time.perf_counter()
        for req, n, tok in zip(batch.reqs, batch.new_tokens, tokens):
            req.in_flight = False
            if req.status is Status.FINISHED:  # aborted while its batch was in flight
                continue
            if batch.kind == "verify":
                self._apply_verified(req, tok, finished)
                continue
            req.computed += n
            if req.draft_computed is not None:  # the draft ran over the same chunk
                req.draft_computed = req.computed
            if req.status is Status.PREFILL:
                if req.computed < len(req.prompt_ids):  # chunk boundary: share the pages now
                    self.cache.cache_prefix(req.namespace, req.tokens_with_kv(), req.kv)
                    continue
                req.first_token_time = now
                req.status = Status.DECODE
            self._append_token(req, tok, finished)
        return finished

    def _apply_verified(self, req: Request, tokens: Sequence[int], finished: list[Request]) -> None:
        """A verify pass gave ``tokens`` (j accepted drafts + the target's own): the target's KV
        now covers the j drafts, the draft's all but the last of them (runtime/speculative.py).
        Set before appending: a token that finishes the request releases what has KV
        (``tokens_with_kv`` cuts at the tokens it has); the tokens after it are dropped."""
        j, n = len(tokens) - 1, len(req.all_ids)
        req.computed = n + j
        req.draft_computed = n + min(j, self.spec_steps - 1)
        req.spec_verify_steps += 1  # counted before appending: finishing reports them
        self.spec_request_verify_steps += 1
        for tok in tokens:
            req.spec_accepted_tokens += 1
            self.spec_accepted_tokens += 1
            self._append_token(req, tok, finished)
            if req.status is Status.FINISHED:
                break
        req.computed = min(req.computed, len(req.all_ids))  # an early stop: only what was appended

    # ---- finishing -----------------------------------------------------------------------
    def _stop_reason(self, req: Request) -> str:
        """Why ``req`` stops after its last output token ("stop", "length"), or ""."""
        tok, sp = req.output_ids[-1], req.sampling
        if (tok in self.eos_token_ids and not sp.ignore_eos) or tok in sp.stop_token_ids:
            return "stop"
        if sp.stop_strings and _stop_index(self.decode_text(req.output_ids), sp.stop_strings) >= 0:
            return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return ""

    def _append_token(self, req: Request, tok: int, finished: list[Request]) -> None:
        req.output_ids.append(tok)
        reason = self._stop_reason(req)
        if reason:
            self._finish(req, reason)
            finished.append(req)
        elif req.on_update is not None:
            req.on_update(req)

    def _finish(self, req: Request, reason: str) -> None:
        if self.pd is None or not self.pd.on_finish(req):  # else a transfer still reads or writes its KV
            self.release_kv(req)
        self.running.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        req.text = self.decode_text(req.output_ids)
        cut = _stop_index(req.text, req.sampling.stop_strings)
        if cut >= 0:  # the stop string itself is not part of the answer
            req.text = req.text[:cut]
        if req.on_update is not None:
            req.on_update(req)
        logger.info(
            "finish rid=%d reason=%s prompt=%d output=%d ttft=%.3fs e2e=%.3fs",
            req.rid, reason, len(req.prompt_ids), len(req.output_ids),
            req.first_token_time - req.arrival_time if req.first_token_time else -1.0,
            req.finish_time - req.arrival_time,
        )


    # ---- disaggregation (hicache.runtime.pd_role calls these when transfers end) ---------------
    def release_kv(self, req: Request) -> None:
        """Cache the pages of ``req`` that have KV, free the rest, drop its lock."""
        self.cache.release(req.namespace, req.tokens_with_kv(), req.kv)

    def start_decode(self, req: Request, first_token: int, finished: list[Request]) -> None:
        """``req``'s whole prompt has KV (local tiers + received suffix): decode from the
        prefill server's first token."""
        req.computed = len(req.prompt_ids)
        req.first_token_time = time.perf_counter()
        req.status = Status.DECODE
        self._append_token(req, first_token, finished)

    def fail(self, req: Request, error: str, finished: list[Request]) -> None:
        req.error = error
        self._finish(req, "error")
        finished.append(req)


@dataclass
class Batch:
    """One forward pass as scheduled: ``reqs[i]`` computes ``new_tokens[i]`` tokens (a prompt
    chunk, 1 in decode, the last token + k drafts in verify). Built once; every pipeline stage
    schedules an equal one."""

    kind: str  # "prefill" | "decode" | "verify" (speculative: the last token + k drafts each)
    reqs: list[Request]
    new_tokens: list[int]
    proposal: Optional["Proposal"] = None  # verify: the drafts, set in the step's forward phase

    @property
    def logits(self) -> str:
        """Which rows' logits the pass returns: every row for a verify pass, else each last."""
        return "all" if self.kind == "verify" else "last"

    def rids(self) -> list[int]:
        return [r.rid for r in self.reqs]

    def input_ids(self) -> list[list[int]]:
        if self.kind == "decode":
            return [[r.output_ids[-1]] for r in self.reqs]
        if self.kind == "verify":
            return [[r.output_ids[-1]] + drafts for r, drafts in zip(self.reqs, self.proposal.tokens)]
        return [r.prompt_ids[r.computed : r.computed + n] for r, n in zip(self.reqs, self.new_tokens)]

    def prefix_lens(self) -> list[int]:
        return [r.computed for r in self.reqs]

    def context_slots(self) -> list[torch.Tensor]:
        return [r.kv.slots[: r.computed + n] for r, n in zip(self.reqs, self.new_tokens)]

    def result_rows(self) -> list[int]:
        """Rows whose logits give a token: decode rows, and prefill rows that end their prompt."""
        if self.kind != "prefill":
            return list(range(len(self.reqs)))
        return [i for i, (r, n) in enumerate(zip(self.reqs, self.new_tokens)) if r.computed + n == len(r.prompt_ids)]


def _stop_index(text: str, stops: list[str]) -> int:
    """Where the earliest stop string starts in ``text``, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1
