"""Vetting untrusted grammars before the engine builds any matcher for them.

A grammar a client sends (a JSON schema, a regex, GBNF, a forced tool call's Lark) is compiled
first in a worker process of its own (:mod:`.grammar_worker`), under a stack, memory and time
limit, one grammar at a time at a lower priority than the engine: a native crash (a schema of
thousands of chained ``$ref`` overflows the compiler's stack), a compile that runs away or its
memory stays there, and the request gets a one-sentence 400. What crosses back is the verdict:
llguidance's compiled grammar text and what the grammar costs (:class:`GrammarCost`: the matcher
memory a rank builds once per grammar and per request, the slowest token mask of a walk through
it). A grammar costing more than the engine's budgets (``--grammar-memory-budget-mb``,
``--grammar-mask-budget-ms``) is refused here too; the ranks count what they admit against the
same budgets (runtime/grammar.py).

Verdicts, good or bad, are cached by grammar (a repeated schema is vetted once; a repeated bomb
is refused at once). A worker that crashed or was killed at the deadline is replaced for the next
grammar; the one that killed it gets the error.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from ..errors import InvalidRequestError, OverloadedError
from ..model.tokenizer import Tokenizer
from .sampling import GrammarCost, GrammarSpec

logger = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("grammar_worker.py")
# JSON as json.dumps writes it: a small model given free whitespace between tokens can spend its
# whole budget on it; vLLM and SGLang constrain it likewise by default.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's own limits (fuel per mask step, lexer states...) at its defaults, which bound the
# work of one mask deterministically on every rank; errors without the grammar in them (logs).
PARSER_LIMITS = {"verbose_errors": False}
VET_STACK_BYTES = 8 << 20  # the vetting thread's stack
ENGINE_STACK_BYTES = 4 * VET_STACK_BYTES  # threads that build and use matchers in the engine
WALK_STEPS = 16  # tokens walked through a grammar to time its masks
STARTUP_TIMEOUT_S = 60.0
WALL_FACTOR = 4.0  # a compile's wall-clock backstop: this many times its CPU-time limit
POLL_S = 0.05  # how often a wait checks the worker's CPU time
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MAX_WAITING = 64  # distinct grammars queued for vetting; more: 503
CACHE_ENTRIES = 256
CACHE_CHARS = 32 << 20  # grammar text the verdict cache holds
MIN_TEMPLATE_BYTES = 64 << 10  # floors: a matcher is never counted as free
MIN_REQUEST_BYTES = 16 << 10
# The worker may hold this much more than the budget, so that a grammar a little over it is
# measured and refused with its figure rather than killed by the address-space limit.
WORKER_HEADROOM_BYTES = 256 << 20


@dataclass(frozen=True)
class VetLimits:
    """``timeout_s``: CPU seconds a grammar may take to compile and walk (wall-clock: 4x); ``memory_bytes``:
    what one grammar's matchers may hold (template + one request's copy); ``mask_us``: its
    slowest token mask."""

    timeout_s: float
    memory_bytes: int
    mask_us: int


def tokenizer_config(tokenizer: Tokenizer, vocab_size: int) -> dict:
    """What an llguidance tokenizer is built from, in a worker or on a rank."""
    return {"tokenizer": tokenizer.backend.to_str(), "vocab_size": vocab_size,
            "eos": sorted(tokenizer.eos_token_ids)}


class GrammarVetter:
    """Vets grammars in a worker process, one at a time, caching the verdicts (see the module
    docstring). ``vet`` may be called from any thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, limits: VetLimits) -> None:
        self.limits = limits
        self._config = {**tokenizer_config(tokenizer, vocab_size), "parser_limits": PARSER_LIMITS,
                        "json_options": JSON_OPTIONS, "stack_bytes": VET_STACK_BYTES, "walk_steps": WALK_STEPS,
                        "memory_bytes": limits.memory_bytes + WORKER_HEADROOM_BYTES, "nice": 19, "parent": os.getpid()}
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._chars = 0
        self._jobs: queue.Queue[Optional[tuple[GrammarSpec, Future]]] = queue.Queue()
        self._proc: Optional[subprocess.Popen] = None
        self._stderr = tempfile.TemporaryFile()
        self.counts = {"vetted": 0, "refused": 0, "crashed": 0, "timed_out": 0}
        self._thread = threading.Thread(target=self._serve, name="hicache-grammar-vet", daemon=True)
        self._thread.start()

    def vet(self, spec: GrammarSpec) -> Future:
        """A future of ``spec`` with its :class:`GrammarCost`; it raises InvalidRequestError
        (``param="grammar"``) for a grammar the engine will not run. OverloadedError (now) when
        :data:`MAX_WAITING` grammars already wait. Each caller gets a future of its own (one that
        gives up, e.g. cancels, leaves the verdict to the others and to the cache)."""
        with self._lock:
            shared = self._verdicts.get(spec)
            if shared is not None:
                self._verdicts.move_to_end(spec)
            else:
                if self._jobs.qsize() >= MAX_WAITING:
                    raise OverloadedError(f"{MAX_WAITING} grammars are waiting to be checked; retry later.")
                shared = self._verdicts[spec] = Future()
                self._chars += len(spec.source)
                self._trim()
                self._jobs.put((spec, shared))
        mine: Future = Future()
        shared.add_done_callback(lambda done: _pass_on(done, mine))
        return mine

    def _trim(self) -> None:
        while len(self._verdicts) > CACHE_ENTRIES or self._chars > CACHE_CHARS:
            done = next((s for s, f in self._verdicts.items() if f.done()), None)
            if done is None:
                return
            future = self._verdicts.pop(done)
            self._chars -= len(done.source) + _grammar_chars(future)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
        self._stop_worker()
        self._stderr.close()

    # ---- the dispatcher thread -------------------------------------------------------
    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            spec, future = job
            try:
                vetted = self._judge(spec, self._run(spec))
            except _CheckerDown as e:  # the server's trouble, not the grammar's: not remembered
                with self._lock:
                    self._verdicts.pop(spec, None)
                    self._chars -= len(spec.source)
                future.set_exception(InvalidRequestError(str(e), param="grammar"))
                continue
            except InvalidRequestError as e:
                self.counts["refused"] += 1
                future.set_exception(e)
                continue
            except Exception as e:  # a bug here must not leave the request waiting forever
                logger.exception("grammar vetting failed")
                future.set_exception(InvalidRequestError(f"the {spec.kind} grammar could not be checked "
                                                         f"({type(e).__name__}).", param="grammar"))
                continue
            self.counts["vetted"] += 1
            with self._lock:
                self._chars += len(vetted.cost.grammar)
            future.set_result(vetted)

    def _run(self, spec: GrammarSpec) -> dict:
        """The worker's verdict on ``spec`` (a fresh worker if the last one is gone)."""
        what = f"the {spec.kind} grammar"
        if self._proc is None or self._proc.poll() is not None:
            self._start_worker()
        budget = _CpuBudget(self._proc.pid, self.limits.timeout_s)
        try:
            _write(self._proc, {"kind": spec.kind, "source": spec.source})
            reply = _read(self._proc, budget.spent)
        except TimeoutError:
            self.counts["timed_out"] += 1
            logger.warning("grammar check: a %s grammar (%d chars) took over %.1f CPU-s (%.1f s); worker pid=%d killed",
                           spec.kind, len(spec.source), self.limits.timeout_s, time.monotonic() - budget.t0,
                           self._proc.pid)
            self._stop_worker()
            raise InvalidRequestError(f"{what} takes longer than {self.limits.timeout_s:g} s to compile "
                                      "(--grammar-compile-timeout).", param="grammar") from None
        if reply is None:
            raise InvalidRequestError(f"{what} cannot be compiled: {self._died(spec)}.", param="grammar")
        return reply

    def _judge(self, spec: GrammarSpec, reply: dict) -> GrammarSpec:
        what = f"the {spec.kind} grammar"
        if not reply["ok"]:
            raise InvalidRequestError(reply["error"], param="grammar")
        cost = GrammarCost(reply["grammar"], max(reply["template_bytes"], MIN_TEMPLATE_BYTES),
                           max(reply["request_bytes"], MIN_REQUEST_BYTES), reply["mask_us"])
        need, budget = cost.template_bytes + cost.request_bytes, self.limits.memory_bytes
        if need > budget:
            raise InvalidRequestError(f"{what} needs {need / 2**20:.0f} MiB of matcher memory; this server allows "
                                      f"{budget / 2**20:.0f} MiB (--grammar-memory-budget-mb).", param="grammar")
        if cost.mask_us > self.limits.mask_us:
            raise InvalidRequestError(f"{what} takes {cost.mask_us / 1e3:.1f} ms a token to enforce; this server "
                                      f"allows {self.limits.mask_us / 1e3:g} ms (--grammar-mask-budget-ms).",
                                      param="grammar")
        logger.info("grammar vetted: %s, %d chars, compile %.0f ms, matcher %d + %d KiB, mask %d us over %d tokens",
                    spec.kind, len(spec.source), reply["compile_ms"], cost.template_bytes >> 10,
                    cost.request_bytes >> 10, cost.mask_us, reply["steps"])
        return replace(spec, cost=cost)

    def _died(self, spec: GrammarSpec) -> str:
        """Why the worker stopped while compiling ``spec`` (it is replaced for the next grammar)."""
        self.counts["crashed"] += 1
        code = self._proc.wait()
        self._stderr.seek(0)
        said = self._stderr.read()[-2000:].decode(errors="replace")
        self._stderr.seek(0)
        self._stderr.truncate()
        self._proc = None
        logger.warning("grammar check: the worker died (status %d) on a %s grammar of %d chars; %s", code,
                       spec.kind, len(spec.source), said.strip().splitlines()[-1] if said.strip() else "no message")
        if "memory allocation" in said or code in (-signal.SIGKILL, -signal.SIGABRT) and "alloc" in said:
            return f"it needs more than {(self.limits.memory_bytes + WORKER_HEADROOM_BYTES) / 2**20:.0f} MiB to compile"
        if code == -signal.SIGSEGV:
            return "it crashed the grammar compiler (nested or chained too deeply)"
        return f"it stopped the grammar compiler ({_status(code)})"

    def _start_worker(self) -> None:
        env = {**os.environ, "MALLOC_ARENA_MAX": "2", "PYTHONHASHSEED": "0"}
        self._proc = subprocess.Popen([sys.executable, "-I", str(WORKER)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr, env=env)
        try:
            _write(self._proc, self._config)
            start = time.monotonic()
            ready = _read(self._proc, lambda: time.monotonic() - start > STARTUP_TIMEOUT_S)
        except TimeoutError:
            ready = None
        if not ready:
            self._stop_worker()
            raise _CheckerDown("the grammar could not be checked: the grammar checker did not start.")
        logger.info("grammar check: worker pid=%d ready", self._proc.pid)

    def _stop_worker(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None


class _CheckerDown(Exception):
    """The worker process could not be started (a verdict on the server, not on the grammar)."""


def _pass_on(done: Future, to: Future) -> None:
    if to.cancelled():
        return
    if done.exception() is not None:
        to.set_exception(done.exception())
    else:
        to.set_result(done.result())


def _grammar_chars(future: Future) -> int:
    if future.done() and future.exception() is None:
        return len(future.result().cost.grammar)
    return 0


def _status(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _write(proc: subprocess.Popen, message: dict) -> None:
    body = json.dumps(message).encode()
    try:
        proc.stdin.write(struct.pack(">I", len(body)) + body)
        proc.stdin.flush()
    except BrokenPipeError:
        pass  # it died: reading says so


class _CpuBudget:
    """A compile's limit in CPU seconds of the worker (so a verdict does not depend on how busy the
    engine keeps the CPUs: the worker runs at the lowest priority), with a wall-clock backstop of
    :data:`WALL_FACTOR` times it for a worker that cannot run at all."""

    def __init__(self, pid: int, seconds: float) -> None:
        self.pid, self.seconds, self.t0 = pid, seconds, time.monotonic()
        self.cpu0 = self.cpu()

    def cpu(self) -> float:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime
        except (OSError, IndexError, ValueError):  # not Linux, or gone: wall-clock alone
            return time.monotonic() - self.t0

    def spent(self) -> bool:
        return (self.cpu() - self.cpu0 > self.seconds
                or time.monotonic() - self.t0 > WALL_FACTOR * self.seconds)


def _read(proc: subprocess.Popen, expired: Callable[[], bool]) -> Optional[dict]:
    """The worker's next message; None if it exited; TimeoutError once ``expired()``."""
    header = _read_exact(proc.stdout.fileno(), 4, expired)
    if header is None:
        return None
    body = _read_exact(proc.stdout.fileno(), struct.unpack(">I", header)[0], expired)
    return None if body is None else json.loads(body.decode())


def _read_exact(fd: int, n: int, expired: Callable[[], bool]) -> Optional[bytes]:
    buf = bytearray()
    while len(buf) < n:
        if not select.select([fd], [], [], POLL_S)[0]:
            if expired():
                raise TimeoutError
            continue
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)
