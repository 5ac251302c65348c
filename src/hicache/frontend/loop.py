"""EngineLoop: drives one Engine from a background thread for concurrent callers (the server).

The loop thread is the only thread that touches the scheduler and the cache (DESIGN invariant
3). Callers post commands to it through a thread-safe queue (add, abort, call) and receive
token updates through ``Request.on_update``, collected in an :class:`Outbox` and forwarded into
asyncio queues of the callers' event loops once a loop iteration (one ``call_soon_threadsafe`` per
event loop, not one per request and token). ``Engine.generate`` stays the in-process way to drive
an engine; it refuses to run while a loop drives the same engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from ..cache_hints import RetentionHint
from ..disagg.bootstrap import Bootstrap
from ..errors import EngineDeadError, HicacheError
from ..openmp import release_omp_pool
from ..parallel.channels import queued_now
from ..runtime.request import GenerateResult, Request, Status
from ..runtime.sampling import SamplingParams
from ..runtime.step import Abort, Add, apply_intake, take_intake
from .engine import Engine, Prompt

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # while idle the loop wakes this often to apply finished transfers and check ranks


@dataclass(frozen=True)
class Call:
    """Run ``fn()`` on the loop thread between two steps; its result (or error) goes to ``future``."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future


@dataclass(frozen=True)
class Stop:
    """Abort what is left and end the loop thread."""


@dataclass
class Update:
    """New output since the previous update of one request."""

    token_ids: list[int]  # tokens appended since the previous update
    num_output_tokens: int  # output tokens so far
    finished: bool
    result: Optional[GenerateResult] = None  # set on the final update
    logprobs: list = field(default_factory=list)  # the new tokens' TokenLogprob entries (when asked)
    # On a request's first update only: its prompt tokens the cache served, per tier (device / host /
    # storage), so a stream can report them before the reply ends (Anthropic's message_start)
    cached: Optional[dict[str, int]] = None

    @property
    def admission(self) -> bool:
        """The update a request makes once admitted (its hits known), before its first token: no tokens,
        not finished. Only the Messages stream writes it (``message_start``); other streams skip it."""
        return not self.token_ids and not self.finished


class Outbox:
    """Updates the loop thread made since it last sent them; :meth:`send` hands them to their event
    loops with one ``call_soon_threadsafe`` each. Each call wakes the asyncio thread, which then
    holds the GIL for its ~0.3 ms of Python per streamed chunk while the loop thread waits for it:
    one wake-up a step instead of one per request (a batch-4 step applied its tokens in 1.24 ms
    served vs 0.05 ms in process, forced-AVX2 build). Touched by the loop thread only."""

    def __init__(self) -> None:
        self._items: list[tuple["RequestHandle", "Update"]] = []

    def put(self, handle: "RequestHandle", upd: "Update") -> None:
        self._items.append((handle, upd))
        if upd.admission:  # sent before the step's forward: a long prompt's first chunk takes tens of seconds
            self.send()

    def send(self) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for handle, upd in self._items:
            by_loop.setdefault(handle._aio_loop, []).append((handle, upd))
        self._items = []
        for aio_loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody listens any more
                aio_loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple["RequestHandle", "Update"]]) -> None:
    """On the handles' event loop: each update into its handle's queue, in the order made."""
    for handle, upd in items:
        handle._queue.put_nowait(upd)


class RequestHandle:
    """A submitted request as seen from an asyncio event loop: ``async for update in handle``."""

    def __init__(self, req: Request, aio_loop: asyncio.AbstractEventLoop, outbox: Outbox) -> None:
        self.rid, self.prompt_tokens, self.max_new_tokens = req.rid, len(req.prompt_ids), req.max_new_tokens
        self.finished = False
        self.result: Optional[GenerateResult] = None
        self._aio_loop, self._outbox = aio_loop, outbox
        self._queue: asyncio.Queue[Update] = asyncio.Queue()
        self._sent = 0  # output tokens already forwarded; touched by the loop thread only
        self._first_sent = False  # the update carrying the cache hits went out (loop thread only)

    def _push(self, req: Request) -> None:
        """``Request.on_update``: runs on the loop thread, cheap, never raises."""
        n = len(req.output_ids)
        done = req.status is Status.FINISHED
        first = not self._first_sent and req.cached is not None
        upd = Update(req.output_ids[self._sent : n], n, done, GenerateResult.from_request(req) if done else None,
                     req.logprobs[self._sent : n], dict(req.cached) if first else None)
        self._sent, self._first_sent = n, self._first_sent or first
        self._outbox.put(self, upd)

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> Update:
        if self.finished:
            raise StopAsyncIteration
        upd = await self._queue.get()
        if upd.finished:
            self.finished, self.result = True, upd.result
        return upd

    async def wait(self) -> GenerateResult:
        """Consume updates until the request finishes; returns its result."""
        async for _ in self:
            pass
        assert self.result is not None
        return self.result


class EngineLoop:
    """Runs ``engine.scheduler.step()`` on a dedicated thread while there is work.

    ``on_finish(result)`` (optional) is called on the loop thread once per finished request, e.g.
    to update metrics; it must be cheap and must not raise.

    If the engine fails (a bug in a step, a rank that died), every request in flight finishes
    with ``finish_reason="error"`` and the failure as ``GenerateResult.error``, new requests get
    :class:`EngineDeadError`, and ``on_death(error)`` (optional) is called once, from the loop
    thread, so a server can exit and be restarted.
    """

    def __init__(self, engine: Engine, on_finish: Callable[[GenerateResult], None] | None = None,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        self.engine, self.on_finish, self.on_death = engine, on_finish, on_death
        self._cmds: queue.Queue[Add | Abort | Call | Stop] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._outbox = Outbox()
        self.num_inflight = 0  # requests submitted and not finished (queued, waiting or running)
        self.error: BaseException | None = None  # set if the loop thread died

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        """Start the loop thread; best called from the thread that loaded the engine. That
        thread's OpenMP workers are let go here (:func:`release_omp_pool`) so the loop thread's
        own keep spinning at their barriers; another thread that ran torch keeps its workers."""
        if self._thread is not None:
            raise HicacheError("the engine loop is already running.")
        thread = threading.Thread(target=self._run, name="hicache-engine-loop", daemon=True)
        self.engine.drive(thread)  # (raises if another loop drives it); from here on generate() refuses
        release_omp_pool()  # this thread's OpenMP workers would slow every step of the loop's own
        self._thread = thread
        thread.start()
        logger.info("engine loop started")
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort what is left, stop the thread and hand the engine back to in-process use."""
        if self._thread is None:
            return
        self._cmds.put(Stop())
        self._thread.join(timeout)
        self._thread = None
        logger.info("engine loop stopped")

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check_alive(self) -> None:
        """Raises :class:`EngineDeadError` (saying why) unless the loop is serving."""
        if self.error is not None:
            raise EngineDeadError(f"the engine failed and is not serving: {_describe(self.error)}")
        if not self.alive:
            raise EngineDeadError("the engine loop is not running.")

    # ---- commands (any thread) -----------------------------------------------------------
    def submit(self, prompt: Prompt, sampling: SamplingParams, cache_salt: str | None = None,
               aio_loop: asyncio.AbstractEventLoop | None = None, bootstrap: Bootstrap | None = None,
               waits_for: int | None = None, hints: Sequence[RetentionHint] = ()) -> RequestHandle:
        """Queue a request: ``sampling`` passed :meth:`Engine.check_sampling` (the server's prepare
        step checks it once); the prompt is checked here, on the caller's thread (raises
        InvalidRequestError). Call from a coroutine, or pass the event loop that will consume the handle.
        ``bootstrap``: P/D, where the request's other half runs. ``waits_for``: the rid of a sibling
        with the same prompt (n > 1): admitted once that prompt is cached, it computes only its tail.
        ``hints``: retention hints (:mod:`hicache.cache_hints`)."""
        self.check_alive()
        req = self.engine.make_request(prompt, sampling, cache_salt, bootstrap, hints)
        handle = RequestHandle(req, aio_loop or asyncio.get_running_loop(), self._outbox)
        req.waits_for, req.on_update = waits_for, handle._push
        with self._lock:
            self.num_inflight += 1
        self._cmds.put(Add((req,)))
        return handle

    def abort(self, rid: int) -> None:
        """Drop a request wherever it is; frees what it holds. No-op once it has finished."""
        self._cmds.put(Abort(rid))

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the loop thread between two steps; its result comes back in the future
        (``await asyncio.wrap_future(...)`` from a coroutine). EngineDeadError unless the loop is serving."""
        self.check_alive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(Call(fn, fut))
        return fut

    async def flush(self, timeout: float = 0.0, poll_s: float = 0.05) -> bool:
        """Empty the cache once no request is in flight, waiting up to ``timeout`` seconds.
        False when requests were still running at the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 0.0)
        while True:
            if await asyncio.wrap_future(self.call(self.engine.flush_cache)):
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(poll_s)

    async def stats(self) -> dict[str, Any]:
        """``Engine.stats()`` taken on the loop thread."""
        return await asyncio.wrap_future(self.call(self.engine.stats))

    # ---- the loop thread -----------------------------------------------------------------
    def _run(self) -> None:
        eng, sched = self.engine, self.engine.scheduler
        try:
            while True:
                self._outbox.send()  # what the last step (or abort) made, before anything may block
                eng.drain_idle()
                if not self._drain(block=not sched.has_work()):
                    break
                if sched.has_work():
                    for req in sched.step():
                        self._finished(req)
        except BaseException as e:  # a bug or a dead rank: fail every request rather than hang its client
            self.error = e
            logger.exception("engine loop crashed; failing %d request(s)", self.num_inflight)
        finally:
            if self.error is None:
                self._abort_all()
            else:
                self._fail_all(_describe(self.error))
            self._outbox.send()
            eng.drive(None)
        if self.error is not None and self.on_death is not None:
            self.on_death(self.error)

    def _abort_all(self) -> None:
        sched = self.engine.scheduler
        for req in list(sched.running) + list(sched.waiting):
            try:
                sched.abort(req.rid)
                self._finished(req)
            except Exception:
                logger.exception("abort rid=%d failed", req.rid)

    def _fail_all(self, why: str) -> None:
        """The engine is broken: finish every request with the error, touching no engine state."""
        sched = self.engine.scheduler
        reqs = list(sched.running) + list(sched.waiting)
        for cmd in queued_now(self._cmds):  # and those still queued as commands
            if isinstance(cmd, Add):
                reqs.extend(cmd.requests)
            elif isinstance(cmd, Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(EngineDeadError(f"the engine failed: {why}"))
        for req in (r for r in reqs if r.status is not Status.FINISHED):  # (checked as each comes: a request twice)
            req.status, req.finish_reason, req.error = Status.FINISHED, "error", why
            req.finish_time = time.perf_counter()
            req.notify()
            self._finished(req)

    def _drain(self, block: bool) -> bool:
        """Apply queued commands (waiting up to IDLE_POLL_S for one when ``block``): adds and
        aborts through the same intake as a rank group's leader (runtime/step.py), then each
        ``call`` on this thread. False on stop."""
        get = (lambda: self._cmds.get(timeout=IDLE_POLL_S)) if block else self._cmds.get_nowait
        while True:
            intake = take_intake(get, self._cmds.get_nowait, (queue.Empty,))
            apply_intake(self.engine.scheduler, intake.adds, intake.aborts, on_abort=self._aborted)
            cmd = intake.command
            if cmd is None:
                if block and not (intake.adds or intake.aborts):
                    self.engine.check_alive()  # idle: a rank that died is found now, not at the next request
                return True
            if isinstance(cmd, Stop):
                return False
            if cmd.future.set_running_or_notify_cancel():
                try:
                    cmd.future.set_result(cmd.fn())
                except BaseException as e:
                    cmd.future.set_exception(e)
            get = self._cmds.get_nowait  # and whatever else is queued

    def _aborted(self, req: Request) -> None:
        logger.info("abort rid=%d output=%d", req.rid, len(req.output_ids))
        self._finished(req)

    def _finished(self, req: Request) -> None:
        with self._lock:
            self.num_inflight -= 1
        if self.on_finish is not None:
            try:
                self.on_finish(GenerateResult.from_request(req))
            except Exception:
                logger.exception("on_finish failed for rid=%d", req.rid)


def _describe(error: BaseException) -> str:
    """One line naming an engine failure (HicacheError messages are already sentences)."""
    return str(error) if isinstance(error, HicacheError) else f"{type(error).__name__}: {error}"
