"""Rank consensus checker, monitoring side: compares the ranks' recorded call streams.

Invariant checked: all ranks run the same SPMD scheduler on the same request stream, so the
n-th checked call on every rank is the same function, with the same selected (logical)
parameters, returning the same selected result. PP stages reach a call at different times;
only the logical order matters, never the wall-clock time.

The recording side (the ``consensus_check`` decorator, ``Entry``, ``install_recorder``,
``make_queue_sink``) lives in :mod:`hicache.consensus_record`, below every other module, so the
cache and the engine never import this package. Here: the comparison (``ConsensusComparator``)
and the parent's background thread (``ConsensusMonitor``), whose ``queue`` every rank process
passes to ``install_recorder(label, make_queue_sink(queue))``.

Reading a report (``Found rank divergence at call #i in f: B differs from A in the ...``):

- *call order*: the ranks called different functions at the same point, i.e. they scheduled
  differently or consumed events (acks, completions) differently.
- *parameters*: same function, different inputs: state already diverged earlier, in a place
  no checked function observed; add checks upstream to narrow it down.
- *result*: same function and inputs, different outputs: the checked operation itself is not
  deterministic across ranks.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from ..consensus_record import Entry, Sink, make_queue_sink
from .channels import WRITERS_GONE

logger = logging.getLogger(__name__)

DivergenceKind = Literal["call order", "parameters", "result"]

_REPR_LIMIT = 200
_STOP_POLL_S = 0.1  # how often an idle monitor looks at its stop event
VOTE_GRACE_S = 2.0  # how long a mismatch waits for the remaining ranks before it is reported as seen


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


def _same(a: Any, b: Any) -> bool:
    # Selectors should return plain data; an array-like whose == is elementwise falls back to repr.
    try:
        return bool(a == b)
    except Exception:
        return repr(a) == repr(b)


@dataclass
class Divergence:
    """First unequal entry: ``got`` (from ``divergent_rank``) vs ``expected`` (``reference_rank``)."""

    index: int
    function: str
    kind: DivergenceKind
    reference_rank: str
    divergent_rank: str
    expected: Entry
    got: Entry

    def __str__(self) -> str:
        field = {"call order": "function", "parameters": "params", "result": "result"}[self.kind]
        got, expected = getattr(self.got, field), getattr(self.expected, field)
        return (
            f"Found rank divergence at call #{self.index} in {self.function}: "
            f"{self.divergent_rank} differs from {self.reference_rank} in the {self.kind}: "
            f"{_short(got)} vs {_short(expected)}"
        )


class ConsensusComparator:
    """Compares per-rank entry streams by index; keeps only indices not yet seen by every rank.

    Each rank's entries must arrive in index order, but ranks may lag each other freely; so
    indices complete (every rank reported) in index order, and the first index that completes
    with unequal entries is the first divergence. Only that one is reported. The rank outside
    the strict majority of equal entries is the divergent one (the first arrival may be the odd
    one); without a majority, the mismatch as first seen (the first entry that differs from the
    first arrival, which is the reference). A rank that never reports an index (it hung) leaves
    a mismatch there open: :meth:`decide` then reports it as first seen.
    """

    def __init__(self, labels: Sequence[str]) -> None:
        if not labels:
            raise ValueError("a consensus comparator needs at least one rank label")
        self.labels = list(labels)
        self._known = set(self.labels)
        self._pending: dict[int, dict[str, Entry]] = {}  # index -> each rank's entry there, in arrival order
        self.compared = 0
        self.diverged: Divergence | None = None
        self._suspect: int | None = None  # the earliest index where two entries differ

    @property
    def undecided(self) -> bool:
        """A mismatch waits for the remaining ranks' entries to name the odd one out."""
        return self._suspect is not None and self.diverged is None

    def add(self, label: str, entry: Entry) -> Divergence | None:
        """Feed one entry; returns the divergence it reveals, if it is the first one."""
        if label not in self._known:
            raise ValueError(f"unknown rank label {label!r} (expected one of {self.labels})")
        if self.diverged is not None or (self._suspect is not None and entry.index > self._suspect):
            return None  # one report is enough (and the earliest suspect is reported first): keep nothing more
        arrivals = self._pending.setdefault(entry.index, {})
        if label in arrivals:
            raise ValueError(f"rank {label!r} reported call #{entry.index} twice")
        arrivals[label] = entry
        if self._difference(next(iter(arrivals.values())), entry) is not None:
            self._suspect = entry.index if self._suspect is None else min(self._suspect, entry.index)
        if len(arrivals) < len(self._known):
            return None
        if entry.index == self._suspect:
            return self._vote(entry.index, arrivals)
        del self._pending[entry.index]
        self.compared += 1
        return None

    def decide(self) -> Divergence | None:
        """Report an open suspicion as first seen (a rank never reported the index)."""
        if not self.undecided:
            return None
        assert self._suspect is not None
        return self._vote(self._suspect, self._pending[self._suspect], first_seen=True)

    def _vote(self, index: int, arrivals: dict[str, Entry], first_seen: bool = False) -> Divergence:
        """The largest group of equal entries at ``index`` is the reference when every rank
        reported it and it is a strict majority, else (or ``first_seen``) the first arrival's: the
        mismatch as first seen. The first rank outside the reference group is the divergent one."""
        groups = [[b for b in arrivals if self._difference(arrivals[a], arrivals[b]) is None] for a in arrivals]
        majority = max(groups, key=len)
        if first_seen or 2 * len(majority) <= len(arrivals):
            majority = groups[0]
        odd = next(label for label in arrivals if label not in majority)
        ref, got = arrivals[majority[0]], arrivals[odd]
        kind = self._difference(ref, got)
        assert kind is not None
        self.diverged = Divergence(index, ref.function, kind, majority[0], odd, ref, got)
        self._pending.clear()
        self._suspect = None
        return self.diverged

    @staticmethod
    def _difference(ref: Entry, got: Entry) -> DivergenceKind | None:
        if ref.function != got.function:
            return "call order"
        if not _same(ref.params, got.params):
            return "parameters"
        if not _same(ref.result, got.result):
            return "result"
        return None


class ConsensusMonitor:
    """Reads ``(label, entry)`` items from ``queue`` in a daemon thread and compares ranks.

    On the first divergence: logs it once at error level and calls ``on_divergence`` once (from
    the monitor thread). Call ``stop()`` after the ranks have finished putting entries.

    Only the ranks write to the queue. A rank killed in the middle of a put leaves the queue's
    write lock held for good, so a sentinel put from this side could never arrive and its feeder
    thread would block the process's exit; ``stop()`` signals through an event instead.
    """

    def __init__(self, labels: Sequence[str], on_divergence: Callable[[Divergence], None], mp_context: Any = None,
                 on_entry: Callable[[str, Entry], None] | None = None, vote_grace_s: float = VOTE_GRACE_S) -> None:
        """``on_entry(label, entry)`` (optional) sees every entry as it is compared, e.g. to
        keep a trace; it runs on the monitor thread. With three or more ranks a mismatch waits
        up to ``vote_grace_s`` for every rank's entry, to name the odd one out by majority."""
        ctx = mp_context if mp_context is not None else multiprocessing.get_context("spawn")
        self.queue = ctx.Queue()
        self.sink: Sink = make_queue_sink(self.queue)
        self._comparator = ConsensusComparator(labels)
        self._on_divergence = on_divergence
        self._on_entry = on_entry
        self.vote_grace_s = vote_grace_s
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._settle = threading.Event()

    @property
    def divergence(self) -> Divergence | None:
        return self._comparator.diverged

    @property
    def compared(self) -> int:
        return self._comparator.compared

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("consensus monitor already started")
        self._thread = threading.Thread(target=self._run, name="rank-consensus-monitor", daemon=True)
        self._thread.start()

    def settle(self) -> None:
        """Stop waiting for votes: a rank died, so an open one would never complete. A mismatch
        seen so far is then reported (within one poll, ~0.1 s) as first seen."""
        self._settle.set()

    def stop(self, timeout: float | None = None) -> None:
        """Process everything queued so far, then end the thread."""
        if self._thread is None:
            return
        self._stop.set()
        if self._thread is not threading.current_thread():  # (stopped from its own callback)
            self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        suspect_since: float | None = None  # when the comparator began waiting to vote
        while True:
            done = False
            try:
                item = self.queue.get(timeout=_STOP_POLL_S)
            except queue.Empty:
                item, done = None, self._stop.is_set()
            except WRITERS_GONE:  # every rank has exited (the owner gave up its write end)
                item, done = None, True
            if item is not None:
                self._compare(*item)
            if self._comparator.undecided:
                # An open vote waits vote_grace_s for the remaining ranks: one may have hung.
                now = time.monotonic()
                suspect_since = suspect_since or now
                if done or self._settle.is_set() or now - suspect_since > self.vote_grace_s:
                    self._report(self._comparator.decide())
            if done:
                return

    def _compare(self, label: str, entry: Entry) -> None:
        if self._on_entry is not None:
            self._on_entry(label, entry)
        try:
            self._report(self._comparator.add(label, entry))
        except ValueError as exc:
            # A malformed stream is a bug in the runtime, not a rank divergence; keep going.
            logger.error("rank consensus checker: %s", exc)

    def _report(self, div: Divergence | None) -> None:
        if div is None:
            return
        logger.error(str(div))
        try:
            self._on_divergence(div)
        except Exception:
            logger.exception("rank consensus checker: on_divergence callback failed")
