"""The prefill side of a KV transfer (protocol: :mod:`hicache.disagg.transfer`): one per rank."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Optional

import torch

from ..cache.pools import DeviceKVPool
from .heads import RankEndpoint
from .transfer import POLL_MS, Send, head_bytes, raw

if TYPE_CHECKING:
    from .mooncake_writes import MooncakeWrites

logger = logging.getLogger(__name__)


class KVSender:
    """Binds this rank's KV socket (rank 0's is the bootstrap socket and also answers route
    asks), matches asks to finished prefills by room and answers them. ``heads``: the
    model-global KV heads of ``pool``. ``submit`` is called on the scheduler thread."""

    def __init__(self, pool: DeviceKVPool, port: int, host: str, heads: range,
                 writes: Optional["MooncakeWrites"] = None) -> None:
        """``port`` 0: any free port. ``writes``: move rows with Mooncake's transfer engine
        instead of message frames. Answers nothing until :meth:`start`."""
        import zmq

        self.pool, self.heads, self.writes = pool, heads, writes
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port(f"tcp://{host}") if port == 0 else port
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        self.host = host
        self.route: list[RankEndpoint] = []
        self._jobs: queue.Queue[Optional[Send]] = queue.Queue()
        self._asks: dict[int, list[tuple[bytes, dict]]] = {}  # room -> asks not answered yet
        self._waiting: dict[int, Send] = {}  # room -> prefill done, asks outstanding
        self._thread = threading.Thread(target=self._run, name="hicache-kv-sender", daemon=True)

    def start(self, route: list[RankEndpoint]) -> None:
        """Serve; ``route``: every prefill rank of this server (answered to route asks)."""
        self.route = route
        self._thread.start()

    def submit(self, job: Send) -> None:
        self._jobs.put(job)

    def refuse(self, room: int, reason: str, deadline: float) -> None:
        """Answer ``room``'s asks with ``reason`` (its prefill ended without KV to send)."""
        self.submit(Send(room, torch.empty(0, dtype=torch.long), -1, deadline, error=reason))

    def close(self) -> None:
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while True:
                for _ in dict(poller.poll(POLL_MS)):
                    self._on_message(self._sock.recv_multipart())
                if not self._drain_jobs():
                    return
                self._match()
        finally:
            for job in self._waiting.values():
                job.error = "the prefill server stopped"
                job.done.set()
            self._sock.close()

    def _on_message(self, frames: list[bytes]) -> None:
        """A route ask (answered at once) or a KV ask (kept until its room's prefill is done or
        it expires); anything else is logged and dropped: the socket listens on the network."""
        try:
            ident, raw_msg = frames
            msg = json.loads(raw_msg)
            if "route" in msg:
                k = self.pool.k_buffers[0]
                answer = {"route": [r.to_wire() for r in self.route], "layers": len(self.pool.k_buffers),
                          "head_bytes": head_bytes(self.pool), "dtype": str(k.dtype)}
                self._sock.send_multipart([ident, json.dumps(answer).encode()])
                return
            room, askers = int(msg["room"]), int(msg["askers"])
            expires = time.perf_counter() + float(msg["expires_in"])
            if askers < 1 or not isinstance(msg["heads"], list) or "prompt_len" not in msg:
                raise ValueError("not an ask")
        except (ValueError, TypeError, KeyError) as e:  # (json's errors are ValueErrors)
            logger.warning("P/D prefill: dropped a malformed message on the bootstrap socket (%s)", e)
            return
        self._asks.setdefault(room, []).append((ident, msg, expires))

    def _drain_jobs(self) -> bool:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return True
            if job is None:
                return False
            if job.room in self._waiting:  # a client reused a room: the first one keeps it
                job.error = f"room {job.room} is already in use on this prefill server"
                job.done.set()
                continue
            self._waiting[job.room] = job

    def _match(self) -> None:
        now = time.perf_counter()
        for room, job in list(self._waiting.items()):
            for ident, msg, expires in self._asks.pop(room, []):
                job.askers = int(msg["askers"])
                if now > expires:  # that decode rank gave up (its pages may be someone else's now)
                    job.error, job.answered = f"the decode side gave up on room {room}", job.answered + 1
                else:
                    self._answer(ident, msg, job)
            if job.askers and job.answered >= job.askers:
                del self._waiting[room]
                job.done.set()
            elif now > job.deadline:
                del self._waiting[room]
                job.error = job.error or f"not every decode rank asked for room {room} in time ({job.answered} did)"
                logger.warning("P/D prefill room=%d: %s", room, job.error)
                job.done.set()
        for room, asks in list(self._asks.items()):  # asks for rooms this server never had (aborted, or none)
            self._asks[room] = [a for a in asks if a[2] >= now]
            if not self._asks[room]:
                del self._asks[room]

    def _answer(self, ident: bytes, msg: dict, job: Send) -> None:
        """One multipart message: header, then K and V rows of every layer for the suffix and
        the asked heads (or only the header when Mooncake wrote them)."""
        try:
            if job.error:  # refused before it could compute (see refuse)
                raise ValueError(job.error)
            start, end = int(msg["decode_prefix_len"]), len(job.slots)
            heads = range(*msg["heads"])
            if int(msg["prompt_len"]) != end or not 0 <= start <= end:
                raise ValueError(f"decode asked for tokens {start}-{msg['prompt_len']} of a {end}-token prompt")
            if heads and not (self.heads.start <= heads.start and heads.stop <= self.heads.stop):
                raise ValueError(f"decode asked for KV heads {heads.start}-{heads.stop - 1}; this rank holds "
                                 f"{self.heads.start}-{self.heads.stop - 1}")
            if (self.writes is None) != ("mooncake" not in msg):
                raise ValueError("the two servers use different --disaggregation-transfer-backend settings")
            local = range(heads.start - self.heads.start, heads.stop - self.heads.start)
            header = {"room": job.room, "first_token": job.first_token, "start": start, "end": end,
                      "layers": len(self.pool.k_buffers), "heads": [heads.start, heads.stop],
                      "head_bytes": head_bytes(self.pool)}
            frames = []
            if self.writes is not None:  # the rows are in the decode pool already when this returns
                header["written"] = sent = self.writes.write(msg["mooncake"], job.slots, start, end, local)
            elif heads:
                idx = job.slots[start:end]
                for k, v in zip(self.pool.k_buffers, self.pool.v_buffers):
                    frames += [raw(k.index_select(0, idx)[:, local.start:local.stop]),
                               raw(v.index_select(0, idx)[:, local.start:local.stop])]
                sent = sum(f.nbytes for f in frames)
            else:
                sent = 0
            self._sock.send_multipart([ident, json.dumps(header).encode(), *frames], copy=False)
            job.sent_bytes += sent
            job.sent_tokens = end - start
            logger.info("P/D prefill room=%d: sent tokens %d-%d, KV heads %d-%d (%d bytes)", job.room, start, end,
                        heads.start, heads.stop - 1, sent)
        except Exception as e:  # the decode side must hear why, or it waits for its deadline
            job.error = str(e)
            self._sock.send_multipart([ident, json.dumps({"room": job.room, "error": job.error}).encode()])
            logger.warning("P/D prefill room=%d: %s", job.room, job.error)
        job.answered += 1
