"""A server's part in prefill/decode disaggregation (``--disaggregation-mode``), as hooks the
scheduler calls at fixed points: when a request is admitted, when it finishes, and once per step.

* :class:`PrefillRole`: a request with a bootstrap computes its prompt and first token as usual;
  at finish its KV stays held (not released to the tree) until the sender has streamed the
  tokens after the decode server's ``decode_prefix_len`` (or given up), then it is released.
* :class:`DecodeRole`: a request with a bootstrap is admitted against this server's own tiers
  (device hits locked, host hits restored layer by layer into reserved pages, storage hits
  only once their prefetch was accepted); ``decode_prefix_len`` is what admission found (whole
  pages). It then waits, holding its pages, until the suffix's KV has arrived *and* the local
  restore is done, and decodes from the prefill server's first token. If either fails, the
  request ends with an error and everything it held is released.

Requests without a bootstrap run as on any engine (handy for tests and warm-up).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..engine.request import Status
from .transfer import KVReceiver, KVSender, Receive, Send

if TYPE_CHECKING:
    from ..cache.manager import KVCacheManager
    from ..engine.request import Request
    from ..engine.scheduler import Scheduler
    from .mooncake_writes import MooncakeWrites

logger = logging.getLogger(__name__)


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


def _writes(backend: str, cache: "KVCacheManager", host: str) -> "MooncakeWrites | None":
    """The Mooncake transfer engine for ``--disaggregation-transfer-backend mooncake``, else None
    (rows travel in the ZeroMQ messages)."""
    if backend != "mooncake":
        return None
    from .mooncake_writes import MooncakeWrites

    return MooncakeWrites(cache.pool, host)


class PDRole(Protocol):
    """The scheduler's hooks (each called on the scheduler thread)."""

    def on_admit(self, req: "Request") -> bool:
        """``req`` was just admitted; True: it waits for remote KV instead of computing its prompt."""
        ...

    def on_finish(self, req: "Request") -> bool:
        """``req`` finished; True: a transfer still uses its KV, :meth:`poll` releases it later."""
        ...

    def poll(self, sched: "Scheduler", finished: list["Request"]) -> None:
        """Act on transfers that ended since the last step (requests that finish go to ``finished``)."""
        ...

    @property
    def busy(self) -> bool:
        """Transfers are open (the scheduler must keep stepping to finish them)."""
        ...

    def snapshot(self) -> dict:
        """``Engine.stats()["disaggregation"]``: the mode, open transfers and the counters."""
        ...

    def close(self) -> None: ...


class PrefillRole:
    """``timeout_s``: how long a finished prefill waits for its decode server to ask."""

    def __init__(self, cache: "KVCacheManager", port: int, host: str = "127.0.0.1", timeout_s: float = 60.0,
                 backend: str = "zmq") -> None:
        self.timeout_s = timeout_s
        self.sender = KVSender(cache.pool, port, host, _writes(backend, cache, host))
        self.port = self.sender.port
        self.sending: list[tuple["Request", Send]] = []
        self.stats = TransferStats()

    def on_admit(self, req: "Request") -> bool:
        return False

    def on_finish(self, req: "Request") -> bool:
        """Start the send of ``req``'s prompt KV (held until :meth:`poll` sees it sent)."""
        if req.bootstrap is None or not req.output_ids:
            return False
        job = Send(req.bootstrap.room, req.kv.slots[: len(req.prompt_ids)], req.output_ids[0],
                   time.perf_counter() + self.timeout_s)
        self.sender.submit(job)
        self.sending.append((req, job))
        return True

    def poll(self, sched: "Scheduler", finished: list["Request"]) -> None:
        """Release the KV of every request whose send has ended."""
        for item in [s for s in self.sending if s[1].done.is_set()]:
            self.sending.remove(item)
            req, job = item
            req.transferred_tokens, req.transferred_bytes = job.sent_tokens, job.sent_bytes
            sched.release_kv(req)
            s = self.stats
            s.requests += 1
            s.failed += bool(job.error)
            s.tokens += job.sent_tokens
            s.bytes += job.sent_bytes

    @property
    def busy(self) -> bool:
        return bool(self.sending)

    def snapshot(self) -> dict:
        return {"mode": "prefill", "bootstrap_port": self.port, "open": len(self.sending),
                **dataclasses.asdict(self.stats)}

    def close(self) -> None:
        self.sender.close()


class DecodeRole:
    """``timeout_s``: how long a request waits for its KV before it fails."""

    def __init__(self, cache: "KVCacheManager", timeout_s: float = 60.0, backend: str = "zmq",
                 host: str = "127.0.0.1") -> None:
        self.cache, self.timeout_s = cache, timeout_s
        self.receiver = KVReceiver(cache.pool, _writes(backend, cache, host))
        self.receiving: list[tuple["Request", Receive]] = []
        self.stats = TransferStats()

    def on_admit(self, req: "Request") -> bool:
        """``req`` was admitted with ``req.computed`` prompt tokens from local tiers: ask the
        prefill server for the rest."""
        if req.bootstrap is None:
            return False
        job = Receive(req.bootstrap.room, req.bootstrap.address, req.computed, req.kv.slots[: len(req.prompt_ids)],
                      time.perf_counter() + self.timeout_s)
        req.decode_prefix_len = req.computed
        self.receiver.submit(job)
        self.receiving.append((req, job))
        logger.info("P/D decode rid=%d room=%d: decode_prefix_len=%d of %d, asking %s for the rest",
                    req.rid, job.room, req.computed, len(req.prompt_ids), job.address)
        return True

    def on_finish(self, req: "Request") -> bool:
        """An aborted request still receiving: its pages stay held until the transfer ends."""
        return any(r is req for r, _ in self.receiving)

    def poll(self, sched: "Scheduler", finished: list["Request"]) -> None:
        """Start decoding every request whose KV has arrived and whose local restore is done;
        fail those whose transfer failed; release what aborted requests held."""
        last_layer = len(self.cache.pool.k_buffers) - 1
        for item in [r for r in self.receiving if r[1].done.is_set()]:
            req, job = item
            if not job.error and not self.cache.kv_view.layer_ready(last_layer):
                continue  # the host part is still being restored
            self.receiving.remove(item)
            if req.status is Status.FINISHED:  # aborted meanwhile
                sched.release_kv(req)
                continue
            s = self.stats
            s.requests += 1
            if job.error:
                s.failed += 1
                logger.warning("P/D decode rid=%d room=%d failed: %s", req.rid, job.room, job.error)
                sched.fail(req, job.error, finished)
                continue
            s.tokens += job.received_tokens
            s.bytes += job.received_bytes
            s.seconds += job.seconds
            s.decode_prefix_tokens += job.decode_prefix_len
            req.transferred_tokens, req.transferred_bytes = job.received_tokens, job.received_bytes
            sched.start_decode(req, job.first_token, finished)

    @property
    def busy(self) -> bool:
        return bool(self.receiving)

    def snapshot(self) -> dict:
        return {"mode": "decode", "open": len(self.receiving), **dataclasses.asdict(self.stats)}

    def close(self) -> None:
        self.receiver.close()
