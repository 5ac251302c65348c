"""What a forward pass's logits become: the scheduler's result phases -- the modes constrain the
logits, tokens are sampled (:meth:`Results.sample`), each request advances by its tokens, and
requests that stopped finish and hand their KV to the cache (:meth:`Results.apply_results`).

A part of :class:`~hicache.runtime.scheduler.Scheduler` (which extends it), kept apart because
it is a phase of its own: it reads the scheduler's state (its modes, the running list, the
cache, the waiting queue) and changes requests, never the batch composition. The same rule
holds (DESIGN invariant 3): what it decides is a function of the request stream and the
agreed tokens alone.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable, Sequence

import torch

from ..cache.manager import KVCacheManager
from ..consensus_record import consensus_check
from .batch import Batch, Sampled
from .logprobs import batch_logprobs
from .modes import Mode
from .request import Request, Status
from .sampling import sample
from .shared_prefill import awaited
from .stopping import stop_index, stop_reason

logger = logging.getLogger("hicache.runtime.scheduler")  # the scheduler's events, one log


class Results:
    """The scheduler's result phases (mixed into :class:`~hicache.runtime.scheduler.Scheduler`,
    which sets these fields)."""

    cache: KVCacheManager
    decode_text: Callable[[Sequence[int]], str]
    eos_token_ids: set[int]
    modes: list[Mode]
    running: list[Request]
    waiting: deque[Request]
    policy: Any  # the scheduler's SchedulePolicy
    prefill_computed_tokens: int

    def sample(self, batch: "Batch", logits: torch.Tensor) -> Sampled:
        """One token entry per request of ``batch``: its next token, or -1 when the batch only
        computed a chunk of its prompt. ``logits``: ``[len(batch.reqs), vocab]``. A batch a
        mode composed: what the mode samples (each request's accepted tokens). The modes
        constrain the logits first (grammar masks, penalties); logprobs are of those logits."""
        failed = {i: code_why for m in self.modes for i, code_why in m.constrain(batch, logits).items()}
        tokens = self._tokens(batch, logits)
        for i in failed:
            tokens[i] = -1
        wanted = any(r.sampling.logprobs is not None for r in batch.reqs)
        return Sampled(tokens, batch_logprobs(batch, logits, tokens) if wanted else {}, failed)

    def _tokens(self, batch: "Batch", logits: torch.Tensor) -> list:
        composed = next((t for m in self.modes if (t := m.sample(batch, logits)) is not None), None)
        if composed is not None:  # a batch a mode composed: the tokens it sampled
            return composed
        rows = batch.result_rows()
        out = [-1] * len(batch.reqs)
        if rows:
            reqs = [batch.reqs[i] for i in rows]
            # the new token's index in all_ids: what a keyed sample is keyed by
            positions = [len(r.all_ids) for r in reqs] if self.policy.deterministic else None
            # Every row (a decode batch): no copy of the [rows, vocab] logits (~0.3 ms for 4 rows).
            picked = logits if len(rows) == logits.shape[0] else logits[rows]
            for i, tok in zip(rows, sample(picked, [r.sampling for r in reqs], [r.generator for r in reqs],
                                           positions)):
                out[i] = tok
        return out

    @consensus_check("scheduler.apply_results", args=lambda self, batch, sampled: (batch.rids(), list(sampled.tokens)))
    def apply_results(self, batch: "Batch", sampled: Sampled) -> list[Request]:
        """``batch`` has returned with ``sampled`` (see :meth:`sample`): advance its requests,
        append their tokens (and logprobs), finish what stopped. Returns the finished requests."""
        finished: list[Request] = []
        now = time.perf_counter()
        for i, (req, n, tok) in enumerate(zip(batch.reqs, batch.new_tokens, sampled.tokens)):
            req.in_flight = False
            if req.status is Status.FINISHED:  # aborted while its batch was in flight
                continue
            if i in sampled.failed:  # a mode could not go on with it (its grammar failed): no token
                self._fail(req, *sampled.failed[i], finished)
                continue
            logprobs = sampled.logprobs.get(i, ())
            if isinstance(tok, (list, tuple)):  # a pass a mode composed: the accepted tokens
                self._apply_accepted(req, tok, logprobs, finished)
                continue
            req.computed += n
            self.prefill_computed_tokens += n if req.status is Status.PREFILL else 0
            if req.status is Status.PREFILL:
                self._after_chunk(req)
            for mode in self.modes:
                mode.on_computed(req)
            if req.status is Status.PREFILL:
                if req.computed < len(req.prompt_ids):  # chunk boundary: share the pages now
                    self.cache.cache_prefix(req.namespace, req.tokens_with_kv(), req.kv)
                    continue
                if any(w.waits_for == req.rid for w in self.waiting) or (
                        self.policy.shared_prefill_wait and awaited(req, self.waiting, self.cache.page_size)):
                    self.cache.cache_prefix(req.namespace, req.tokens_with_kv(), req.kv)  # for those who wait
                req.first_token_time = now
                req.status = Status.DECODE
            self._end(req, self._append(req, [tok], logprobs), finished)
        return finished

    def _after_chunk(self, req: Request) -> None:
        """A mode may have filled in prompt tokens past the chunk, or dropped some (edit reuse)."""
        for mode in self.modes:
            if (computed := mode.after_chunk(req)) is not None:
                req.computed = computed

    def _apply_accepted(self, req: Request, tokens: Sequence[int], logprobs: Sequence, finished: list[Request]) -> None:
        """A pass a mode composed gave ``tokens`` (j accepted proposals + the model's own): the
        KV now covers the j proposals. They are appended until one stops the request (the rest
        are dropped); the modes hear what was taken before the request finishes, since
        finishing caches what has KV and a mode may limit that (``Request.tokens_with_kv``)."""
        self.cache.accept_rows(req.kv, len(tokens))  # the pass's rows: the last token + the accepted drafts
        req.computed = len(req.all_ids) + len(tokens) - 1
        before = len(req.output_ids)
        reason = self._append(req, tokens, logprobs)
        req.computed = min(req.computed, len(req.all_ids))  # an early stop: only what was appended
        for mode in self.modes:
            mode.on_accepted(req, len(tokens) - 1, len(req.output_ids) - before)
        self._end(req, reason, finished)

    # ---- finishing -----------------------------------------------------------------------
    def _append(self, req: Request, tokens: Sequence[int], logprobs: Sequence) -> str:
        """Append ``tokens`` (and their ``logprobs``) until one stops ``req``: why it stops, or "".
        The request hears of each token that does not stop it."""
        for j, tok in enumerate(tokens):
            req.output_ids.append(tok)
            req.logprobs.extend(logprobs[j:j + 1])
            reason = stop_reason(req, self.eos_token_ids, self.decode_text)
            if reason:
                return reason
            req.notify()
        return ""

    def _end(self, req: Request, reason: str, finished: list[Request]) -> None:
        """Finish ``req`` (and count it in ``finished``) when there is a ``reason`` to."""
        if reason:
            self._finish(req, reason)
            finished.append(req)

    def _finish(self, req: Request, reason: str) -> None:
        """Finish ``req`` with ``reason``, running or still in the queue (then it holds only its prefetch)."""
        if any(r is req for r in self.waiting):
            self.waiting.remove(req)
            if req.prefetch is not None:
                self.cache.finish_prefetch(req.prefetch.op, req.tokens_np)
                req.prefetch = None
        else:
            if not any([m.on_finish(req) for m in self.modes]):  # else a mode still uses its KV
                self.release_kv(req)
            self.running.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        req.text = self.decode_text(req.output_ids)
        cut = stop_index(req.text, req.sampling.stop_strings)
        if cut >= 0:  # the stop string itself is not part of the answer
            req.text = req.text[:cut]
        req.notify()
        logger.info("finish rid=%d reason=%s prompt=%d output=%d ttft=%.3fs e2e=%.3fs", req.rid, reason,
                    len(req.prompt_ids), len(req.output_ids),
                    req.first_token_time - req.arrival_time if req.first_token_time else -1.0,
                    req.finish_time - req.arrival_time)

    def release_kv(self, req: Request) -> None:
        """Cache the pages of ``req`` that have KV (its reply's as the cache's policy says), free
        the rest, drop its lock; then grant its retention hints on what got cached."""
        tokens = req.tokens_with_kv()
        self.cache.release(req.namespace, tokens, req.kv, len(req.prompt_ids))
        req.retention = self.cache.retention.apply(req.namespace, tokens, req.hints, req.wall_time)

    def _fail(self, req: Request, code: str, error: str, finished: list[Request]) -> None:
        """End ``req`` with finish reason "error" (a mode's ``code``), running or still waiting."""
        req.error, req.error_code = error, code
        self._end(req, "error", finished)

    def _start_decode(self, req: Request, first_token: int, finished: list[Request]) -> None:
        """``req``'s whole prompt has KV (local tiers + what a mode received): decode from
        ``first_token``, which was sampled elsewhere."""
        req.computed = len(req.prompt_ids)
        for mode in self.modes:
            mode.on_computed(req)
        refusal = next((r for m in self.modes if (r := m.refuses(req, first_token)) is not None), None)
        if refusal is not None:  # e.g. it breaks the request's grammar: never shown to the client
            self._fail(req, *refusal, finished)
            return
        req.first_token_time = time.perf_counter()
        req.status = Status.DECODE
        self._end(req, self._append(req, [first_token], ()), finished)
