"""A server's part in prefill/decode disaggregation (``--disaggregation-mode``): a mode
(:class:`~hicache.runtime.modes.Mode`) whose hooks run when a request is admitted, when it
finishes, and once per step on the agreed events of its open transfers.

* :class:`PrefillRole`: a request with a bootstrap computes its prompt and first token as usual;
  at finish its KV stays held (not released to the tree) until the sender has streamed the
  tokens after the decode server's ``decode_prefix_len`` (or given up), then it is released. A
  model with recurrent layers sends their state at the prompt's end and, where held, at its
  checkpoint (:mod:`hicache.disagg.state_tail`), never a state per page.
* :class:`DecodeRole`: a request with a bootstrap is admitted against this server's own tiers
  (device hits locked, host hits restored layer by layer into reserved pages, storage hits
  only once their prefetch was accepted); ``decode_prefix_len`` is what admission found (whole
  pages; a recurrent model's counts attention rows, its states arrive whole: the prompt's end into
  the running slot, the checkpoint into a snapshot slot its tree takes at release). It then waits,
  holding its pages, until the suffix's KV has arrived *and* the local
  restore is done, and decodes from the prefill server's first token. If either fails, the
  request ends with an error and everything it held is released.

Requests without a bootstrap run as on any engine (handy for tests and warm-up).

With tensor parallelism every rank runs its own role over its own pool (its KV heads; see
:mod:`hicache.disagg.heads`), and *when* a transfer ended is agreed like any background work:
each rank reports per open transfer whether it is over here and whether it failed
(``local_events``), the ranks MIN-reduce the step's event vector, and every rank acts on the
agreed events at the same point of the same step (``apply_events``): the tree and the request
states stay identical across ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..disagg.heads import RankEndpoint, TPRanks
from ..disagg.receiver import KVReceiver
from ..disagg.sender import KVSender
from ..disagg.transfer import Receive, Send
from ..disagg.window_tail import WINDOW, Tail
from .events import WorkEvent, split_over
from .modes import Action, Fail, Mode, ModeContext, Release, StartDecode
from .request import Request, Status

if TYPE_CHECKING:
    from ..cache.manager import KVCacheManager
    from ..cache.state_pool import StatePool
    from ..disagg.mooncake_writes import MooncakeWrites

logger = logging.getLogger(__name__)

KV_TRANSFER_FAILED = "kv_transfer_failed"  # the error code of a request whose KV never arrived


@dataclass
class TransferStats:
    """Counters of one server's side (monotonic): requests whose transfer ended, those that
    failed, KV tokens and bytes moved, seconds from asking to stored (decode side), and the
    prompt tokens the decode side's own tiers supplied instead (its ``decode_prefix_len`` sum)."""

    requests: int = 0
    failed: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    decode_prefix_tokens: int = 0
    states: int = 0  # recurrent states (whole slots: a prompt's end, its checkpoint) moved; their bytes are in bytes

    def add(self, **figures: float) -> None:
        """One more request whose transfer ended, with its ``figures`` (field name -> what it adds)."""
        self.requests += 1
        for name, value in figures.items():
            setattr(self, name, getattr(self, name) + value)


def _states(cache: "KVCacheManager") -> "StatePool | None":
    """The recurrent layers' state slots of this rank (None: the model has none)."""
    return cache.device_states.pool if cache.device_states is not None else None


def _writes(transport: str, cache: "KVCacheManager", host: str) -> "MooncakeWrites | None":
    """The Mooncake transfer engine for ``--disaggregation-transfer-backend mooncake``, else None
    (rows travel in the ZeroMQ messages)."""
    if transport != "mooncake":
        return None
    from ..disagg.mooncake_writes import MooncakeWrites

    return MooncakeWrites(cache.pool, host, _states(cache))


class _Role(Mode):
    """What both sides share: their transfer end ``io`` (a KVSender or a KVReceiver, on a thread of its
    own), its open ``jobs`` (a request first, in the order they opened) and the counters."""

    name = "disaggregation"

    def __init__(self, io: "KVSender | KVReceiver", ranks: TPRanks, timeout_s: float) -> None:
        self.io, self.ranks, self.timeout_s = io, ranks, timeout_s
        self.jobs: list[tuple] = []
        self.counters = TransferStats()

    def open_work(self) -> int:
        return len(self.jobs)

    def _ended(self, events: Sequence[WorkEvent], moved: Callable[[Any], int]) -> list:
        """The jobs over on every rank (by the agreed ``events``), each with its event and the bytes
        ``moved`` by every rank of the group for it."""
        self.jobs, over = split_over(events, self.jobs)
        return list(zip(over, self.ranks.total([moved(job) for job, _ in over]))) if over else []

    def check_alive(self) -> None:
        self.io.check_alive()

    def close(self) -> None:
        self.io.close()


class PrefillRole(_Role):
    """``timeout_s``: how long a finished prefill waits for the decode ranks to ask."""

    def __init__(self, cache: "KVCacheManager", port: int, ranks: TPRanks, host: str = "127.0.0.1",
                 timeout_s: float = 60.0, transport: str = "zmq") -> None:
        """Rank 0 binds ``port`` (the bootstrap port; 0: any free one), the other ranks any free
        port; every rank learns all of them (a collective: every rank builds its role)."""
        super().__init__(KVSender(cache.pool, port if ranks.rank == 0 else 0, host, ranks.heads, timeout_s,
                                  _writes(transport, cache, host), _states(cache)), ranks, timeout_s)
        self.cache = cache
        mine = RankEndpoint(host, self.io.port, ranks.heads).to_wire()
        self.io.start([RankEndpoint.from_wire(item, host) for item in ranks.gather(mine)])
        # jobs: (request, its Send, its deferred finish report)

    def on_finish(self, req: Request) -> bool:
        """Start the send of ``req``'s prompt KV (held until the ranks agree it was sent). Its
        finish is reported then too, with what crossed."""
        if req.pd is None:
            return False
        if not req.output_ids:  # aborted (or failed) before its first token: nothing to send
            self.io.refuse(req.pd.bootstrap.room, f"the prefill request ended ({req.finish_reason}) before its "
                               "first token", time.perf_counter() + self.timeout_s)
            return False
        n = len(req.prompt_ids)
        job = Send(req.pd.bootstrap.room, req.kv.slots[:n], req.output_ids[0], time.perf_counter() + self.timeout_s)
        if req.kv.window is not None:  # a hybrid pool holds the window layers' rows of the tail only
            job.parts[WINDOW] = Tail(self.cache.window_tail(n), req.kv.window.slots[..., :n])
        if req.kv.state is not None:  # recurrent layers: the prompt's end state (and its checkpoint's, if held)
            job.states = self.cache.device_states.held(req.namespace, req.tokens_np[:n], req.kv.state, req.kv.node)
        self.io.submit(job)
        self.jobs.append((req, job, req.on_update))
        req.on_update = None
        return True

    def local_events(self) -> tuple[WorkEvent, ...]:
        self.check_alive()
        return tuple(WorkEvent(job.done.is_set(), not job.error) for _, job, _ in self.jobs)

    def apply_events(self, events: Sequence[WorkEvent]) -> list[Action]:
        """Release the KV of every request whose send has ended on every rank, and report it."""
        actions: list[Action] = []
        for ((req, job, report), e), total_bytes in self._ended(events, lambda item: item[1].sent_bytes):
            req.pd.transferred_tokens, req.pd.transferred_bytes = job.sent_tokens, total_bytes
            req.on_update = report
            actions.append(Release(req, report=report is not None))
            self.counters.add(failed=not e.ok, tokens=job.sent_tokens, bytes=job.sent_bytes, states=job.sent_states)
        return actions

    def stats(self) -> dict:
        """``Engine.stats()["disaggregation"]``: the mode, open transfers and this rank's counters."""
        return {"mode": "prefill", "bootstrap_port": self.io.port, "open": len(self.jobs),
                **dataclasses.asdict(self.counters)}


class DecodeRole(_Role):
    """``timeout_s``: how long a request waits for its KV before it fails; ``handshake_s``: how long
    its prefill server has to answer the first message; ``max_receiving``: most requests waiting
    for KV at once (the others wait unadmitted, holding no slot or page)."""

    def __init__(self, cache: "KVCacheManager", ranks: TPRanks, vocab_size: int, timeout_s: float = 60.0,
                 transport: str = "zmq", host: str = "127.0.0.1", handshake_s: float = 5.0,
                 max_receiving: int = 16) -> None:
        super().__init__(KVReceiver(cache.pool, ranks.heads, vocab_size, ranks.size, _writes(transport, cache, host),
                                    _states(cache), ranks.rank), ranks, timeout_s)
        self.cache, self.handshake_s, self.max_receiving = cache, handshake_s, max_receiving
        # jobs: (request, its Receive)

    def admissible(self, req: Request) -> bool:
        """A request with a bootstrap waits while ``max_receiving`` others wait for their KV: the
        running slots a client's prefill server can hold are bounded (the count is agreed state)."""
        return req.pd is None or len(self.jobs) < self.max_receiving

    def kv_arrives(self, req: Request) -> bool:
        return req.pd is not None

    def on_admit(self, req: Request) -> None:
        """``req`` was admitted with ``req.computed`` prompt tokens from local tiers (a hybrid pool:
        its full layers', the window of the prompt's end to receive): ask the prefill server for the
        rest."""
        if req.pd is None:
            return
        boot = req.pd.bootstrap
        now = time.perf_counter()
        n = len(req.prompt_ids)
        job = Receive(boot.room, boot.address, req.computed, req.kv.slots[:n], now + self.timeout_s,
                      handshake_deadline=now + self.handshake_s)
        arrival = req.kv.window.arrival if req.kv.window is not None else None
        if arrival is not None:
            job.parts[WINDOW] = Tail(arrival[0], arrival[1][..., :n])
        if req.kv.state is not None:  # recurrent layers: their states arrive whole, not per page
            job.states = self.cache.device_states.arriving(req.namespace, req.tokens_np[:n], req.kv.state)
        req.pd.decode_prefix_len = req.computed
        self.io.submit(job)
        self.jobs.append((req, job))
        if self.ranks.rank == 0:
            logger.info("P/D decode rid=%d room=%d: decode_prefix_len=%d of %d, asking %s for the rest",
                        req.rid, job.room, req.computed, len(req.prompt_ids), job.address)

    def on_finish(self, req: Request) -> bool:
        """An aborted request still receiving: its pages stay held until the transfer ends."""
        return any(r is req for r, _ in self.jobs)

    def local_events(self) -> tuple[WorkEvent, ...]:
        """Over: the KV arrived (or the transfer failed) and the local restore of the host
        part is done (decoding must not read a page still being restored)."""
        self.check_alive()
        restored = self.cache.kv_view.layer_ready(len(self.cache.pool.k_buffers) - 1)
        return tuple(WorkEvent(job.done.is_set() and (bool(job.error) or restored), not job.error)
                     for _, job in self.jobs)

    def apply_events(self, events: Sequence[WorkEvent]) -> list[Action]:
        """Start decoding every request whose KV arrived on every rank; fail those whose
        transfer failed on any; release what aborted requests held."""
        actions: list[Action] = []
        for ((req, job), e), total_bytes in self._ended(events, lambda item: item[1].received_bytes):
            if req.kv.state is not None:  # snapshot slots taken for states that did not come are free again
                self.cache.device_states.arrived(req.kv.state, job.states_got if e.ok else ())
            if req.status is Status.FINISHED:  # aborted meanwhile
                actions.append(Release(req))
                continue
            if not e.ok:
                self.counters.add(failed=1)
                error = job.error or "the KV transfer failed on another rank of this server"
                logger.warning("P/D decode rid=%d room=%d failed: %s", req.rid, job.room, error)
                actions.append(Fail(req, error, KV_TRANSFER_FAILED))
                continue
            self.counters.add(tokens=job.received_tokens, bytes=job.received_bytes, seconds=job.seconds,
                              decode_prefix_tokens=job.decode_prefix_len, states=len(job.states_got))
            req.pd.transferred_tokens, req.pd.transferred_bytes = job.received_tokens, total_bytes
            actions.append(StartDecode(req, job.first_token))
        return actions

    def stats(self) -> dict:
        """``Engine.stats()["disaggregation"]``: the mode, open transfers and this rank's counters."""
        return {"mode": "decode", "open": len(self.jobs), "max_receiving": self.max_receiving,
                **dataclasses.asdict(self.counters)}


def build(ctx: ModeContext) -> Mode | None:
    """This rank's part in prefill/decode disaggregation (``--disaggregation-mode``), if any."""
    cfg = ctx.cfg
    host = cfg.disaggregation_bootstrap_host or "127.0.0.1"
    if cfg.disaggregation_mode == "prefill":  # (a prefill TP group gathers its route here)
        return PrefillRole(ctx.cache, cfg.disaggregation_bootstrap_port, ctx.pd_ranks, host,
                           cfg.disaggregation_transfer_timeout, cfg.disaggregation_transfer_backend)
    if cfg.disaggregation_mode == "decode":
        return DecodeRole(ctx.cache, ctx.pd_ranks, ctx.vocab_size, cfg.disaggregation_transfer_timeout,
                          cfg.disaggregation_transfer_backend, host, cfg.disaggregation_handshake_timeout,
                          cfg.max_receiving)
    return None
