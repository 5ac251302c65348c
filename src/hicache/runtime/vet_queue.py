"""The grammar checker's queue: which waiting grammar is checked next, fairly between clients.

A *job* is one distinct grammar waiting for (or in) the checker; every caller that asked for it
waits on it, counted per *client* (any hashable key: the server passes the peer's address, so
every connection from one host is one client; ``None`` for in-process callers). Jobs are taken in
start-time fair order (SFQ, Goyal et al. 1996): a client's new job starts at
``max(now, the client's last finish)`` and lasts one unit, the smallest start runs next (ties: the
older job), and ``now`` is the start of the job taken last. So a client that queued 64 slow
grammars holds back another client's first grammar by at most the job already running, and
clients with jobs waiting take turns.

Invariants (checked by :meth:`FairQueue.check`):

- a queued job has at least one waiter and is in :attr:`FairQueue.jobs` once; a job leaves the
  queue when it is taken or when its last waiter leaves (a cancelled caller: its client went);
- at most ``capacity`` jobs wait. A new job of a full queue displaces the newest job of the
  client with the most jobs waiting if that client would still hold more than the newcomer,
  else it is refused: one client cannot fill the queue against another.

Not thread-safe: :class:`hicache.runtime.grammar_vet.GrammarVetter` holds its lock around every call.
"""

from __future__ import annotations

import itertools
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Hashable, Optional

from .sampling import GrammarSpec


@dataclass(eq=False)
class VetJob:
    """One distinct grammar to check. ``verdict``: what every waiter's own future follows (the
    vetted spec, or the error for the request); ``waiters``: callers still waiting, per client;
    ``start``: its turn (smaller first), ``seq``: arrival (ties); ``running``: taken by the
    checker; ``abandoned``: its last waiter left while it ran (the checker stops it)."""

    spec: GrammarSpec
    start: int
    seq: int
    verdict: Future = field(default_factory=Future)
    waiters: Counter = field(default_factory=Counter)
    running: bool = False
    abandoned: bool = False


class QueueFull(Exception):
    """No room for another job, and this client already holds as many waiting jobs as any other."""


class FairQueue:
    """Jobs waiting for the checker (see the module docstring). Units: a job is one unit of turn,
    whatever its grammar costs (the checker's CPU-time limit bounds each)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.jobs: list[VetJob] = []  # queued (not running), in no particular order
        self._finish: dict[Hashable, int] = {}  # a client's last finish tag, while it is after `now`
        self._now = 0  # the start tag of the job taken last (virtual time)
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.jobs)

    def add(self, spec: GrammarSpec, client: Hashable) -> tuple[VetJob, Optional[VetJob]]:
        """A new job for ``spec``, waited on by one caller of ``client``, and the job it displaced
        from a full queue (None if none; its waiters must be told). QueueFull when it may not wait."""
        displaced = self._make_room(client) if len(self.jobs) >= self.capacity else None
        job = VetJob(spec, self._start(client), next(self._seq))
        job.waiters[client] += 1
        self._finish[client] = job.start + 1
        self.jobs.append(job)
        return job, displaced

    def join(self, job: VetJob, client: Hashable) -> None:
        """One more caller of ``client`` waits for ``job``; a queued job moves up to this client's
        turn if that comes sooner (the client is charged the turn)."""
        job.waiters[client] += 1
        if not job.running and job.waiters[client] == 1:
            start = self._start(client)
            if start < job.start:
                job.start = start
                self._finish[client] = start + 1

    def leave(self, job: VetJob, client: Hashable) -> bool:
        """A caller of ``client`` stopped waiting for ``job``; True when nobody waits any more
        (a queued job is then out of the queue)."""
        job.waiters -= Counter([client])  # (a Counter's difference keeps the positive counts only)
        if job.waiters:
            return False
        if not job.running:
            self.jobs.remove(job)
        return True

    def take(self) -> Optional[VetJob]:
        """The job to check next (marked running), or None if none waits."""
        if not self.jobs:
            return None
        job = min(self.jobs, key=lambda j: (j.start, j.seq))
        self.jobs.remove(job)
        job.running = True
        self._now = max(self._now, job.start)
        self._finish = {c: f for c, f in self._finish.items() if f > self._now}
        return job

    def check(self) -> None:
        """Raises AssertionError if an invariant of the module docstring does not hold."""
        assert len(self.jobs) <= self.capacity, (len(self.jobs), self.capacity)
        assert len({id(j) for j in self.jobs}) == len(self.jobs)
        for job in self.jobs:
            assert job.waiters and all(n > 0 for n in job.waiters.values()) and not job.running, job

    def _start(self, client: Hashable) -> int:
        return max(self._now, self._finish.get(client, self._now))

    def _make_room(self, client: Hashable) -> VetJob:
        """The job that gives way to ``client``'s new one: the newest job waited on only by the
        client with the most waiting (if it would still hold more than ``client``); else QueueFull."""
        counts = Counter(c for job in self.jobs for c in job.waiters)
        heaviest, most = max(counts.items(), key=lambda item: item[1])
        if most < counts[client] + 2:
            raise QueueFull
        alone = [job for job in self.jobs if set(job.waiters) == {heaviest}]
        if not alone:
            raise QueueFull
        job = max(alone, key=lambda j: (j.start, j.seq))
        self.jobs.remove(job)
        return job
