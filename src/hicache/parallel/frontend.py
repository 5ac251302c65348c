"""The user's process with ``--tp-size`` / ``--pp-size`` > 1: starts the rank processes, feeds
the leader (PP0/TP0), and turns its updates back into the Engine's Request objects.

``RankGroup.scheduler`` stands in for the single-rank Scheduler (``add``, ``step``, ``abort``,
``has_work``, ``running``, ``waiting``), so ``Engine.generate``, ``EngineLoop`` and the server run
unchanged. A rank that dies or reports an error, and a divergence found by the rank consensus
checker, stop every rank and surface as one :class:`HicacheError` naming the rank.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import queue
import socket
import time
from collections import deque
from typing import Any

from ..config import ConfigError, EngineConfig
from ..engine.request import Request, Status
from ..errors import HicacheError
from . import consensus
from .groups import rank_label
from .messages import RequestSpec, RequestUpdate
from .worker import rank_main

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
POLL_S = 0.05
TRACE_ENTRIES = 100_000  # the checker's recent calls kept per rank (for reports and tests)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankGroup:
    def __init__(self, cfg: EngineConfig) -> None:
        self.world = cfg.tp_size * cfg.pp_size
        self.labels = [rank_label(r, cfg.tp_size) for r in range(self.world)]
        ctx = multiprocessing.get_context("spawn")
        self.inbox, self.outbox, self.status = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.failure: str | None = None
        self._stopping = False
        self._calls = itertools.count()
        self._replies: dict[int, Any] = {}
        self._updates: deque[list[RequestUpdate]] = deque()
        # Checker: the ranks' call streams, compared here as they arrive (HICACHE_RANK_CONSENSUS_CHECKER=1).
        self.monitor: consensus.ConsensusMonitor | None = None
        self.trace: dict[str, deque[consensus.Entry]] = {label: deque(maxlen=TRACE_ENTRIES) for label in self.labels}
        if consensus.enabled():
            self.monitor = consensus.ConsensusMonitor(self.labels, self._on_divergence, ctx, on_entry=self._keep)
            self.monitor.start()
        init = f"tcp://127.0.0.1:{_free_port()}"
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        level = logging.getLogger().getEffectiveLevel()
        self.procs = [
            ctx.Process(
                target=rank_main, name=f"hicache-rank-{self.labels[r]}", daemon=True,
                args=(r, fields, init, self.status, self.inbox if r == 0 else None, self.outbox if r == 0 else None,
                      self.monitor.queue if self.monitor else None, level),
            )
            for r in range(self.world)
        ]
        for p in self.procs:
            p.start()
        logger.info("started %d ranks (tp=%d pp=%d): pids %s", self.world, cfg.tp_size, cfg.pp_size,
                    [p.pid for p in self.procs])
        self.capacity_pages = self._wait_ready()
        self.scheduler = RemoteScheduler(self)

    # ---- lifecycle --------------------------------------------------------------------------
    def _wait_ready(self) -> int:
        ready: dict[int, int] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < self.world:
            try:
                item = self.status.get(timeout=POLL_S * 4)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    self._fail(f"ranks did not start within {STARTUP_TIMEOUT_S:.0f} s")
                continue
            if item[0] == "error":
                # A bad option shows the same on every rank: report it like a single-rank ConfigError.
                self._stop_all()
                raise ConfigError(item[2]) if "ConfigError" in item[3] else HicacheError(
                    f"rank {self.labels[item[1]]} failed to start: {item[2]}")
            ready[item[1]] = item[2]
        if len(set(ready.values())) != 1:
            self._fail(f"ranks disagree on the device pool size: {ready}")
        return next(iter(ready.values()))

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self.failure is None:
            self.inbox.put(("call", next(self._calls), "stop"))
            for p in self.procs:
                p.join(timeout=30)
        self._stop_all()
        if self.monitor is not None:
            self.monitor.stop(timeout=5)

    def _stop_all(self) -> None:
        self._stopping = True
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    # ---- failure ----------------------------------------------------------------------------
    def _on_divergence(self, div: consensus.Divergence) -> None:
        self.failure = self.failure or str(div)

    def _keep(self, label: str, entry: consensus.Entry) -> None:
        self.trace[label].append(entry)

    def _check_alive(self) -> None:
        """Raise (after stopping every rank) if a rank died, reported an error, or the checker
        found a divergence."""
        if self.failure is None:
            dead = [(r, p) for r, p in enumerate(self.procs) if p.exitcode is not None and not self._stopping]
            if dead or not self.status.empty():
                self.failure = self._explain(dead)
        if self.failure is not None:
            self._fail(self.failure)

    def _explain(self, dead: list) -> str:
        """The root cause: a divergence if the checker saw one, else a rank that died without
        reporting (killed), else the first error a rank reported (its peers then fail on the
        broken connection and report that too)."""
        time.sleep(0.5)  # let the monitor and the other ranks' reports catch up
        if self.failure is not None:
            return self.failure
        reported: dict[int, str] = {}
        while True:
            try:
                item = self.status.get_nowait()
            except queue.Empty:
                break
            if item[0] == "error":
                reported.setdefault(item[1], item[2])
                logger.error("rank %s traceback:\n%s", self.labels[item[1]], item[3])
        silent = [(r, p) for r, p in enumerate(self.procs) if p.exitcode is not None and r not in reported]
        if silent:
            r, p = silent[0]
            how = f"was killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exited with code {p.exitcode}"
            return f"rank {self.labels[r]} (pid {p.pid}) {how}"
        if reported:
            r = min(reported)
            return f"rank {self.labels[r]} failed: {reported[r]}"
        r, p = dead[0]
        return f"rank {self.labels[r]} (pid {p.pid}) exited with code {p.exitcode}"

    def _fail(self, why: str) -> None:
        if not self._stopping:
            logger.error("stopping all ranks: %s", why)
            self._stop_all()
        raise HicacheError(f"the engine stopped: {why}")

    # ---- talking to the leader -----------------------------------------------------------
    def send(self, item: tuple) -> None:
        if self.failure is not None or self._stopping:
            return
        self.inbox.put(item)

    def _pump(self, timeout: float) -> None:
        """Read what the leader sent (waiting up to ``timeout`` for the first item)."""
        try:
            item = self.outbox.get(timeout=timeout)
        except queue.Empty:
            self._check_alive()
            return
        while True:
            if item[0] == "updates":
                self._updates.append(item[1])
            else:  # ("reply", call_id, value)
                self._replies[item[1]] = item[2]
            try:
                item = self.outbox.get_nowait()
            except queue.Empty:
                return

    def updates(self, timeout: float) -> list[RequestUpdate]:
        if not self._updates:
            self._pump(timeout)
        out = [u for batch in self._updates for u in batch]
        self._updates.clear()
        if self.failure is not None:
            self._fail(self.failure)
        return out

    def call(self, command: str) -> Any:
        """Run ``command`` ("flush", "stats") on every rank at one step; the leader's answer."""
        call_id = next(self._calls)
        self.send(("call", call_id, command))
        while call_id not in self._replies:
            if self._stopping:
                self._check_alive()
                raise HicacheError("the engine is stopped.")
            self._pump(POLL_S)
        return self._replies.pop(call_id)


class RemoteScheduler:
    """The frontend's view of the ranks' scheduler: the same calls the Engine and EngineLoop
    make on a local one. Requests stay this process's objects; the leader's updates fill them."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.requests: dict[int, Request] = {}

    @property
    def waiting(self) -> list[Request]:
        return [r for r in self.requests.values() if r.cached is None]

    @property
    def running(self) -> list[Request]:
        return [r for r in self.requests.values() if r.cached is not None]

    def has_work(self) -> bool:
        return bool(self.requests)

    def add(self, req: Request) -> None:
        self.requests[req.rid] = req
        self.group.send(("add", RequestSpec.of(req)))

    def abort(self, rid: int) -> bool:
        """Finishes the request here at once; the ranks drop it at their next step."""
        req = self.requests.pop(rid, None)
        if req is None:
            return False
        req.status, req.finish_reason, req.finish_time = Status.FINISHED, "abort", time.perf_counter()
        self.group.send(("abort", rid))
        if req.on_update is not None:
            req.on_update(req)
        return True

    def step(self) -> list[Request]:
        finished = []
        for upd in self.group.updates(POLL_S):
            req = self.requests.get(upd.rid)
            if req is None:  # aborted here already
                continue
            upd.apply(req)
            if upd.finished:
                del self.requests[upd.rid]
                finished.append(req)
            if req.on_update is not None:
                req.on_update(req)
        return finished
