"""Where the Engine's scheduler runs: one backend object, one interface, whatever the layout.

Invariant: :class:`~hicache.frontend.engine.Engine` talks to exactly one :class:`Backend` and
never asks which kind it holds. :class:`LocalBackend` keeps the model, pools, cache and
scheduler in this process (one rank); ``hicache.parallel.rank_group.RankGroup`` keeps them in the
rank processes (``--tp-size`` / ``--pp-size`` > 1) and forwards to its leader.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from ..config import EngineConfig
from ..errors import HicacheError
from ..model.loader import LoadedModel
from ..model.parallel import check_parallel
from ..parallel.rank_group import RankGroup
from ..runtime.core import EngineCore, build_core
from ..runtime.core_stats import core_stats
from ..runtime.rank_plan import model_components
from ..runtime.request import Request
from ..runtime.scheduler import Scheduler
from ..runtime.step import ForwardFn, StepDriver
from ..runtime.warmup import warm_up

logger = logging.getLogger(__name__)


class SchedulerView(Protocol):
    """What the Engine and the EngineLoop call on a scheduler, local or remote."""

    @property
    def running(self) -> Sequence[Request]: ...

    @property
    def waiting(self) -> Sequence[Request]: ...

    def add(self, *reqs: Request) -> None: ...  # taken at one step, in order

    def step(self) -> list[Request]: ...

    def abort(self, rid: int) -> Request | None: ...

    def has_work(self) -> bool: ...


class Backend(Protocol):
    """The Engine's one backend. ``capacity_pages``: usable device pages (on every rank the
    same; ``component_pages``: those of each component with a page space of its own, by name: "full",
    a hybrid pool's "window"); ``core``: the in-process parts when this process holds them, else None."""

    capacity_pages: int
    component_pages: dict[str, int]
    core: EngineCore | None

    @property
    def scheduler(self) -> SchedulerView: ...

    def stats(self) -> dict[str, Any]:
        """Cache and queue figures (``Engine.stats()`` without the layout)."""

    def flush(self) -> bool:
        """Empty the prefix cache; the caller has checked that no request is in flight."""

    def release_retention(self, namespace: str, tokens: list[int]) -> int:
        """Drop the retention of the cached prefix of ``tokens`` in ``namespace``; the tokens released."""

    def drain_idle(self) -> None:
        """Idle housekeeping; never waits."""

    def check_alive(self) -> None:
        """Raise :class:`~hicache.errors.EngineDeadError` once the backend can no longer serve."""

    def shutdown(self) -> None:
        """Stop threads or processes and free the model and pools; idempotent."""


class LocalScheduler:
    """One in-process rank's scheduler as the Engine and the EngineLoop see it: the runtime's
    :class:`Scheduler`, stepped by the one :class:`StepDriver` this process's loop owns."""

    IDLE_PAUSE_S = 0.001  # no batch, only background work to wait for: do not spin

    def __init__(self, scheduler: Scheduler, forward: ForwardFn) -> None:
        self.runtime = scheduler
        self.driver = StepDriver(scheduler, forward)
        self.abort, self.has_work = scheduler.abort, scheduler.has_work  # the runtime's own, as they are
        self.running, self.waiting = scheduler.running, scheduler.waiting  # (changed in place, never replaced)

    def add(self, *reqs: Request) -> None:
        for req in reqs:
            self.runtime.add(req)

    def step(self) -> list[Request]:
        """One step (runtime/step.py); returns the requests that finished in it."""
        batch, finished = self.driver.step()
        if batch is None and self.runtime.only_waiting():
            time.sleep(self.IDLE_PAUSE_S)
        return finished


class LocalBackend:
    """One rank in this process: the :class:`EngineCore` itself, and the driver that steps it."""

    def __init__(self, core: EngineCore, page_size: int) -> None:
        self.core: EngineCore | None = core
        self._scheduler = LocalScheduler(core.scheduler, core.runner.forward)
        self.capacity_pages, self.component_pages = core.cache.capacity_pages, core.cache.component_pages
        self._page_size = page_size

    def _live(self) -> EngineCore:
        if self.core is None:
            raise HicacheError("the engine was shut down.")
        return self.core

    @property
    def scheduler(self) -> LocalScheduler:
        self._live()
        return self._scheduler

    def stats(self) -> dict[str, Any]:
        return core_stats(self._live(), self._page_size)

    def flush(self) -> bool:
        self._live().cache.flush()
        logger.info("cache flushed")
        return True

    def release_retention(self, namespace: str, tokens: list[int]) -> int:
        return self._live().cache.retention.release(namespace, np.asarray(tokens, dtype=np.int32))

    def drain_idle(self) -> None:
        """Apply the transfer acks that are ready, so no lock outlives its transfer. Never
        waits: a storage write stuck in a hung backend must not hold the loop thread."""
        core = self._live()
        if not core.scheduler.has_work() and core.cache.has_pending_transfers():
            core.cache.drain_ready()

    def check_alive(self) -> None:
        """One process: alive while the threads it serves with are (P/D transfers)."""
        if self.core is not None:
            self.core.check_alive()

    def shutdown(self) -> None:
        """Stop the cache's threads (pending writes finish), then drop the model and pools."""
        if self.core is not None:
            self.core.shutdown()
            self.core = None


def make_backend(cfg: EngineConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
                 draft: LoadedModel | None = None) -> Backend:
    """The backend for ``cfg``'s layout: in this process for one rank (warmed up unless
    ``--skip-server-warmup``), rank processes else (each loads its own slice of the model;
    ``loaded`` then holds the spec and tokenizer; not warmed up: runtime/warmup.py says why).
    ``draft``: the speculative draft model (one rank only, for now). A component the model declares
    that a mode cannot run with is refused first (``EngineConfig.refuse_combinations``)."""
    cfg.refuse_combinations(model_components(loaded.spec))
    if cfg.tp_size * cfg.pp_size == 1:
        core = build_core(cfg, loaded, device, dtype, draft=draft)
        if not cfg.skip_server_warmup:  # before any request, so before /health answers (runtime/warmup.py)
            warm_up(core.runner)
        return LocalBackend(core, cfg.page_size)
    check_parallel(loaded.spec, cfg.tp_size // cfg.attn_cp_size, cfg.pp_size)
    if draft is not None:  # the draft runs on the first stage, tensor-parallel like the target
        check_parallel(draft.spec, cfg.tp_size // cfg.attn_cp_size, 1)
    return RankGroup(cfg)
