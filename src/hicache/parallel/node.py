"""``hicache node``: the ranks of one engine that run on a machine other than node 0.

Invariants:

- Node ``R`` of ``N`` runs the global ranks ``[R * k, (R + 1) * k)``, ``k = tp * pp // N``; it
  never holds rank 0, so it has no frontend: no requests come in here and no updates go out.
  Its ranks get every step's inputs, and ``stop``, from node 0 through the collectives (the TP
  broadcast and the pipeline's stage messages), exactly as a non-leader rank on one machine.
- This launcher only watches: it collects its ranks' ``ready`` and ``error`` reports on a
  local status queue and logs them. It exits 0 once every rank has exited 0 (node 0 stopped
  the engine in order), and non-zero as soon as one rank fails or dies, after killing the
  others: a node whose peers vanished never lingers (its ranks' collectives fail too, and
  whatever is left is killed here).
- The ranks ignore SIGINT and SIGTERM (as on one machine); this launcher turns either into
  killing them, which node 0 then sees as a lost peer and reports.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any, Callable

from ..config import ConfigError, EngineConfig
from ..errors import HicacheError
from ..model import load_model
from ..model.parallel import check_parallel
from .channels import exit_text, kill_all, poll, queued_now
from .groups import rank_label
from .messages import RankError
from .rank_group import STARTUP_TIMEOUT_S, peer_failure, spawn_ranks
from .worker import rank_context

logger = logging.getLogger(__name__)

POLL_S = 0.2


class NodeFailed(HicacheError):
    """A rank of this node failed or died; the message names it."""


def run_node(cfg: EngineConfig, report: Callable[[str], None] = logger.info) -> int:
    """Start this node's ranks, wait until they stop; 0 if they all stopped in order.
    ``report`` receives the lifecycle lines (ready, stopped). Raises :class:`ConfigError` for
    a bad flag combination and :class:`NodeFailed` when a rank fails."""
    if cfg.nnodes < 2 or cfg.node_rank == 0:
        raise ConfigError("`hicache node` runs the ranks of a node other than 0: give --nnodes N (> 1), "
                          "--node-rank R (1 .. N-1) and --dist-init-addr HOST:PORT.")
    check_parallel(load_model(cfg.model, weights=False).spec, cfg.tp_size, cfg.pp_size)
    node = _Node(cfg)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        node.start()
        node.wait(starting=True)
        report(f"node {cfg.node_rank} of {cfg.nnodes}: ranks {', '.join(node.labels)} ready "
               f"(device pages={node.capacity}); waiting for node 0 to stop them")
        node.wait(starting=False)
        report(f"node {cfg.node_rank} of {cfg.nnodes}: ranks stopped in order")
        return 0
    finally:
        kill_all(node.procs)  # nothing outlives the launcher, however it ends (an orderly stop comes from node 0)
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM: stop like Ctrl-C (the ranks are killed on the way out)


class _Node:
    """This node's rank processes and their status queue."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.labels = [rank_label(r, cfg.tp_size) for r in cfg.local_ranks]
        self.ctx = rank_context()
        self.status = self.ctx.Queue()
        self.procs: list[Any] = []
        self.capacity = 0

    def start(self) -> None:
        init = spawn_ranks(self.ctx, self.cfg, self.procs, self.status)  # a killed rank then reads as end-of-file
        logger.info("node %d of %d: started ranks %s (pids %s), joining %s", self.cfg.node_rank, self.cfg.nnodes,
                    ", ".join(self.labels), [p.pid for p in self.procs], init)

    def wait(self, starting: bool) -> None:
        """Until every rank has joined the world and built its pools (``starting``), else until
        every rank has exited (0 for all after node 0's stop); raises on a failure."""
        ready: set[int] = set()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < len(self.labels) if starting else any(p.exitcode is None for p in self.procs):
            item = poll(self.status, POLL_S)
            if isinstance(item, RankError):
                self._failed(item, starting)
            elif item is not None:
                ready.add(item.rank)
                self.capacity = item.capacity
            self._check_exits(starting)
            if starting and time.monotonic() > deadline:
                raise NodeFailed(f"ranks {', '.join(self.labels)} did not start within {STARTUP_TIMEOUT_S:.0f} s "
                                 f"(is node 0 up at {self.cfg.dist_init_addr}?)")
        self._check_exits(starting)

    def _check_exits(self, starting: bool) -> None:
        """A rank that exited non-zero (or at all, before it was ready) without a report."""
        for label, p in zip(self.labels, self.procs):
            if p.exitcode is not None and (p.exitcode != 0 or starting):
                for item in queued_now(self.status):  # an error it reported just before it exited explains it better
                    if isinstance(item, RankError):
                        self._failed(item, starting=False)
                raise NodeFailed(f"rank {label} (pid {p.pid}) {exit_text(p)}")

    def _failed(self, error: RankError, starting: bool) -> None:
        label = rank_label(error.rank, self.cfg.tp_size)
        logger.error("rank %s traceback:\n%s", label, error.trace)
        if starting and "ConfigError" in error.trace:  # a bad option shows the same on every rank
            raise ConfigError(error.message)
        hint = " (a rank on another node failed or its node is gone)" if peer_failure(error.message) else ""
        raise NodeFailed(f"rank {label} failed{hint}: {error.message}")
