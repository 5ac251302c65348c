"""Deadlines and a circuit breaker around a storage backend.

Invariant: no caller of a :class:`GuardedBackend` waits on the backend longer than
``timeout_s`` per call, and a backend that keeps failing is not called at all (only re-probed
now and then). Every failure surfaces as :class:`StorageError`, which the storage controller
turns into "recompute": a short or empty hit, a failed backup (DESIGN invariant 5).

How a call runs: on one of a few daemon worker threads; the caller waits at most
``timeout_s`` and then raises :class:`StorageTimeout`, abandoning the call. Its late result
is discarded: a late write is harmless (objects are atomic and checksummed), a late read
never reaches a host page. A call still queued when abandoned never runs. At most
``max_workers`` calls run at once, so hung calls cannot pile up without bound; the breaker
keeps new ones from being started at all.

Breaker: after ``failures`` consecutive failed or timed-out calls it OPENS for ``cooldown_s``
seconds: calls fail at once with :class:`BreakerOpen` without touching the backend. Then ONE
probe call goes through (HALF_OPEN): success closes the breaker, failure opens it again for
twice the previous cooldown (at most ``max_cooldown_s``). Each transition is one log line.
Defaults: 3 failures, 5 s cooldown doubling up to 60 s; they are plain attributes, so a
deployment (or a test) may tune them on a live guard.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable

from .base import BackendStats, StorageBackend, StorageError

logger = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class StorageTimeout(StorageError):
    """A backend call passed its deadline and was abandoned."""


class BreakerOpen(StorageError):
    """The breaker is open: the call was refused without touching the backend."""


def failure_reason(e: BaseException) -> str:
    """The failure reason the controller reports for an exception of a storage call."""
    return {BreakerOpen: "breaker_open", StorageTimeout: "timeout"}.get(type(e), "backend_error")


@dataclass
class BreakerState:
    """The breaker and its counters (monotonic unless noted)."""

    state: str = CLOSED  # current
    consecutive_failures: int = 0  # current
    cooldown_s: float = 0.0  # current open period (0 while closed)
    open_until: float = 0.0  # clock() time at which a probe may go (while open)
    calls: int = 0  # calls that reached the backend
    opens: int = 0
    transitions: int = 0
    timeouts: int = 0
    short_circuited: int = 0
    call_failures: dict[str, int] = field(default_factory=dict)  # kind ("timeout", "error") -> count
    call_failures_by_op: dict[str, int] = field(default_factory=dict)  # "batch_set", ... -> count


class GuardedBackend(StorageBackend):
    """``inner`` behind per-call deadlines and a circuit breaker (see the module docstring).

    ``inner`` may be replaced on a live guard (tests swap in a fault-injecting wrapper);
    ``clock`` (monotonic seconds) times the cooldowns and may be replaced by a fake one.
    """

    def __init__(self, inner: StorageBackend, timeout_s: float | None = 10.0, failures: int = 3,
                 cooldown_s: float = 5.0, max_cooldown_s: float = 60.0, max_workers: int = 4,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``timeout_s`` None: no deadline, calls run on the caller's thread (only for a backend
        that cannot hang: the ``memory`` one in the simulator)."""
        if (timeout_s is not None and timeout_s <= 0) or failures < 1 or cooldown_s <= 0 or max_workers < 1:
            raise ValueError("timeout_s and cooldown_s must be > 0, failures and max_workers >= 1")
        self.inner = inner
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.failures = int(failures)
        self.cooldown_s = float(cooldown_s)
        self.max_cooldown_s = float(max(max_cooldown_s, cooldown_s))
        self.max_workers = int(max_workers)
        self.clock = clock
        self.breaker = BreakerState()
        self._lock = threading.Lock()
        # one backend call each (a cancelled future: the caller stopped waiting, never start it), None: exit
        self._tasks: queue.Queue[tuple[Callable[[], Any], Future] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # workers waiting for a task
        self._queued = 0  # tasks not yet taken by a worker
        self._closed = False

    # ---- StorageBackend ------------------------------------------------------------------
    def exists_prefix(self, keys: list[str]) -> int:
        return self._guarded("exists_prefix", lambda b: b.exists_prefix(keys), len(keys))

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        return self._guarded("batch_get", lambda b: b.batch_get(keys), len(keys))

    def batch_set(self, keys: list[str], values: list[bytes]) -> int:
        if len(keys) != len(values):  # the one check of the engine's writes: backends zip them
            raise ValueError("keys and values differ in length")
        return self._guarded("batch_set", lambda b: b.batch_set(keys, values), len(keys))

    def delete(self, keys: list[str]) -> None:
        self._guarded("delete", lambda b: b.delete(keys), len(keys))

    def retain(self, keys: list[str], until: float, now: float) -> None:
        self._guarded("retain", lambda b: b.retain(keys, until, now), len(keys))

    def clear(self) -> None:
        self._guarded("clear", lambda b: b.clear(), 0)

    def stats(self) -> BackendStats:
        # Backends keep these counters locally (no I/O), so they stay readable while down.
        return self.inner.stats()

    def close(self) -> None:
        """Close the backend (within the deadline, outside the breaker), then let the idle
        workers exit; a worker stuck in a hung call exits when that call returns."""
        if self._closed:
            return
        inner = self.inner
        try:
            self._run(inner.close, "close")
        except StorageError as e:
            logger.warning("storage %s: close failed: %s", inner.name, e)
        with self._lock:
            self._closed = True
            n = len(self._threads)
        for _ in range(n):
            self._tasks.put(None)

    def snapshot(self) -> dict[str, Any]:
        """The breaker's state and counters, for ``Engine.stats()`` (stable keys)."""
        with self._lock:
            out = dataclasses.asdict(self.breaker)  # its dicts copied
        del out["open_until"]  # a clock() time: meaningless outside this process
        return out

    # ---- breaker -------------------------------------------------------------------------
    def _guarded(self, op: str, fn: Callable[[StorageBackend], Any], nkeys: int) -> Any:
        probe = self._admit(op, nkeys)
        inner = self.inner
        try:
            out = self._run(lambda: fn(inner), f"{op} of {nkeys} keys")
        except BaseException as e:
            self._record(op, probe, e)
            raise
        self._record(op, probe, None)
        return out

    def _admit(self, op: str, nkeys: int) -> bool:
        """Whether this call may go to the backend (True: it is the half-open probe);
        raises BreakerOpen when it may not."""
        with self._lock:
            b = self.breaker
            probe = b.state == OPEN and self.clock() >= b.open_until
            if probe:
                self._transition(HALF_OPEN, f"probing with {op}")  # until its result: all else refused
            if probe or b.state == CLOSED:
                b.calls += 1
                return probe
            b.short_circuited += 1
            state, wait = b.state, max(b.open_until - self.clock(), 0.0)
        raise BreakerOpen(f"storage {self.inner.name} skipped ({op} of {nkeys} keys): breaker {state}, "
                          f"next probe in {wait:.1f}s")

    def _record(self, op: str, probe: bool, error: BaseException | None) -> None:
        """Count the outcome of a call that reached the backend and move the breaker."""
        with self._lock:
            b = self.breaker
            if error is None:
                if probe:
                    b.cooldown_s = 0.0
                    self._transition(CLOSED, f"probe {op} succeeded")
                b.consecutive_failures = 0
                return
            kind = "timeout" if isinstance(error, StorageTimeout) else "error"
            b.timeouts += kind == "timeout"
            b.call_failures[kind] = b.call_failures.get(kind, 0) + 1
            b.call_failures_by_op[op] = b.call_failures_by_op.get(op, 0) + 1
            b.consecutive_failures += 1
            if probe:  # the backend is still bad: wait longer before the next probe
                b.cooldown_s = min(max(b.cooldown_s, self.cooldown_s) * 2, self.max_cooldown_s)
            elif b.state == CLOSED and b.consecutive_failures >= self.failures:
                b.cooldown_s = self.cooldown_s
            else:  # a call started before the breaker opened and failing now changes nothing else
                return
            b.open_until = self.clock() + b.cooldown_s  # open
            b.opens += 1
            self._transition(OPEN, f"{op} {kind}: {error}")

    def _transition(self, state: str, why: str) -> None:
        """One log line per change, for operators. Caller holds the lock."""
        b = self.breaker
        old, b.state = b.state, state
        b.transitions += 1
        level = logging.WARNING if state == OPEN else logging.INFO
        logger.log(level, "storage breaker %s: %s -> %s (consecutive failures=%d, cooldown=%.1fs): %s",
                   self.inner.name, old, state, b.consecutive_failures, b.cooldown_s, why)

    # ---- deadline ------------------------------------------------------------------------
    def _run(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` on a worker thread; the caller waits at most ``timeout_s``."""
        if self.timeout_s is None:
            return fn()
        future: Future = Future()
        self._submit((fn, future))
        if not wait([future], self.timeout_s).done:
            future.cancel()  # still queued: it never runs; running: its late result is dropped
            if future.cancelled() or not future.done():  # (it may have finished between the wait and the cancel)
                raise StorageTimeout(f"storage {self.inner.name} {what} timed out after {self.timeout_s:g}s")
        return future.result()  # the call's own exception is raised here

    def _submit(self, call: tuple[Callable[[], Any], Future]) -> None:
        with self._lock:
            if self._closed:
                raise StorageError(f"storage {self.inner.name} is closed")
            self._queued += 1
            # A worker for every queued call while under the cap: a hung call must not make the
            # next one (a read behind a stuck write) wait for the same thread.
            if self._queued > self._idle and len(self._threads) < self.max_workers:
                t = threading.Thread(target=self._work, name=f"hicache-storage-call-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                self._idle += 1
                t.start()
        self._tasks.put(call)

    def _work(self) -> None:
        while (call := self._tasks.get()) is not None:
            with self._lock:
                self._queued -= 1
                self._idle -= 1
            fn, future = call
            if future.set_running_or_notify_cancel():  # False: abandoned while queued
                try:
                    future.set_result(fn())
                except BaseException as e:  # handed to the caller, which re-raises it
                    future.set_exception(e)
            with self._lock:
                self._idle += 1
