"""KV transfer between a prefill and a decode server: the jobs and the wire format shared by
:mod:`~hicache.disagg.sender` (prefill ranks) and :mod:`~hicache.disagg.receiver` (decode ranks).

Protocol (one request = one *room*, the ``bootstrap_room`` the router gave both servers):

1. **Route.** A decode rank asks the prefill server's bootstrap socket (a ROUTER bound on
   ``--disaggregation-bootstrap-port`` by its rank 0) ``{"route": 1}`` once per prefill server;
   the answer lists every prefill rank's KV socket and the model-global KV heads it holds
   (``{"route": [[host, port, first_head, end_head], ...], "layers", "head_bytes"}``).
2. **Ask.** The decode server admits the request against its own tiers and reserves device
   pages for what it lacks; each of its ranks sends every prefill rank
   ``{"room", "decode_prefix_len", "prompt_len", "heads": [a, b], "askers"}``: the heads that
   rank supplies to it (:func:`~hicache.disagg.heads.heads_from`; often none) and how many
   decode ranks ask (its TP size), from a DEALER of its own. A hybrid decode pool adds
   ``"window_start", "window_layers"``: those layers' rows are asked from ``window_start`` on
   (the fresh SWA tail, :mod:`~hicache.disagg.window_tail`), whatever ``decode_prefix_len`` is.
   A decode pool with recurrent layers adds ``"state_at", "state_bytes"`` to its ask of the
   prefill rank of its own index: the states it needs whole (no rows per token).
3. **Answer.** A prefill rank, once the request's prompt is computed (its own cache decides
   how much) and its first token sampled, answers each ask with one multipart message: a JSON
   header ``{"room", "first_token", "start", "end", "layers", "heads", "head_bytes"}`` then, per
   layer, the K rows and the V rows of tokens ``[start, end)`` (``start = decode_prefix_len``;
   ``[window_start, end)`` for the asked window layers, echoed in the header) restricted to the
   asked heads: raw bytes, no pickling; then the recurrent states asked (``state_at``,
   :mod:`~hicache.disagg.state_tail`: the prompt's end, maybe its checkpoint), a frame per tensor. ``{"room", "error"}`` when it cannot.
   Its KV stays held until every asker was answered (or the timeout).
4. **Store.** The decode rank copies the rows into its reserved slots (its own head positions);
   its job is done when every prefill rank answered.

Units: ``decode_prefix_len``, ``start``, ``end`` are tokens of the prompt; heads are the model's
KV heads (an MLA latent counts as one head, held by every rank); ``head_bytes`` is one token's
one head of one layer's K (or V): ``head_dim`` elements of the pool's dtype.

Threads: each side runs one I/O thread that owns its sockets (ZeroMQ sockets are not thread
safe); the scheduler thread hands it work through a queue and reads results from events.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache.pools import DeviceKVPool
from ..errors import EngineDeadError
from .window_tail import Tail

logger = logging.getLogger(__name__)

POLL_MS = 50


class IOThread:
    """The one thread that owns a side's sockets. It must never die; if it does (a bug),
    :attr:`failure` says why and :meth:`check_alive` raises, so the engine reports itself dead
    (``/health`` 503, the server exits non-zero) instead of failing every transfer at its
    timeout while looking healthy."""

    name = "hicache-kv-io"
    server = ""  # "prefill" | "decode": this side, in messages

    def __init__(self) -> None:
        self.failure: str | None = None
        self.closing = False  # close() was called: the thread ends
        self._jobs: queue.Queue[Any] = queue.Queue()  # from the scheduler thread; None: close
        self._thread = threading.Thread(target=self._guarded, name=self.name, daemon=True)

    def submit(self, job: Any) -> None:
        """Called on the scheduler thread."""
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _serve(self) -> None:
        raise NotImplementedError

    def _guarded(self) -> None:
        try:
            self._serve()
        except BaseException as e:
            self.failure = f"{type(e).__name__}: {e}"
            logger.exception("P/D: the %s thread died", self.name)

    def _take_jobs(self, open_jobs: dict[int, Any], wait: bool = False) -> list:
        """The jobs submitted since the last call, each now in ``open_jobs`` by room (waiting up to
        a poll for the first when ``wait``); sets :attr:`closing` once :meth:`close` was called. A
        job for a room that is open already fails at once (a client reused it: the first keeps it)."""
        taken: list = []
        while True:
            try:
                job = self._jobs.get(timeout=POLL_MS / 1000) if wait and not taken else self._jobs.get_nowait()
            except queue.Empty:
                return taken
            if job is None:
                self.closing = True
                return taken
            if job.room in open_jobs:
                job.error = f"room {job.room} is already in use on this {self.server} server"
                job.done.set()
            else:
                open_jobs[job.room] = job
                taken.append(job)

    def _stopped(self, open_jobs: dict[int, Any]) -> None:
        """The thread ends: every open job fails."""
        for job in open_jobs.values():
            job.error = job.error or f"the {self.server} server stopped"
            job.done.set()

    def check_alive(self) -> None:
        """Raises EngineDeadError once the thread has died."""
        if self.failure is not None:
            raise EngineDeadError(f"the P/D transfer thread {self.name} died ({self.failure})")


@dataclass
class Send:
    """Prefill side: answer the asks for ``room`` with tokens from ``decode_prefix_len`` to
    ``len(slots)`` of this rank's pool."""

    room: int
    slots: torch.Tensor  # the prompt's device slots, one per token
    first_token: int
    deadline: float  # give up waiting for the decode ranks' asks then (perf_counter)
    parts: dict[str, Tail] = field(default_factory=dict)  # by component: rows held apart (a hybrid pool's window)
    states: dict[int, int] = field(default_factory=dict)  # recurrent states held: position -> state slot
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""
    askers: int = 0  # decode ranks that ask (their TP size; 0: none heard from yet)
    answered: int = 0  # asks answered (rows or an error)
    sent_tokens: int = 0
    sent_bytes: int = 0
    sent_states: int = 0


@dataclass
class Receive:
    """Decode side: receive ``room``'s tokens ``[decode_prefix_len, len(slots))`` into ``slots``
    from every prefill rank that holds some of this rank's heads."""

    room: int
    address: str  # the prefill server's bootstrap endpoint, tcp://host:port
    decode_prefix_len: int
    slots: torch.Tensor
    deadline: float
    parts: dict[str, Tail] = field(default_factory=dict)  # by component: rows asked apart (a hybrid pool's window)
    states: dict[int, int] = field(default_factory=dict)  # recurrent states asked: position -> slot (end first)
    states_from: str = ""  # the prefill rank asked for them (the one of this rank's index)
    states_got: tuple[int, ...] = ()  # the positions whose state arrived
    handshake_deadline: float = float("inf")  # the prefill server's route must come by then
    done: threading.Event = field(default_factory=threading.Event)
    first_token: int = -1
    error: str = ""
    received_tokens: int = 0
    received_bytes: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0  # submitted -> rows stored
    asked: dict[str, range] = field(default_factory=dict)  # prefill rank's address -> heads; until it answers

    def fail(self, error: str) -> None:
        """Keep the first error (the others follow from it)."""
        self.error = self.error or error


def raw(rows: torch.Tensor) -> memoryview:
    """Rows as contiguous bytes (numpy has no bfloat16: viewed as bytes first)."""
    return rows.cpu().contiguous().view(torch.uint8).numpy().data


def head_bytes(pool: DeviceKVPool) -> int:
    """Bytes of one token's one KV head of one layer's K (or V) buffer."""
    k = pool.k_buffers[0]
    return k.shape[-1] * k.element_size()
