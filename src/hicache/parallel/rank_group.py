"""The user's process with ``--tp-size`` / ``--pp-size`` > 1: starts the rank processes, feeds
the leader (PP0/TP0), and turns its updates back into the Engine's Request objects.

``RankGroup.scheduler`` stands in for the single-rank Scheduler (``add``, ``step``, ``abort``,
``has_work``, ``running``, ``waiting``), so ``Engine.generate``, ``EngineLoop`` and the server run
unchanged. A rank that dies or reports an error, and a divergence found by the rank consensus
checker, stop every rank and surface as one :class:`HicacheError` naming the rank.

With ``--nnodes N`` this process runs on node 0 and starts only node 0's ranks (rank 0, the
leader, among them: the frontend's queues stay on one machine); the other nodes' ranks are
started by ``hicache node`` (``parallel/node.py``) and reach these only through the
collectives. So the start-up handshake, the watchdog and the consensus checker see this node's
ranks only; a failure elsewhere shows here as a local rank's broken connection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import queue
import sys
import threading
import time
import types
from collections import deque
from typing import Any, Callable, Iterator

from ..config import ConfigError, EngineConfig
from ..consensus_record import Entry
from ..consensus_record import enabled as checker_enabled
from ..disagg.bootstrap import endpoint
from ..errors import EngineDeadError, HicacheError
from ..ports import free_port, split_host_port
from ..runtime.request import Request, Status
from ..runtime.step import Abort, Add
from .channels import WRITERS_GONE, exit_text, kill_all, poll, queued_now, reader_only
from .consensus import ConsensusMonitor
from .groups import rank_label
from .messages import (Flush, RankCall, RankError, ReleaseRetention, RequestSpec, RequestUpdate, Shutdown, Stats,
                       Updates)
from .worker import rank_context, start_rank

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
POLL_S = 0.05  # how long a step (or a wait for a call's reply) waits for the leader's next message
TRACE_ENTRIES = 100_000  # the checker's recent calls kept per rank (for reports and tests)


def spawn_ranks(ctx: Any, cfg: EngineConfig, procs: list[Any], status: Any, frontend: tuple[Any, Any] = (None, None),
                consensus: Any = None) -> str:
    """Start this node's rank processes (``cfg.local_ranks``) into ``procs`` (the user's ``__main__``
    out of sight), each with the ``status`` and ``consensus`` queues, rank 0 with the ``frontend``'s
    (inbox, outbox); this process then only reads the queues the ranks write. Returns
    torch.distributed's rendezvous: ``--dist-init-addr`` across machines (rank 0 listens there),
    else a free port of 127.0.0.1: on one machine no rank listens beyond loopback."""
    addr = split_host_port(cfg.dist_init_addr) if cfg.nnodes > 1 else None
    init = endpoint(*addr) if addr is not None else f"tcp://127.0.0.1:{free_port()}"
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    level = logging.getLogger().getEffectiveLevel()
    with user_main_hidden():
        for r in cfg.local_ranks:
            p = ctx.Process(target=start_rank, name=f"hicache-rank-{rank_label(r, cfg.tp_size)}", daemon=True,
                            args=(dict(os.environ), r, fields, init, status, *(frontend if r == 0 else (None, None)),
                                  consensus, level))
            p.start()
            procs.append(p)
    reader_only(status, frontend[1], consensus)
    return init


@contextlib.contextmanager
def user_main_hidden() -> Iterator[None]:
    """Start processes with the user's ``__main__`` out of sight, so the ranks never re-run it.

    Spawn tells a child how to rebuild the parent's ``__main__`` (Python 3.11,
    ``multiprocessing.spawn.get_preparation_data``): ``init_main_from_name`` when
    ``__main__.__spec__`` has a name (``python -m pkg.mod``), else ``init_main_from_path`` from
    ``__main__.__file__`` (``python script.py``); with neither, the child leaves its own
    ``__main__`` alone. Given one, the child re-imports the module as ``__mp_main__``, running a
    script's top level again: without an ``if __name__ == "__main__":`` guard that builds a
    second Engine inside the rank, which dies bootstrapping. The ranks need nothing from the
    user's module (their target and arguments are hicache's and plain data), so while they are
    started ``__main__`` is a bare module (``__spec__`` None, no ``__file__``). Another thread
    reading ``sys.modules["__main__"]`` in these few milliseconds sees the stub.
    """
    real = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = real


class RankGroup:
    """The rank processes of one engine, as the Engine's backend (``frontend/backend.py``)."""

    core = None  # the ranks hold the model, pools and cache; this process only forwards

    def __init__(self, cfg: EngineConfig) -> None:
        if cfg.node_rank != 0:
            raise ConfigError(f"node {cfg.node_rank} of {cfg.nnodes} serves nothing: start its ranks with "
                              f"`hicache node --node-rank {cfg.node_rank}` and the same engine flags.")
        self.nnodes = cfg.nnodes
        self.labels = [rank_label(r, cfg.tp_size) for r in cfg.local_ranks]  # node 0's ranks are 0, 1, ...
        ctx = rank_context()
        self.inbox, self.outbox, self.status = ctx.Queue(), ctx.Queue(), ctx.Queue()
        # What the leader never read is moot once it is gone: never hold up this process's exit
        # to flush it into a pipe nobody reads.
        self.inbox.cancel_join_thread()
        self.failure: str | None = None  # why the ranks were stopped, once they were
        self._stopping = False  # the ranks are being (or were) stopped
        self._closed = False
        self._halt_lock = threading.Lock()
        self._calls = itertools.count()
        self._replies: dict[int, Any] = {}
        self._updates: list[RequestUpdate] = []  # the leader's, in order, not yet taken
        # Checker: the ranks' call streams, compared here as they arrive (HICACHE_RANK_CONSENSUS_CHECKER=1).
        self.monitor: ConsensusMonitor | None = None
        self.trace: dict[str, deque[Entry]] = {label: deque(maxlen=TRACE_ENTRIES) for label in self.labels}
        self.procs: list[Any] = []  # started rank processes (this node's), in rank order
        self._watchdog: threading.Thread | None = None
        try:  # whatever fails or is interrupted from here on, nothing is left running
            self._start(cfg, ctx)
            self.component_pages = self._wait_ready()
            self.capacity_pages = self.component_pages["full"]
        except BaseException:
            self._release()
            raise
        self.scheduler = SchedulerProxy(self.send, self.updates)
        self._watchdog = threading.Thread(target=self._watch, name="hicache-rank-watchdog", daemon=True)
        self._watchdog.start()

    # ---- lifecycle --------------------------------------------------------------------------
    def _start(self, cfg: EngineConfig, ctx: Any) -> None:
        if checker_enabled():
            if self.nnodes > 1:  # other nodes' ranks have no queue to this process
                logger.warning("the rank consensus checker compares node 0's ranks only (%s)", ", ".join(self.labels))
            self.monitor = ConsensusMonitor(self.labels, lambda div: self._halt(str(div)), ctx,
                                            on_entry=lambda label, entry: self.trace[label].append(entry))
            self.monitor.start()
        init = spawn_ranks(ctx, cfg, self.procs, self.status, (self.inbox, self.outbox),
                           self.monitor.queue if self.monitor else None)
        logger.info("started %d ranks (tp=%d pp=%d): pids %s", len(self.labels), cfg.tp_size, cfg.pp_size,
                    [p.pid for p in self.procs])
        if self.nnodes > 1:
            logger.info("node 0 of %d: ranks %s here, %d on other nodes joining at %s", self.nnodes,
                        ", ".join(self.labels), cfg.tp_size * cfg.pp_size - len(self.labels), init)

    def _wait_ready(self) -> tuple[int, int]:
        """This node's ranks' capacities, full and window pages (the pools were MIN-agreed over
        every node's ranks before any rank reports ready, so the leader's capacity is the world's)."""
        ready: dict[int, tuple[int, int]] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < len(self.labels):
            item = poll(self.status, POLL_S * 4)
            if item is None:
                if self._exited():
                    self._halt(self._explain())
                elif time.monotonic() > deadline:
                    self._halt(f"ranks did not start within {STARTUP_TIMEOUT_S:.0f} s")
                self.check_alive()
                continue
            if isinstance(item, RankError):
                # A bad option shows the same on every rank: report it like a single-rank ConfigError.
                raise ConfigError(item.message) if "ConfigError" in item.trace else HicacheError(
                    f"rank {self.labels[item.rank]} failed to start: {item.message}")
            ready[item.rank] = item.capacity
        if len({tuple(sorted(c.items())) for c in ready.values()}) != 1:
            self._halt(f"ranks disagree on the device pool size: {ready}")
            self.check_alive()
        return next(iter(ready.values()))

    def shutdown(self) -> None:
        """Stop the ranks: in order when healthy (they drain their transfers), else by force."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.failure is None:
                self._stopping = True  # from here on an exiting rank is not a failure
                self.inbox.put(Shutdown(next(self._calls)))
                deadline = time.monotonic() + 30
                while any(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
                    try:  # keep reading: the leader's last updates must flow for it to exit
                        self.outbox.get(timeout=0.1)
                    except queue.Empty:
                        pass
                    except WRITERS_GONE:  # the leader has exited; the others may still be draining
                        for p in self.procs:
                            p.join(max(0.0, deadline - time.monotonic()))
                        break
        finally:  # even when interrupted (Ctrl-C while waiting): stop by force
            self._release()
        logger.info("ranks stopped: exit codes %s", [p.exitcode for p in self.procs])

    def _release(self) -> None:
        """Stop the ranks by force if still running, and every thread this group started."""
        self._stop_all()
        if self.monitor is not None:
            self.monitor.stop(timeout=30)  # ranks are gone: the backlog is finite
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=5)

    def _stop_all(self) -> None:
        """Stop by force (ranks ignore SIGINT and SIGTERM: only an orderly stop or this ends them)."""
        self._stopping = True
        kill_all(self.procs)

    # ---- failure ----------------------------------------------------------------------------
    def _watch(self) -> None:
        """Watchdog: a rank that dies or reports an error stops every rank at once, even while
        the frontend is idle; the next call then raises."""
        while not self._stopping and self.failure is None:
            if self._exited() or not self.status.empty():
                self._halt(self._explain())
                return
            time.sleep(0.2)

    def _exited(self) -> list[tuple[int, Any]]:
        """``(rank, process)`` of the ranks that have exited."""
        return [(r, p) for r, p in enumerate(self.procs) if p.exitcode is not None]

    def _halt(self, why: str) -> None:
        with self._halt_lock:
            if self.failure is not None or self._stopping:
                return
            self.failure = why
        logger.error("stopping all ranks: %s", why)
        self._stop_all()

    def check_alive(self) -> None:
        """Raises EngineDeadError once the ranks were stopped (a failure, or shutdown)."""
        if self.failure is not None:
            raise EngineDeadError(f"the engine stopped: {self.failure}")
        if self._stopping:
            raise EngineDeadError("the engine is stopped.")

    def _explain(self) -> str:
        """The root cause: a divergence if the checker saw one, else a rank that died without
        reporting (killed), else the first error a rank reported that is not a broken
        connection to a peer (peers of a failed rank fail that way too)."""
        if self.monitor is not None:
            self.monitor.settle()  # a dead rank cannot vote: report what the checker saw
        time.sleep(0.5)  # let the monitor and the other ranks' reports catch up
        if self.failure is not None:
            return self.failure
        reported: dict[int, str] = {}  # arrival order
        for item in queued_now(self.status):
            if isinstance(item, RankError):
                reported.setdefault(item.rank, item.message)
                logger.error("rank %s traceback:\n%s", self.labels[item.rank], item.trace)
        for r, p in self._exited():
            if r not in reported:  # it died silently
                return f"rank {self.labels[r]} (pid {p.pid}) {exit_text(p)}"
        if reported:
            primary = [r for r, m in reported.items() if not peer_failure(m)]
            if not primary and self.nnodes > 1:  # the cause is on a machine this process cannot see
                r = next(iter(reported))
                return (f"rank {self.labels[r]} lost a peer on another node (see that node's `hicache node` log): "
                        f"{reported[r]}")
            primary = primary or list(reported)
            return f"rank {self.labels[primary[0]]} failed: {reported[primary[0]]}"
        return f"rank {self.labels[0]} closed its connection to the frontend"

    # ---- talking to the leader -----------------------------------------------------------
    def send(self, item: Any) -> None:
        if self.failure is None and not self._stopping:
            self.inbox.put(item)

    def _pump(self, timeout: float) -> None:
        """Read what the leader sent (waiting up to ``timeout`` for the first item)."""
        try:
            item = self.outbox.get(timeout=timeout)
        except (queue.Empty, *WRITERS_GONE) as e:
            if not isinstance(e, queue.Empty):  # the leader is gone (maybe in the middle of a message)
                self._halt(self._explain())
            self.check_alive()
            return
        for item in itertools.chain([item], queued_now(self.outbox)):  # (the next read reports a gone leader)
            if isinstance(item, Updates):
                self._updates.extend(item.updates)
            else:
                self._replies[item.call_id] = item.value

    def updates(self, timeout: float) -> list[RequestUpdate]:
        self.check_alive()
        if not self._updates:
            self._pump(timeout)
        out, self._updates = self._updates, []
        return out

    def call(self, command: Callable[[int], RankCall]) -> Any:
        """Run ``command`` (Flush, Stats) on every rank at one step; the leader's answer."""
        call_id = next(self._calls)
        self.send(command(call_id))
        while call_id not in self._replies:
            self.check_alive()
            self._pump(POLL_S)
        return self._replies.pop(call_id)

    # ---- the rest of the Engine's backend interface -----------------------------------------
    def stats(self) -> dict[str, Any]:
        """The leader's cache and queue figures."""
        return self.call(Stats)

    def flush(self) -> bool:
        """Every rank empties its cache at the same step."""
        return bool(self.call(Flush))

    def release_retention(self, namespace: str, tokens: list[int]) -> int:
        """Every rank drops the retention at the same step."""
        return int(self.call(functools.partial(ReleaseRetention, namespace=namespace, tokens=tuple(tokens))))

    def drain_idle(self) -> None:
        """Nothing to do here: the ranks apply their acks themselves, in agreed steps."""


class SchedulerProxy:
    """The frontend's stand-in for the ranks' scheduler (``RankGroup.scheduler``): it answers the
    calls the Engine and the EngineLoop make on a local one (``add``, ``abort``, ``step``,
    ``has_work``, ``running``, ``waiting``) and schedules nothing. Requests stay this process's
    objects; the leader's updates fill them in, and a step is "read what the leader sent".
    ``send``: a command to the leader; ``updates(timeout)``: the leader's request updates received
    within ``timeout`` seconds."""

    def __init__(self, send: Callable[[Add | Abort], None], updates: Callable[[float], list[RequestUpdate]]) -> None:
        self.send, self.updates = send, updates
        self.requests: dict[int, Request] = {}

    @property
    def waiting(self) -> list[Request]:
        return [r for r in self.requests.values() if r.cached is None]

    @property
    def running(self) -> list[Request]:
        return [r for r in self.requests.values() if r.cached is not None]

    def has_work(self) -> bool:
        return bool(self.requests)

    def add(self, *reqs: Request) -> None:
        """Queue ``reqs`` in one message: the leader takes them all at one step."""
        self.requests.update((req.rid, req) for req in reqs)
        self.send(Add(tuple(RequestSpec.of(req) for req in reqs)))

    def abort(self, rid: int) -> Request | None:
        """Finishes the request here at once (returned; None: not found); the ranks drop it at their next step."""
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        req.status, req.finish_reason, req.finish_time = Status.FINISHED, "abort", time.perf_counter()
        self.send(Abort(rid))
        req.notify()
        return req

    def step(self) -> list[Request]:
        finished = []
        for upd in self.updates(POLL_S):
            req = self.requests.get(upd.rid)
            if req is None:  # aborted here already
                continue
            upd.apply(req)
            if upd.finished:
                del self.requests[upd.rid]
                finished.append(req)
            req.notify()
        return finished


def peer_failure(message: str) -> bool:
    """An error that only says a peer went away (gloo's words for it)."""
    return any(w in message for w in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))
