"""Vetting untrusted grammars before the engine builds any matcher for them.

A grammar a client sends (a JSON schema, a regex, GBNF, a forced tool call's Lark) is compiled
first in a worker process of its own (:mod:`.grammar_worker`), under a stack, memory and CPU-time
limit, one grammar at a time at a lower priority than the engine: a native crash (a schema of
thousands of chained ``$ref`` overflows the compiler's stack), a compile that runs away or its
memory stays there, and the request gets a one-sentence 400. What crosses back is the verdict:
llguidance's compiled grammar text and what the grammar costs (:class:`GrammarCost`: the matcher
memory a rank builds once per grammar and per request, the slowest token mask of a walk through
it, in CPU microseconds). A grammar costing more than the engine's budgets
(``--grammar-memory-budget-mb``, ``--grammar-mask-budget-ms``) is refused here too; the ranks
count what they admit against the same budgets (runtime/grammar.py).

Budgets are measured where load cannot fake them: a compile's limit (``--grammar-compile-timeout``)
and a mask's cost are CPU time of the worker, never wall-clock time, so a busy machine (the
worker runs at nice 19) neither refuses a trivial schema nor lets a heavy one through. The
wall-clock backstop (:data:`.grammar_process.WALL_FACTOR` times the CPU limit) only catches a
worker that got no CPU at all: the server's trouble, not the grammar's.

Answers: :class:`InvalidRequestError` (HTTP 400) is about the grammar; :class:`OverloadedError`
(503) is about the server -- the queue is full for this client, the worker could not start, was
killed from outside (SIGKILL, SIGTERM...) or got no CPU time. Verdicts are cached by grammar only
when load cannot change them: every accepted grammar, and refusals for a compile error, an empty
language, a matcher that fails within the walk, a memory figure, a crash of the compiler. A
refusal by time (the CPU limit, the mask budget) is measured again next time, and a 503 leaves
nothing behind. A worker that died or was stopped is replaced for the next grammar.

Waiting is fair between clients (:mod:`.vet_queue`), and a caller that gives up (cancels its
future: the HTTP handler of a client that went away) leaves its job: a job nobody waits for is
taken out of the queue, or, while the worker runs it, stopped (the worker is killed and replaced).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, replace
from typing import Hashable, NamedTuple, Optional, Union

from ..errors import HicacheError, InvalidRequestError, OverloadedError
from ..model.token_bytes import token_table
from ..model.tokenizer import Tokenizer
from .grammar_process import CheckerDown, CpuBudget, WorkerProcess, status
from .sampling import GrammarCost, GrammarSpec
from .stacked_worker import StackedWorker
from .vet_queue import FairQueue, QueueFull, VetJob

logger = logging.getLogger(__name__)

# JSON as json.dumps writes it: a small model given free whitespace between tokens can spend its
# whole budget on it; vLLM and SGLang constrain it likewise by default.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's own limits (fuel per mask step, lexer states...) at its defaults, which bound the
# work of one mask deterministically on every rank; errors without the grammar in them (logs).
PARSER_LIMITS = {"verbose_errors": False}
VET_STACK_BYTES = 8 << 20  # the vetting thread's stack
ENGINE_STACK_BYTES = 4 * VET_STACK_BYTES  # threads that build and use matchers in the engine
WALK_STEPS = 16  # tokens walked through a grammar to time its masks
MAX_WAITING = 64  # distinct grammars queued for vetting (vet_queue.FairQueue: fair between clients); more: 503
CACHE_ENTRIES = 256
CACHE_CHARS = 32 << 20  # grammar text the verdict cache holds
MIN_TEMPLATE_BYTES = 64 << 10  # floors: a matcher is never counted as free
MIN_REQUEST_BYTES = 16 << 10
# The worker may hold this much more than the budget, so that a grammar a little over it is
# measured and refused with its figure rather than killed by the address-space limit.
WORKER_HEADROOM_BYTES = 256 << 20


@dataclass(frozen=True)
class VetLimits:
    """``timeout_s``: CPU seconds of the worker a grammar may take to compile and walk (wall-clock
    backstop: 4x); ``memory_bytes``: what one grammar's matchers may hold (template + one request's
    copy); ``mask_us``: its slowest token mask, in CPU microseconds of the worker."""

    timeout_s: float
    memory_bytes: int
    mask_us: int


_CONFIGS: "weakref.WeakKeyDictionary[Tokenizer, dict[int, dict]]" = weakref.WeakKeyDictionary()  # (tokenizer_config)


def tokenizer_config(tokenizer: Tokenizer, vocab_size: int) -> dict:
    """What an llguidance tokenizer is built from, in a worker or on a rank (JSON): our token table
    (model/token_bytes.py: each id's bytes as Latin-1 text, the special ids), the tokenizer's JSON
    (it encodes text for llguidance) and the EOS ids. Built once per tokenizer and size (~1 s on a
    262K vocabulary; the vetter and the masks both ask): callers must not change it."""
    configs = _CONFIGS.setdefault(tokenizer, {})
    if vocab_size not in configs:
        table = token_table(tokenizer.backend, vocab_size)
        configs[vocab_size] = {"tokenizer": tokenizer.backend.to_str(), "vocab_size": vocab_size,
                               "eos": sorted(tokenizer.eos_token_ids),
                               "tokens": [t.decode("latin-1") for t in table.tokens], "special": table.special}
    return configs[vocab_size]


# Signals that come from outside the worker (an operator, the OOM killer, a supervisor), not from
# what the grammar did to it: the check did not happen (503), nothing is remembered.
EXTERNAL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})


class _Verdict(NamedTuple):
    """What a check found: the vetted spec, or the error its callers get (None: nobody waits any
    more); ``keep``: it cannot change with load, so it is cached; ``counted``: its key in
    ``GrammarVetter.counts`` ("": none)."""

    outcome: Union[GrammarSpec, HicacheError, None]
    keep: bool
    counted: str = ""

    @classmethod
    def refused(cls, message: str, keep: bool = True) -> "_Verdict":
        """A verdict on the grammar (HTTP 400)."""
        return cls(InvalidRequestError(message, param="grammar"), keep, "refused")

    @classmethod
    def unavailable(cls, message: str) -> "_Verdict":
        """A verdict on the server (HTTP 503): never kept."""
        return cls(OverloadedError(message), False, "unavailable")


class GrammarVetter:
    """Vets grammars in a worker process, one at a time, fairly between clients, caching the
    verdicts load cannot change (see the module docstring). ``vet`` may be called from any thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, limits: VetLimits) -> None:
        self.limits = limits
        self._config = {**tokenizer_config(tokenizer, vocab_size), "parser_limits": PARSER_LIMITS,
                        "json_options": JSON_OPTIONS, "stack_bytes": VET_STACK_BYTES, "walk_steps": WALK_STEPS,
                        "memory_bytes": limits.memory_bytes + WORKER_HEADROOM_BYTES, "nice": 19, "parent": os.getpid()}
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[GrammarSpec, tuple[Future, int]] = OrderedDict()  # kept: (verdict, chars)
        self._chars = 0
        self._open: dict[GrammarSpec, VetJob] = {}  # queued or running, and someone waits for it
        self._queue = FairQueue(MAX_WAITING)
        self._closed = False
        self._worker = WorkerProcess(self._config)
        self.counts = {"vetted": 0, "refused": 0, "crashed": 0, "timed_out": 0, "unavailable": 0, "abandoned": 0,
                       "displaced": 0}
        self._dispatcher = StackedWorker("hicache-grammar-vet", 0)  # one _check_next per job added, in turn

    def vet(self, spec: GrammarSpec, client: Hashable = None) -> Future:
        """A future of ``spec`` with its :class:`GrammarCost`; it raises InvalidRequestError
        (``param="grammar"``) for a grammar the engine will not run, OverloadedError when the
        server could not check it (retry). OverloadedError now when the queue is full and
        ``client`` (the server passes the peer's address) already has as many grammars waiting as
        any other. Each caller gets a future of its own: cancelling it gives up waiting (the job
        goes when nobody else waits for it)."""
        mine: Future = Future()
        displaced: Optional[VetJob] = None
        with self._lock:
            kept = self._verdicts.get(spec)
            if kept is not None:
                self._verdicts.move_to_end(spec)
                source = kept[0]
            else:
                job, displaced = self._enqueue(spec, client)
                mine.add_done_callback(lambda f: f.cancelled() and self._give_up(job, client))
                source = job.verdict
        if displaced is not None:
            _settle_future(displaced.verdict, OverloadedError(
                f"{MAX_WAITING} grammars are waiting to be checked, this one for a client with more of them than "
                "any other; retry later."))
        # the job's verdict, copied to this caller's future (a caller that gave up is left alone)
        source.add_done_callback(lambda done: _settle_future(mine, None if done.cancelled() else done.exception()
                                                             or done.result()))
        return mine

    def _enqueue(self, spec: GrammarSpec, client: Hashable) -> tuple[VetJob, Optional[VetJob]]:
        """(Lock held.) The job ``spec``'s caller waits for, and the one it displaced, if any."""
        job = self._open.get(spec)
        if job is not None:
            self._queue.join(job, client)
            return job, None
        try:
            job, displaced = self._queue.add(spec, client)
        except QueueFull:
            raise OverloadedError(f"{MAX_WAITING} grammars are waiting to be checked; retry later.") from None
        self._open[spec] = job
        if displaced is not None:
            del self._open[displaced.spec]
            self.counts["displaced"] += 1
        self._dispatcher.submit(self._check_next)
        return job, displaced

    def _give_up(self, job: VetJob, client: Hashable) -> None:
        """A caller of ``client`` stopped waiting for ``job`` (its future was cancelled)."""
        with self._lock:
            if job.verdict.done() or not self._queue.leave(job, client):
                return
            if self._open.get(job.spec) is job:  # a caller from now on gets a new job
                del self._open[job.spec]
            self.counts["abandoned"] += 1
            if job.running:
                job.abandoned = True  # the dispatcher stops the worker at its next poll
                return
        job.verdict.cancel()

    def _keep(self, spec: GrammarSpec, verdict: Future, outcome: Union[GrammarSpec, HicacheError]) -> None:
        """(Lock held.) Cache a verdict load cannot change, least recently used out first."""
        chars = len(spec.source) + (len(outcome.cost.grammar) if isinstance(outcome, GrammarSpec) else 0)
        self._verdicts[spec] = (verdict, chars)
        self._chars += chars
        while len(self._verdicts) > CACHE_ENTRIES or self._chars > CACHE_CHARS:
            self._chars -= self._verdicts.popitem(last=False)[1][1]

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._dispatcher.close()
        self._worker.close()
        with self._lock:
            left, self._open = list(self._open.values()), {}
        for job in left:
            _settle_future(job.verdict, OverloadedError("the engine is shutting down."))

    # ---- the dispatcher thread -------------------------------------------------------
    def _check_next(self) -> None:
        """Check the job whose turn it is, if any is left (jobs leave the queue when displaced or
        abandoned, so some calls find none); nothing once closed."""
        with self._lock:
            job = None if self._closed else self._queue.take()
        if job is None:
            return
        try:
            verdict = self._check(job)
        except Exception as e:  # a bug here must not leave the request waiting forever
            logger.exception("grammar vetting failed")
            verdict = _Verdict.unavailable(f"the {job.spec.kind} grammar could not be checked "
                                           f"({type(e).__name__}); retry later.")
        with self._lock:
            if self._open.get(job.spec) is job:
                del self._open[job.spec]
            if verdict.keep and verdict.outcome is not None:
                self._keep(job.spec, job.verdict, verdict.outcome)
            if verdict.counted:
                self.counts[verdict.counted] += 1
        _settle_future(job.verdict, verdict.outcome)

    def _check(self, job: VetJob) -> _Verdict:
        """The worker's verdict on ``job``'s grammar (a fresh worker if the last one is gone)."""
        spec = job.spec
        try:
            if not self._worker.alive():
                self._worker.start()
            budget = CpuBudget(self._worker.proc.pid, self.limits.timeout_s)
            reply = self._worker.ask({"kind": spec.kind, "source": spec.source},
                                     lambda: job.abandoned or budget.spent())
        except CheckerDown as e:  # the server's trouble, not the grammar's
            return _Verdict.unavailable(str(e))
        except TimeoutError:
            return self._stopped(job, budget)
        if reply is None:
            return self._died(spec)
        return self._judge(spec, reply)

    def _stopped(self, job: VetJob, budget: CpuBudget) -> _Verdict:
        """Kill the worker at a deadline or for a job nobody waits for; what that means."""
        spec, pid, cpu_s, wall_s = job.spec, budget.pid, budget.cpu_s(), budget.wall_s()
        self._worker.stop()
        if job.abandoned:
            logger.info("grammar check: nobody waits for a %s grammar any more; worker pid=%d stopped", spec.kind, pid)
            return _Verdict(None, keep=False)
        self.counts["timed_out"] += 1
        logger.warning("grammar check: a %s grammar (%d chars) ran %.1f CPU-s (%.1f s; limit %.1f CPU-s); worker "
                       "pid=%d killed", spec.kind, len(spec.source), cpu_s, wall_s, self.limits.timeout_s, pid)
        if cpu_s > self.limits.timeout_s:  # CPU time: the grammar's own cost, but near the limit it varies
            return _Verdict.refused(f"the {spec.kind} grammar takes longer than {self.limits.timeout_s:g} s to "
                                    "compile (--grammar-compile-timeout).", keep=False)
        return _Verdict.unavailable(f"the grammar checker got too little CPU time to check the {spec.kind} grammar "
                                    f"in {wall_s:.0f} s; retry later.")

    def _judge(self, spec: GrammarSpec, reply: dict) -> _Verdict:
        what = f"the {spec.kind} grammar"
        if not reply["ok"]:  # a compile error, an empty language, a matcher that fails in the walk
            return _Verdict.refused(reply["error"])
        cost = GrammarCost(reply["grammar"], max(reply["template_bytes"], MIN_TEMPLATE_BYTES),
                           max(reply["request_bytes"], MIN_REQUEST_BYTES), reply["mask_us"])
        need, budget = cost.template_bytes + cost.request_bytes, self.limits.memory_bytes
        if need > budget:
            return _Verdict.refused(f"{what} needs {need / 2**20:.0f} MiB of matcher memory; this server allows "
                                    f"{budget / 2**20:.0f} MiB (--grammar-memory-budget-mb).")
        if cost.mask_us > self.limits.mask_us:  # CPU time again: measured anew next time
            return _Verdict.refused(f"{what} takes {cost.mask_us / 1e3:.1f} ms a token to enforce; this server "
                                    f"allows {self.limits.mask_us / 1e3:g} ms (--grammar-mask-budget-ms).", keep=False)
        logger.info("grammar vetted: %s, %d chars, compile %.0f CPU-ms, matcher %d + %d KiB, mask %d CPU-us over "
                    "%d tokens", spec.kind, len(spec.source), reply["compile_ms"], cost.template_bytes >> 10,
                    cost.request_bytes >> 10, cost.mask_us, reply["steps"])
        return _Verdict(replace(spec, cost=cost), True, "vetted")

    def _died(self, spec: GrammarSpec) -> _Verdict:
        """Why the worker stopped while compiling ``spec`` (it is replaced for the next grammar)."""
        self.counts["crashed"] += 1
        code, said = self._worker.proc.wait(), self._worker.said()  # (negative: the signal)
        logger.warning("grammar check: the worker died (status %d) on a %s grammar of %d chars; %s", code,
                       spec.kind, len(spec.source), said.strip().splitlines()[-1] if said.strip() else "no message")
        what = f"the {spec.kind} grammar cannot be compiled"
        if "memory allocation" in said or code in (-signal.SIGKILL, -signal.SIGABRT) and "alloc" in said:
            limit = (self.limits.memory_bytes + WORKER_HEADROOM_BYTES) / 2**20
            return _Verdict.refused(f"{what}: it needs more than {limit:.0f} MiB to compile.")
        if code < 0 and -code in EXTERNAL_SIGNALS:
            return _Verdict.unavailable(f"the grammar checker was stopped ({status(code)}) while it checked the "
                                        f"{spec.kind} grammar; retry.")
        if code == -signal.SIGSEGV:
            return _Verdict.refused(f"{what}: it crashed the grammar compiler (nested or chained too deeply).")
        return _Verdict.refused(f"{what}: it stopped the grammar compiler ({status(code)}).")


def _settle_future(future: Future, outcome: Union[GrammarSpec, BaseException, None]) -> None:
    """Set ``future`` to ``outcome`` (an exception: raised; None: cancelled) unless it is done."""
    with contextlib.suppress(InvalidStateError):  # cancelled meanwhile: its caller gave up
        if outcome is None:
            future.cancel()
        elif isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
