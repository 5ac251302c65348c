"""The step loop: admission, continuous batching with chunked prefill, finish handling.

Every cache decision (match, lock, evict, insert) happens here, on the scheduler thread, as
a function of the request stream alone (DESIGN invariant 3): ranks that feed the same requests
to the same scheduler make the same decisions.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Sequence

import torch

from ..cache.manager import KVCacheManager
from .request import Request, Status
from .sampling import sample

logger = logging.getLogger(__name__)

# forward(input_ids per seq, cached prefix len per seq, context slots per seq) -> logits [B, V]
ForwardFn = Callable[[list[list[int]], list[int], list[torch.Tensor]], torch.Tensor]


class Scheduler:
    def __init__(
        self,
        cache: KVCacheManager,
        forward: ForwardFn,
        decode_text: Callable[[Sequence[int]], str],
        eos_token_ids: set[int],
        chunked_prefill_size: int,
        max_running_requests: int,
        prefetch_policy: str = "best_effort",
        prefetch_timeout: Callable[[int], float] = lambda tokens: 1.0,
    ) -> None:
        self.cache = cache
        self.forward = forward
        self.decode_text = decode_text
        self.eos_token_ids = eos_token_ids
        self.chunked_prefill_size = chunked_prefill_size
        self.max_running_requests = max_running_requests
        self.prefetch_policy = prefetch_policy
        self.prefetch_timeout = prefetch_timeout  # seconds allowed for a prefetch of N tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_steps = 0

    # ---- queue ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.prefetch = self.cache.start_prefetch(req.namespace, req.tokens_np)
        if req.prefetch is not None:
            tokens = len(req.prefetch.hashes) * self.cache.page_size
            # wait_complete still gives up on a storage that hangs: no request waits forever.
            limit = self.prefetch_timeout(tokens) * (1 if self.prefetch_policy == "timeout" else 20)
            req.prefetch_deadline = time.perf_counter() + limit
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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
        """Run one prefill batch if any prompt work is ready, else one decode batch.
        Returns the requests that finished in this step."""
        self.num_steps += 1
        # Transfer acks change lock state only here, at a fixed point of the step, and only as
        # many as counted (one rank: what is ready; several ranks: an agreed count).
        self.cache.consume_acks(self.cache.ack_counts())
        finished: list[Request] = []
        prefill = self._schedule_prefill()
        self.cache.submit_transfers()  # load-backs must be in flight before the forward waits on them
        if prefill:
            self._run_prefill(prefill, finished)
        else:
            decode = [r for r in self.running if r.status is Status.DECODE]
            if decode:
                self._run_decode(decode, finished)
        self.cache.submit_transfers()  # backups of what finished in this step
        if not prefill and not self.running and self.waiting:
            time.sleep(0.001)  # only prefetches to wait for: do not spin
        return finished

    def _schedule_prefill(self) -> list[tuple[Request, int]]:
        """(request, new tokens this step) within the chunked-prefill token budget."""
        budget = self.chunked_prefill_size
        batch: list[tuple[Request, int]] = []
        for req in self.running:
            if req.status is Status.PREFILL and budget > 0:
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
            n = min(len(req.prompt_ids) - req.computed, budget)
            batch.append((req, n))
            budget -= n
        return batch

    def _prefetch_settled(self, req: Request) -> bool:
        """Apply the request's prefetch progress; True once the policy stops waiting for it,
        after inserting what arrived into the cache."""
        op = req.prefetch
        if op is None:
            return True
        final = self.cache.consume_prefetch_acks(op, self.cache.prefetch_ack_count(op))
        if not (final or self.prefetch_policy == "best_effort" or time.perf_counter() > req.prefetch_deadline):
            return False
        req.storage_tokens = self.cache.finish_prefetch(op, req.tokens_np)
        req.prefetch = None
        return True

    def _admit(self, req: Request) -> bool:
        kv = self.cache.admit(req.namespace, req.tokens_np, len(req.prompt_ids) + req.max_new_tokens,
                              req.storage_tokens)
        if kv is None:
            return False
        req.kv = kv
        req.computed = kv.device_hit_tokens + kv.host_hit_tokens + kv.storage_hit_tokens
        req.status = Status.PREFILL
        req.admitted_time = time.perf_counter()
        logger.info(
            "admit rid=%d prompt=%d cached(device=%d host=%d storage=%d) queue=%.3fs",
            req.rid, len(req.prompt_ids), kv.device_hit_tokens, kv.host_hit_tokens, kv.storage_hit_tokens,
            req.admitted_time - req.arrival_time,
        )
        return True

    def _run_prefill(self, batch: list[tuple[Request, int]], finished: list[Request]) -> None:
        ids = [req.prompt_ids[req.computed : req.computed + n] for req, n in batch]
        prefix = [req.computed for req, _ in batch]
        slots = [req.kv.slots[: req.computed + n] for req, n in batch]
        logits = self.forward(ids, prefix, slots)
        done_rows, done_reqs = [], []
        for row, (req, n) in enumerate(batch):
            req.computed += n
            if req.computed == len(req.prompt_ids):
                done_rows.append(row)
                done_reqs.append(req)
            else:  # chunk boundary: share the computed pages with later requests now
                self.cache.cache_prefix(req.namespace, req.tokens_np[: req.computed], req.kv)
        if done_reqs:
            tokens = sample(logits[done_rows], [r.sampling for r in done_reqs], [r.generator for r in done_reqs])
            now = time.perf_counter()
            for req, tok in zip(done_reqs, tokens):
                req.first_token_time = now
                req.status = Status.DECODE
                self._append_token(req, tok, finished)

    def _run_decode(self, reqs: list[Request], finished: list[Request]) -> None:
        ids = [[req.output_ids[-1]] for req in reqs]
        prefix = [req.computed for req in reqs]
        slots = [req.kv.slots[: req.computed + 1] for req in reqs]
        logits = self.forward(ids, prefix, slots)
        tokens = sample(logits, [r.sampling for r in reqs], [r.generator for r in reqs])
        for req, tok in zip(reqs, tokens):
            req.computed += 1
            self._append_token(req, tok, finished)

    # ---- finishing -----------------------------------------------------------------------
    def _append_token(self, req: Request, tok: int, finished: list[Request]) -> None:
        req.output_ids.append(tok)
        sp = req.sampling
        reason = ""
        if (tok in self.eos_token_ids and not sp.ignore_eos) or tok in sp.stop_token_ids:
            reason = "stop"
        elif sp.stop_strings and _stop_index(self.decode_text(req.output_ids), sp.stop_strings) >= 0:
            reason = "stop"
        elif len(req.output_ids) >= req.max_new_tokens:
            reason = "length"
        if reason:
            self._finish(req, reason)
            finished.append(req)
        elif req.on_update is not None:
            req.on_update(req)

    def _finish(self, req: Request, reason: str) -> None:
        self.cache.release(req.namespace, req.tokens_with_kv(), req.kv)
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


def _stop_index(text: str, stops: list[str]) -> int:
    """Where the earliest stop string starts in ``text``, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1
