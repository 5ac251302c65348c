"""The scheduler's phases: events, admission, continuous batching with chunked prefill; sampling
and finish handling are :class:`~hicache.runtime.results.Results`, which it extends. The order
they run in, for every rank layout, is runtime/step.py, driven by whoever runs the loop; the
scheduler never steps itself.

Every cache decision (match, lock, evict, insert) happens here, on the scheduler thread, as
a function of the request stream alone (DESIGN invariant 3): ranks that feed the same requests
to the same scheduler make the same decisions. Modes (speculative decoding, the P/D roles)
take part through the hooks of :class:`~hicache.runtime.modes.Mode` at fixed points of these
phases; the scheduler applies what they return and knows none of them by name.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from ..cache.manager import KVCacheManager
from ..consensus_record import consensus_check
from .batch import Batch, BatchKind
from .events import PrefetchEvent, StepEvents
from .fair_share import GroupShares, newcomer_budget
from .modes import Action, Fail, Mode, Release, StartDecode
from .prefetch_policy import PrefetchPolicy
from .request import PrefetchWait, Request, Status
from .results import Results
from .shared_prefill import computed_prompt_of, computing_prefix_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulePolicy:
    """How the scheduler admits and chunks: ``chunked_prefill_size`` tokens a prefill pass at most,
    ``max_running_requests`` at once; the storage prefetch policy and its timeout (seconds the
    ``timeout`` policy allows N tokens); ``deterministic`` (``--enable-deterministic-inference``):
    seeded requests sample keyed by position (runtime/sampling.py), not from their generator in draw
    order; ``shared_prefill_wait``: a request whose first tokens another request is still computing
    waits for them (runtime/shared_prefill.py)."""

    chunked_prefill_size: int
    max_running_requests: int
    prefetch_policy: str = "adaptive"
    prefetch_timeout: Callable[[int], float] = lambda tokens: 1.0
    deterministic: bool = False
    shared_prefill_wait: bool = False


class Scheduler(Results):
    def __init__(self, cache: KVCacheManager, decode_text: Callable[[Sequence[int]], str], eos_token_ids: set[int],
                 policy: SchedulePolicy, modes: Sequence[Mode] = ()) -> None:
        """``modes``: what plugs into the phases (hicache.runtime.mode_registry), in the order
        their hooks run and their events sit in the event vector."""
        self.cache = cache
        self.decode_text = decode_text
        self.eos_token_ids = eos_token_ids
        self.policy = policy
        self.prefetch_rule = PrefetchPolicy(policy.prefetch_policy, policy.prefetch_timeout)  # wait deadlines
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.modes = list(modes)
        # slots a request reserves past its tokens (a mode's passes may write KV there)
        self.reserve_slots = sum(m.reserve_slots() for m in self.modes)
        self.prefill_computed_tokens = 0  # prompt tokens the forward computed (cache hits excluded)

    # ---- queue ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.cache.retention.advance(req.wall_time)  # the retention clock: arrival stamps, alike on every rank
        op = self.cache.start_prefetch(req.namespace, req.tokens_np)
        if op is not None:
            pages = len(op.hashes)
            req.prefetch = PrefetchWait(op, self.prefetch_rule.deadline(
                req.rid, pages, pages * self.cache.page_size, self.cache.storage.read_page_s, time.perf_counter()))
        self.waiting.append(req)

    def observe_forward(self, batch: "Batch", seconds: float) -> None:
        """``batch``'s forward pass took ``seconds`` on this rank (up to where its output was
        used, so that an asynchronous device has finished it). Prefill passes feed the
        throughput estimate of the adaptive prefetch policy; decode passes say nothing about
        the cost of recomputing a prompt."""
        if batch.kind == BatchKind.PREFILL:
            self.prefetch_rule.prefill.observe(sum(batch.new_tokens), seconds)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._open_work())

    def only_waiting(self) -> bool:
        """Nothing can run until background work lands (prefetches, the modes' open items): a
        loop that found no batch should pause rather than spin."""
        return (not self.running and bool(self.waiting)) or self._open_work()

    def _open_work(self) -> bool:
        return any(m.open_work() for m in self.modes)

    def abort(self, rid: int) -> Request | None:
        """Drop a request wherever it is, freeing what it holds. The request, if it was found."""
        req = next((r for r in (*self.waiting, *self.running) if r.rid == rid), None)
        if req is not None:
            self._finish(req, "abort")
        return req

    # ---- events: what background work finished, applied only as agreed ----------------
    def pending_prefetches(self) -> list[Request]:
        """Waiting requests whose storage prefetch is still open, in queue order (the order
        of their entries in the event vector)."""
        return [r for r in self.waiting if r.prefetch is not None]

    def ready_events(self) -> StepEvents:
        """This rank's view of finished background work (ranks MIN-reduce its list form):
        ready leading acks per cache queue, then per open prefetch its published progress
        acks and whether its wait deadline has come, then the modes' open items."""
        now = time.perf_counter()
        return StepEvents(self.cache.ack_counts(), tuple(
            PrefetchEvent(self.cache.prefetch_ack_count(r.prefetch.op), now >= r.prefetch.deadline)
            for r in self.pending_prefetches()), tuple(e for m in self.modes for e in m.local_events()))

    @consensus_check("scheduler.consume_events", args=lambda self, events: events.to_list())
    def consume_events(self, events: StepEvents) -> list[Request]:
        """Apply exactly the agreed ``events``. Transfer acks change lock state only here, at a
        fixed point of the step; so do the modes' work items that ended. Returns the requests
        that finished here (a mode failed them)."""
        self.cache.consume_acks(events.acks)
        for req, p in zip(self.pending_prefetches(), events.prefetches, strict=True):
            self.cache.consume_prefetch_acks(req.prefetch.op, p.acks)
            req.prefetch.expired = p.expired
        finished: list[Request] = []
        # Counted before any action runs: an action (a finish) may open work in another mode,
        # which the next step's events cover.
        counts = [m.open_work() for m in self.modes]
        if sum(counts) != len(events.work):
            raise RuntimeError(f"the agreed events name {len(events.work)} open work items, the modes {sum(counts)}")
        start = 0
        for mode, n in zip(self.modes, counts):
            self._apply_actions(mode.apply_events(events.work[start:start + n]), finished)
            start += n
        return finished

    def _apply_actions(self, actions: Sequence[Action], finished: list[Request]) -> None:
        for a in actions:
            if isinstance(a, StartDecode):
                self._start_decode(a.req, a.first_token, finished)
            elif isinstance(a, Fail):
                self._fail(a.req, a.code, a.error, finished)
            elif isinstance(a, Release):
                self.release_kv(a.req)
                if a.report:
                    a.req.notify()

    # ---- scheduling ------------------------------------------------------------------------
    @consensus_check("scheduler.schedule", result=lambda b: None if b is None else (str(b.kind), b.rids(), b.new_tokens))
    def schedule(self) -> "Batch | None":
        """One prefill batch if any prompt work is ready, else one decode batch, else None.
        Requests whose previous batch has not returned yet (``in_flight``) sit this one out."""
        prefill = self._schedule_prefill()
        if prefill:
            batch = Batch(BatchKind.PREFILL, [r for r, _ in prefill], [n for _, n in prefill])
        else:
            decode = [r for r in self.running if r.status is Status.DECODE and not r.in_flight]
            if not decode:
                return None
            plans = [m.decode_batch(decode) for m in self.modes]  # every mode hears of the batch
            plan = next((p for p in plans if p is not None), None)
            batch = Batch(BatchKind.DECODE, decode, [1] * len(decode)) if plan is None else \
                Batch(plan.kind, decode, plan.rows, plan.proposal)
        for req, n in zip(batch.reqs, batch.new_tokens):
            req.in_flight = True
            self.cache.before_forward(req.kv, req.computed, n, self._later_tokens(req, n), len(req.prompt_ids))
        return batch

    def _later_tokens(self, req: Request, n: int) -> int:
        """The most tokens a forward of ``req`` adds after this one of ``n``: another prompt chunk,
        else a decode (or verify) pass. A waiting request's first forward is a prompt chunk (its hit
        is not known yet: the whole prompt is counted)."""
        left = len(req.prompt_ids) - req.computed - n if req.status in (Status.WAITING, Status.PREFILL) else 0
        return max(min(left, self.policy.chunked_prefill_size), 1 + self.reserve_slots)

    def _schedule_prefill(self) -> list[tuple[Request, int]]:
        """(request, new tokens this step) within the chunked-prefill token budget: queued requests
        first with the share running prompts leave them (runtime/fair_share.py), then running prompts
        with the rest."""
        budget = self.policy.chunked_prefill_size
        prefilling = [r for r in self.running if r.status is Status.PREFILL and not r.in_flight]
        unit = max(self.cache.page_size, self.cache.chunk_grid)
        reserved = newcomer_budget(budget, bool(self.waiting), unit) if prefilling else budget
        admitted = self._admit_waiting(reserved)
        budget -= sum(n for _, n in admitted)
        batch: list[tuple[Request, int]] = []
        for req in prefilling:
            if budget <= 0:
                break
            n = self._chunk(req, budget)
            batch.append((req, n))
            budget -= n
        cut = [(r, self.cache.chunk_tokens(r.computed, n, len(r.prompt_ids))) for r, n in batch + admitted]
        return [(r, n) for r, n in cut if n > 0]  # (a running prompt whose share ends short of the grid waits)

    def _admit_waiting(self, budget: int) -> list[tuple[Request, int]]:
        """Admit queued requests in arrival order while ``budget`` tokens and the running slots last;
        a request whose group has its fair share (or whose storage read,
        sibling, shared prefix or mode is not ready) lets later ones go first."""
        batch: list[tuple[Request, int]] = []
        shares = GroupShares(self.running, self.policy.max_running_requests, self.cache.capacity_pages)
        for req in list(self.waiting):
            if budget < self.cache.chunk_grid or len(self.running) >= self.policy.max_running_requests:
                break  # (a chunk shorter than the recurrent layers' grid would end off it: docs/hybrid_kv.md)
            if not self._prefetch_settled(req):
                continue  # its storage read is still arriving; later requests may go first
            if req.waits_for is not None and self._prompt_pending(req.waits_for):
                continue  # n > 1: admitted once its sibling's prompt is cached, to share its pages
            if self.policy.shared_prefill_wait:
                if computing_prefix_of(req, self.running) is not None:
                    continue  # another request is computing its first tokens: it hits them once cached
                # A running request computed the first tokens of its prompt while it was on its way (nobody
                # waited, so its pages would enter the tree only at its finish): its prompt is cached now, for
                # req to hit. The prompt only: its reply's KV is the decode kernels' arithmetic.
                other = computed_prompt_of(req, self.running, self.cache.page_size)
                if other is not None:
                    self.cache.cache_prefix(other.namespace, other.tokens_np, other.kv)
            if shares.over(req, self.cache.pages_for(self._reserve_tokens(req))):
                continue  # its group has its share: others first
            if not all([m.admissible(req) for m in self.modes]):  # every mode hears of it
                continue  # e.g. its grammar's matcher is being built, or a budget is full
            if not self._admit(req):
                break  # first-come first-served for memory: later requests wait behind it
            shares.admitted(req)
            self.waiting.remove(req)
            self.running.append(req)
            for mode in self.modes:
                mode.on_admit(req)
            if req.status is Status.RECEIVING:
                continue  # its prompt's KV comes from elsewhere
            n = self._chunk(req, budget)
            batch.append((req, n))
            budget -= n
        return batch

    def _chunk(self, req: Request, budget: int) -> int:
        """The prompt tokens ``req``'s next chunk takes within ``budget``, as far as every mode allows."""
        limits = [limit for m in self.modes if (limit := m.chunk_limit(req)) is not None]
        return min(len(req.prompt_ids) - req.computed, budget, *limits)

    def _reserve_tokens(self, req: Request) -> int:
        """Tokens of KV a request reserves at admission: its prompt, its most output, a mode's slots."""
        return len(req.prompt_ids) + req.max_new_tokens + self.reserve_slots

    def _prompt_pending(self, rid: int) -> bool:
        """Request ``rid`` is queued or still computing its prompt."""
        return any(r.rid == rid for r in self.waiting) or any(
            r.rid == rid and r.status is not Status.DECODE for r in self.running)

    def _prefetch_settled(self, req: Request) -> bool:
        """True once the policy stops waiting for the request's prefetch, after inserting
        what arrived (the agreed acks) into the cache."""
        wait = req.prefetch
        if wait is None:
            return True
        if not (wait.op.final_applied or self.policy.prefetch_policy == "best_effort" or wait.expired):
            return False
        req.storage_tokens = self.cache.finish_prefetch(wait.op, req.tokens_np)
        req.prefetch = None
        return True

    def _admit(self, req: Request) -> bool:
        for mode in self.modes:
            req.namespace = mode.admission_namespace(req) or req.namespace
        arrives = any([m.kv_arrives(req) for m in self.modes])  # its prompt is not computed here: decode only
        kv = self.cache.admit(req.namespace, req.tokens_np, self._reserve_tokens(req),
                              req.storage_tokens, 1 + self.reserve_slots if arrives else self._later_tokens(req, 0),
                              kv_arrives=arrives)
        if kv is None:
            return False
        req.kv = kv
        req.cached = {"device": kv.device_hit_tokens, "host": kv.host_hit_tokens, "storage": kv.storage_hit_tokens}
        req.computed = sum(req.cached.values())
        req.status = Status.RECEIVING if arrives else Status.PREFILL
        req.admitted_time = time.perf_counter()
        logger.info("admit rid=%d prompt=%d cached(device=%d host=%d storage=%d) queue=%.3fs", req.rid,
                    len(req.prompt_ids), *req.cached.values(), req.admitted_time - req.arrival_time)
        req.notify()  # before its first token: a stream can start (Anthropic's message_start)
        return True
