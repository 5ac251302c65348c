"""A rank process: its slice of the model, its own pools, radix tree and scheduler, and the
step loop that keeps every rank's cache decisions identical.

Every rank runs the same scheduler on the same request stream (SPMD). What could differ
between ranks is *when* background work (copies, storage reads) finishes; so each step's
event counts are agreed, never read locally:

- Stage 0: the leader (PP0/TP0) takes the frontend's requests for the step and broadcasts
  them over the stage's TP group; the TP ranks MIN-reduce their ready counts.
- ``pp_sync``: stage 0 sends the agreed counts downstream with the step (point to point, no
  barrier); a later stage consumes exactly those (waiting for its own copies of those acks
  when they are not done yet; extra ready acks stay queued) and forwards them.

Pipeline: each step's batch travels stage to stage as hidden states; the last stage samples
and sends the tokens back to stage 0, which applies them ``pp_size`` steps later and tells
every stage (in that step's message) to apply them at the same point. A request whose batch
is still in the pipeline sits out the steps in between, so ``pp_size`` micro-batches of
different requests are in flight at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import sys
import time
import traceback
from collections import deque
from multiprocessing import forkserver
from typing import Any

import numpy as np
import torch

from ..config import ConfigError, EngineConfig
from ..consensus_record import ENV_VAR as CHECKER_ENV, install_recorder, make_queue_sink
from ..device import DTYPES, choose_precision, resolve_device
from ..disagg.heads import TPRanks
from ..errors import HicacheError
from ..model import load_model
from ..model.parallel import model_shard, shard_model
from ..runtime.batch import Batch, Sampled
from ..runtime.core import EngineCore, build_core
from ..runtime.core_stats import core_stats
from ..runtime.rank_plan import RankContext
from ..runtime.events import StepEvents
from ..runtime.request import Request
from ..runtime.step import Inbound, Intake, StepDriver, apply_intake, take_intake
from .channels import WRITERS_GONE, reader_only, writer_only
from .faults import FaultPlan
from .groups import ParallelGroups, RankInfo
from .messages import (Flush, RankCall, RankError, Ready, ReleaseRetention, Reply, RequestUpdate, Shutdown,
                       StageMessage, Stats, Updates)
from .stage_step import StageAgreement, stage_output

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # an idle leader still steps this often, so acks keep draining everywhere
PREFETCH_POLL_S = 0.005  # step period while only storage prefetches are awaited
# Test switch (never set in production): one rank shortens its prefix matches.
ALTER_MATCH_ENV = "HICACHE_TEST_ALTER_MATCH"


class StageLoop:
    def __init__(self, info: RankInfo, groups: ParallelGroups, core: EngineCore, inbox: Any = None,
                 outbox: Any = None) -> None:
        self.info, self.groups, self.core = info, groups, core
        self.sched, self.cache = core.scheduler, core.cache
        self.first = info.pp_rank == 0
        self.last = info.pp_rank == info.pp_size - 1
        self.leader = info.rank == 0
        self.inbox, self.outbox = inbox, outbox
        self.inflight: deque[tuple[int, Batch]] = deque()  # (step, batch) sent down, not yet returned
        self.step = 0
        self._sent: dict[int, int] = {}  # leader: output tokens already reported, per rid
        self._updates: list[RequestUpdate] = []
        self.prev = info.rank_of(info.pp_rank - 1, info.tp_rank) if not self.first else None
        self.next = info.rank_of(info.pp_rank + 1, info.tp_rank) if not self.last else None
        self.tail = info.rank_of(info.pp_size - 1, info.tp_rank)  # where stage 0 receives tokens
        # The one step driver, with this stage's agreement (TP MIN / pp_sync) and output.
        self.agreement = StageAgreement(info, groups)
        self.driver = StepDriver(self.sched, core.runner.forward, self.agreement,
                                 stage_output(info, groups, self.sched, lambda b: self.inflight.append((self.step, b))))
        # Agreement overhead (Engine.stats()["agreement"] from the leader): the agreement counts
        # steps and stage 0's tp_min time; on later stages, the pp_sync hop (send -> our recv).
        self.hop_s, self.hops = 0.0, 0
        self.frontend_gone = False  # the leader found the frontend's end of its inbox closed

    # ---- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            if self.first:
                inputs = self.groups.tp_broadcast(self._leader_inputs() if self.leader else None)
                results = self._returned_tokens(isinstance(inputs.command, (Shutdown, Flush)))
                msg = StageMessage(inputs, results, StepEvents(), None, None)  # the step as a later stage gets it
            else:
                msg = self.groups.recv(self.prev)
                if msg.sent_at:
                    self.hop_s += time.perf_counter() - msg.sent_at
                    self.hops += 1
                inputs, results = msg.inputs, msg.results
            self._apply(inputs, results)
            if isinstance(inputs.command, (Shutdown, Flush)):
                # Forward first: draining waits for storage ops every rank's threads must reach.
                if not self.last:
                    self.groups.send(self.next, StageMessage(inputs, results, StepEvents(), None, None))
                if isinstance(inputs.command, Shutdown):
                    if self.hops:
                        logger.info("pp_sync hop: %d messages, %.3f ms mean", self.hops, self.hop_s / self.hops * 1e3)
                    return
                # Empty every tier: the same decision on every rank (it depends on the request stream
                # only), refused while a request still holds pages (no batch is in flight: this step collected them).
                flushed = not self.sched.has_work()
                if flushed:
                    self.cache.flush()
                    logger.info("cache flushed")
                self._reply(inputs.command, flushed)
                self.step += 1
                continue
            batch, _ = self.driver.step(Inbound(msg.events, msg.hidden, msg, msg.proposal))
            self._report()
            if self.leader and batch is None and not self.inflight and self.sched.has_work():
                time.sleep(PREFETCH_POLL_S)  # only prefetches or KV transfers to wait for: do not spin
            self.step += 1

    def _returned_tokens(self, drain: bool) -> list[Sampled]:
        """Stage 0 of a pipeline: the tokens of the oldest in-flight batch once ``pp_size``
        steps have passed (blocking), or with ``drain`` (flush, stop) of every in-flight batch,
        so that no stage keeps a batch the others dropped."""
        if self.last or not self.inflight:
            return []
        if drain:
            return [self.groups.recv(self.tail) for _ in range(len(self.inflight))]
        if self.step - self.inflight[0][0] < self.info.pp_size:
            return []
        return [self.groups.recv(self.tail)]

    def _apply(self, inputs: Intake, results: list[Sampled]) -> None:
        """The step's inputs, in the same order on every rank. Adds before aborts: a client
        may abort a request in the same step it arrived."""
        for tokens in results:
            _, batch = self.inflight.popleft()
            self.sched.apply_results(batch, tokens)
        reqs = [spec.request() for spec in inputs.adds]
        if self.leader:
            for req in reqs:
                req.on_update = self._on_update
        apply_intake(self.sched, reqs, inputs.aborts)
        if isinstance(inputs.command, Stats):
            out = core_stats(self.core, self.cache.page_size)
            if "kv_sharding" in out:  # every rank's own gather figures, for stats and Prometheus
                mine = {k: v for k, v in out["kv_sharding"].items() if k.startswith("gather")}
                out["kv_sharding"]["per_rank"] = self.groups.tp_gather_object(mine)
            if "disaggregation" in out:  # each rank moved its heads' share of the bytes
                out["disaggregation"]["bytes"] = sum(self.groups.tp_gather_object(out["disaggregation"]["bytes"]))
            a = self.agreement
            out["agreement"] = {"steps": a.steps, "tp_min_ms_per_step": a.seconds / max(a.steps, 1) * 1e3}
            self._reply(inputs.command, out)
        elif isinstance(inputs.command, ReleaseRetention):
            cmd = inputs.command
            self._reply(cmd, self.cache.retention.release(cmd.namespace, np.asarray(cmd.tokens, dtype=np.int32)))
        elif isinstance(inputs.command, Shutdown):
            for req in list(self.sched.running) + list(self.sched.waiting):
                self.sched.abort(req.rid)
            self._report()

    # ---- leader <-> frontend ----------------------------------------------------------------
    def _leader_inputs(self) -> Intake:
        """Everything the frontend queued (the same intake as a single-rank EngineLoop's);
        waits up to IDLE_POLL_S when there is nothing to do. A command (flush, stats, stop)
        ends the step's intake: it applies after the adds and aborts."""
        idle = not self.sched.has_work() and not self.inflight

        def first() -> Any:
            try:
                return self.inbox.get(timeout=IDLE_POLL_S) if idle else self.inbox.get_nowait()
            except WRITERS_GONE:  # the frontend exited without stopping us (killed, or never shut down)
                if not self.frontend_gone:
                    logger.warning("the frontend process is gone: stopping")
                self.frontend_gone = True
                return Shutdown(-1)

        # (A frontend gone after the first item is noticed at the next step.)
        return take_intake(first, self.inbox.get_nowait, (queue.Empty, *WRITERS_GONE))

    def _on_update(self, req: Request) -> None:
        upd = RequestUpdate.of(req, self._sent.pop(req.rid, 0))
        if not upd.finished:
            self._sent[req.rid] = len(req.output_ids)
        self._updates.append(upd)
        if upd.admission:  # to the frontend before the step's forward (a long first chunk takes a while)
            self._report()

    def _report(self) -> None:
        if self._updates and not self.frontend_gone:
            self.outbox.put(Updates(self._updates))
            self._updates = []

    def _reply(self, call: RankCall, value: Any) -> None:
        if self.leader:
            self.outbox.put(Reply(call.call_id, value))


def _alter_matches(cache: Any) -> None:
    """Test hook: this rank's prefix matches come back one page short."""
    tree = cache.tree
    original = tree.match_prefix

    def shorter(namespace: str, tokens: Any, cut: bool = True) -> Any:
        match = original(namespace, tokens, cut)
        pages = match.device_hit_tokens // tree.page_size
        return original(namespace, tokens[: (pages - 1) * tree.page_size], cut) if pages >= 2 else match

    tree.match_prefix = shorter


def _load_draft(cfg: EngineConfig, info: RankInfo, groups: ParallelGroups, dtype: torch.dtype,
                device: torch.device) -> tuple[Any, Any]:
    """The speculative draft on a first-stage rank (it proposes before the verify batch enters
    the pipeline), tensor-parallel like the target so its KV rows pack with the target's."""
    if not cfg.uses_draft_model or info.pp_rank > 0:
        return None, None
    draft = load_model(cfg.speculative_draft_model_path, dtype=dtype, device=device, seed=cfg.random_seed,
                       precision=cfg.precision_options(), to_be_sharded=True)
    draft_shard = model_shard(draft.spec, info.attn_tp_rank, info.attn_tp_size, 0, 1)
    shard_model(draft.model, draft_shard, groups.tp_reduce if info.attn_tp_size > 1 else None)
    return draft, draft_shard


def _open_shared_reduce(cfg: EngineConfig, info: RankInfo, groups: ParallelGroups, loaded: Any, draft: Any) -> None:
    """The shared-memory all-reduce, sized for the largest partial sum (a prefill chunk, a decode or
    verify batch); deterministic inference with more than 2 TP ranks needs it (every TP rank alike)."""
    rows = max(cfg.chunked_prefill_size, cfg.max_running_requests * (cfg.speculative_steps + 1))
    shm = groups.use_shared_memory_reduce(rows * max(loaded.spec.hidden_size, draft.spec.hidden_size if draft else 0))
    if cfg.enable_deterministic_inference and info.attn_tp_size > 2 and not shm:
        raise ConfigError("--enable-deterministic-inference with more than 2 TP ranks needs the shared-memory "
                          "all-reduce (one machine, x86, room in /dev/shm): it sums the partials in rank "
                          "order, gloo in an order that depends on the size.")


def _rank_device(cfg: EngineConfig, info: RankInfo) -> tuple[EngineConfig, torch.device]:
    """This rank's device (its node's GPU by local rank on CUDA) and ``cfg`` with the dtype and
    prefill weights resolved for it (node 0's Engine passes both resolved; a `hicache node`
    launcher passes the flags as given)."""
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", info.rank % info.ranks_per_node % torch.cuda.device_count())  # local rank
        torch.cuda.set_device(device)
    return choose_precision(cfg, device), device


def rank_context() -> Any:
    """The multiprocessing context rank processes start from: a fork server that imported this
    module (torch, the model, the runtime) once, so that each rank starts as a fork of it rather
    than a fresh interpreter importing them again (~2 s of CPU a rank). The server starts with
    the first rank group and serves every later one of this process; it never touched a device
    or ran a thread pool, so forking it is safe.

    It imports with the consensus checker's decorators applied (``consensus_check`` decides at
    import), whatever the first group's environment: a later group with the checker on then
    records its calls, one with it off passes through them (a rank takes its starter's
    environment, and installs a recorder only when the checker is on)."""
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    saved = os.environ.get(CHECKER_ENV)
    os.environ[CHECKER_ENV] = "1"  # the server inherits the environment it starts with
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ[CHECKER_ENV]
        else:
            os.environ[CHECKER_ENV] = saved
    return ctx


def start_rank(env: dict[str, str], *rank_args: Any) -> None:
    """A rank process's target: the starting process's environment as it is now (a fork server
    keeps the one it started with), then :func:`rank_main` with ``rank_args``."""
    os.environ.clear()
    os.environ.update(env)
    rank_main(*rank_args)


def _name_process(name: str) -> None:
    """What ``top`` and ``ps -o comm`` show for this process (Linux: 15 bytes; elsewhere nothing)."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
        f.write(name[:15])


def rank_main(rank: int, cfg_fields: dict, init_method: str, status: Any, inbox: Any, outbox: Any,
              consensus_queue: Any, log_level: int) -> None:
    """Entry point of a rank process (spawned by :class:`hicache.parallel.rank_group.RankGroup`,
    or on a node other than 0 by :func:`hicache.parallel.node.run_node`, with no frontend queues)."""
    # Ctrl-C, and SIGTERM sent to a whole process group (systemd, `kill -- -pgid`), reach the
    # ranks too; the frontend decides how they stop (in order, or by SIGKILL).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    reader_only(inbox)  # a frontend that dies then reads as end-of-file, even mid-message
    writer_only(status, outbox, consensus_queue)  # and our puts then fail instead of blocking
    cfg = EngineConfig(**cfg_fields)
    info = RankInfo(rank, cfg.tp_size, cfg.pp_size, cfg.nnodes, cfg.attn_cp_size)
    _name_process(f"hicache {info.label}")
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s {info.label} %(name)s: %(message)s")
    try:
        # Threads, devices and memory are this machine's: shared by its node's ranks only.
        torch.set_num_threads(cfg.num_threads or max(1, (os.cpu_count() or 1) // info.ranks_per_node))
        cfg, device = _rank_device(cfg, info)
        dtype = DTYPES[cfg.dtype]
        groups = ParallelGroups(info, init_method, device,
                                latent_sharding=cfg.enable_kv_cache_sharding and cfg.attn_cp_size == 1)
        loaded = load_model(cfg.model, dtype=dtype, device=device, seed=cfg.random_seed,
                            precision=cfg.precision_options(), to_be_sharded=True)
        # Weights are replicated across CP ranks and tensor-parallel within one.
        shard = model_shard(loaded.spec, info.attn_tp_rank, info.attn_tp_size, info.pp_rank, info.pp_size)
        shard_model(loaded.model, shard, groups.tp_reduce if info.attn_tp_size > 1 else None)
        draft, draft_shard = _load_draft(cfg, info, groups, dtype, device)
        if device.type == "cpu":
            _open_shared_reduce(cfg, info, groups, loaded, draft)
        local = info.ranks_per_node
        ranks_per_device = local if device.type == "cpu" else -(-local // torch.cuda.device_count())
        place = RankContext(shard, agree=groups.world_min, storage_agree=groups.storage_agree(),
                            memory_share=ranks_per_device, staging_bytes=groups.staging_bytes(), cp_group=groups.cp,
                            split_tokens=info.cp_size > 1,
                            draft_row=(len(draft_shard.kv_heads), draft.spec.head_dim) if draft else None,
                            # a P/D role: this rank's KV heads and its TP group's collectives
                            pd_ranks=TPRanks(info.tp_rank, info.tp_size, shard.kv_heads, groups.tp_gather_object,
                                             groups.tp_sum),
                            share_draws=groups.tp_broadcast if info.tp_size > 1 else None)  # one rank's draws a stage
        core = build_core(cfg, loaded, device, dtype, place, draft)
        plan = FaultPlan.from_env()
        if plan is not None:
            plan.install(core.cache, info.label, rank)
        if os.environ.get(ALTER_MATCH_ENV) == info.label and core.cache.tree is not None:
            _alter_matches(core.cache)
        if consensus_queue is not None:
            install_recorder(info.label, make_queue_sink(consensus_queue))
        logger.info("rank ready: %s device pages=%d host pages=%d staging=%.1f MiB", shard.describe(),
                    core.pool.num_pages, core.host_pool.num_pages if core.host_pool is not None else 0,
                    groups.staging_bytes() / 2**20)
        status.put(Ready(rank, core.cache.component_pages))
        StageLoop(info, groups, core, inbox, outbox).run()
        core.shutdown()
        groups.close()
    except BaseException as e:  # report, then die: the frontend stops every rank
        msg = str(e) if isinstance(e, HicacheError) else f"{type(e).__name__}: {e}"
        status.put(RankError(rank, msg, traceback.format_exc()))
        _exit(1, status, outbox, consensus_queue)
    _exit(0, status, outbox, consensus_queue)


def _exit(code: int, *queues: Any) -> None:
    """Flush what this rank queued for the frontend, then exit without interpreter teardown
    (peers' collectives are no longer ours to wait for)."""
    for q in queues:
        if q is not None:
            q.close()
            q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
