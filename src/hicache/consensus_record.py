"""Rank consensus checker, recording side: what each rank process writes down.

Invariant checked (by the monitor in ``hicache.parallel.consensus``): all ranks run the same
SPMD scheduler on the same request stream, so the n-th checked call on every rank is the same
function, with the same selected (logical) parameters, returning the same selected result. PP
stages reach a call at different times; only the logical order matters, never wall-clock time.

This module sits at the bottom of the package: it imports nothing from hicache, so the cache
and the engine can decorate their decisions without depending on ``hicache.parallel``.

Use:

- Turn it on with ``HICACHE_RANK_CONSENSUS_CHECKER=1`` in the environment *before* the checked
  modules are imported: ``consensus_check`` decides at decoration time. Off, it returns the
  function itself, so the checker costs nothing.
- Decorate scheduler and cache functions::

      @consensus_check("cache.admit", args=lambda self, req: (req.rid, len(req.tokens)),
                       result=lambda r: (r.rid, r.prefix_len))
      def admit(self, req): ...

  Selectors get exactly the call's arguments (``self`` included) and the return value, and
  return plain picklable data. Choose logical values (token counts, rids, prefix lengths),
  never physical page ids: those legitimately differ between ranks with different pool sizes.
- Each rank process calls ``install_recorder(label, make_queue_sink(monitor_queue))``.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

ENV_VAR = "HICACHE_RANK_CONSENSUS_CHECKER"

F = TypeVar("F", bound=Callable[..., Any])
Sink = Callable[[str, "Entry"], None]


def enabled() -> bool:
    """Whether the checker is on in this process (read afresh on every call)."""
    return os.environ.get(ENV_VAR) == "1"


@dataclass
class Entry:
    """One recorded call. ``index`` counts checked calls on this rank: 0, 1, 2, ... without gaps."""

    index: int
    function: str
    params: Any
    result: Any


_record: Callable[[str, Any, Any], None] | None = None  # (function, params, result) of this process's rank


def install_recorder(label: str, sink: Sink) -> None:
    """Record this process's checked calls as rank ``label``; each entry goes to ``sink`` at once.

    Replaces any previous recorder; indices restart at 0.
    """
    global _record
    indices, lock = itertools.count(), threading.Lock()

    def record(function: str, params: Any, result: Any) -> None:
        # Index assignment and hand-off happen under one lock, so the sink sees indices in order.
        with lock:
            sink(label, Entry(next(indices), function, params, result))

    _record = record


def consensus_check(name: str | Callable[..., Any] | None = None, *, args: Callable[..., Any] | None = None,
                    result: Callable[[Any], Any] | None = None) -> Any:
    """Decorator recording calls of the wrapped function for the rank consensus checker.

    Off at decoration time: returns the function unchanged. On: records
    ``(name or __qualname__, args(*a, **kw), result(ret))`` after each call that returns, when a
    recorder is installed. A call that raises records nothing. Also usable bare:
    ``@consensus_check``.
    """
    if callable(name):  # bare @consensus_check
        return consensus_check()(name)

    def decorate(fn: F) -> F:
        if not enabled():
            return fn
        label = name or fn.__qualname__

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            record = _record
            if record is None:
                return fn(*a, **kw)
            # Parameters are selected before the call: the function may mutate its inputs
            # (or self), and a mismatch should show the state the call started from.
            params = args(*a, **kw) if args is not None else None
            ret = fn(*a, **kw)
            record(label, params, result(ret) if result is not None else None)
            return ret

        return wrapper  # type: ignore[return-value]

    return decorate


def make_queue_sink(q: Any) -> Sink:
    """Sink for ``install_recorder`` in a rank process, given the monitor's queue (any object
    with ``put``): it puts ``(label, entry)`` there at once (no batching: the queue's feeder thread
    still flushes it if this rank then hangs in a collective, so the entry that explains the hang
    reaches the monitor)."""
    return lambda label, entry: q.put((label, entry))
