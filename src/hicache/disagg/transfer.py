"""KV transfer between a prefill and a decode server over ZeroMQ (``--disaggregation-transfer-backend zmq``).

Protocol (one request = one *room*, the ``bootstrap_room`` the router gave both servers):

1. The decode server admits the request against its own tree and reserves device pages for
   what it lacks; it sends ``{"room", "decode_prefix_len", "prompt_len"}`` to the prefill
   server's bootstrap socket (a ROUTER bound on ``--disaggregation-bootstrap-port``) from a
   DEALER of its own.
2. The prefill server computes the prompt (its own cache decides how much), samples the first
   token, and sends back to that DEALER one multipart message: a JSON header
   ``{"room", "first_token", "start", "end", "layers", "row_bytes"}`` then, per layer, the K rows
   and the V rows of tokens ``[start, end)`` (``start = decode_prefix_len``): raw bytes, no
   pickling. ``{"room", "error"}`` instead when it cannot.
3. The decode server copies the rows into its reserved slots, layer by layer.

Units: ``decode_prefix_len``, ``start``, ``end`` are tokens of the prompt; a row is one token of
one layer's K (or V): ``kv_heads x head_dim`` elements of the pool's dtype.

Threads: each side runs one I/O thread that owns its sockets (ZeroMQ sockets are not thread
safe); the scheduler thread hands it work through a queue and reads results from events.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
import warnings
from typing import TYPE_CHECKING, Optional

import torch

from ..cache.pools import DeviceKVPool

if TYPE_CHECKING:
    from .mooncake_writes import MooncakeWrites

logger = logging.getLogger(__name__)

POLL_MS = 50


@dataclass
class Send:
    """Prefill side: send ``room``'s tokens from ``decode_prefix_len`` to ``len(slots)`` (its KV at ``slots``)."""

    room: int
    slots: torch.Tensor  # the prompt's device slots, one per token
    first_token: int
    deadline: float  # give up waiting for the decode server's request then (perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""
    sent_tokens: int = 0
    sent_bytes: int = 0


@dataclass
class Receive:
    """Decode side: receive ``room``'s tokens ``[decode_prefix_len, len(slots))`` into ``slots``."""

    room: int
    address: str  # the prefill server's bootstrap endpoint, tcp://host:port
    decode_prefix_len: int
    slots: torch.Tensor
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    first_token: int = -1
    error: str = ""
    received_tokens: int = 0
    received_bytes: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0  # submitted -> rows stored


def _raw(rows: torch.Tensor) -> memoryview:
    """Contiguous rows as bytes (numpy has no bfloat16: viewed as bytes first)."""
    return rows.cpu().contiguous().view(torch.uint8).numpy().data


def _rows(pool: DeviceKVPool) -> int:
    k = pool.k_buffers[0]
    return k[0].numel() * k.element_size()


class KVSender:
    """The prefill server's side: binds the bootstrap socket, matches decode requests to
    finished prefills by room, streams the rows. ``submit`` is called on the scheduler thread."""

    def __init__(self, pool: DeviceKVPool, port: int, host: str = "127.0.0.1",
                 writes: Optional["MooncakeWrites"] = None) -> None:
        """``writes``: move rows with Mooncake's transfer engine instead of message frames."""
        import zmq

        self.pool, self.writes = pool, writes
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port(f"tcp://{host}") if port == 0 else port
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        self._jobs: queue.Queue[Optional[Send]] = queue.Queue()
        self._wanted: dict[int, tuple[bytes, dict]] = {}  # room -> (decode identity, its request)
        self._waiting: dict[int, Send] = {}  # room -> prefill done, decode not heard from yet
        self._thread = threading.Thread(target=self._run, name="hicache-kv-sender", daemon=True)
        self._thread.start()
        logger.info("P/D prefill: bootstrap socket on %s:%d", host, self.port)

    def submit(self, job: Send) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while True:
                for _ in dict(poller.poll(POLL_MS)):
                    ident, raw = self._sock.recv_multipart()
                    msg = json.loads(raw)
                    self._wanted[int(msg["room"])] = (ident, msg)
                if not self._drain_jobs():
                    return
                self._match()
        finally:
            for job in self._waiting.values():
                job.error = "the prefill server stopped"
                job.done.set()
            self._sock.close()

    def _drain_jobs(self) -> bool:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return True
            if job is None:
                return False
            self._waiting[job.room] = job

    def _match(self) -> None:
        now = time.perf_counter()
        for room, job in list(self._waiting.items()):
            if room in self._wanted:
                ident, msg = self._wanted.pop(room)
                del self._waiting[room]
                self._send(ident, msg, job)
            elif now > job.deadline:
                del self._waiting[room]
                job.error = f"no decode server asked for room {room} in time"
                logger.warning("P/D prefill room=%d: %s", room, job.error)
                job.done.set()

    def _send(self, ident: bytes, msg: dict, job: Send) -> None:
        """One multipart message: header, then K and V rows of every layer for the suffix."""
        start, end = int(msg["decode_prefix_len"]), len(job.slots)
        try:
            if int(msg["prompt_len"]) != end or not 0 <= start <= end:
                raise ValueError(f"decode asked for tokens {start}-{msg['prompt_len']} of a {end}-token prompt")
            if (self.writes is None) != ("mooncake" not in msg):
                raise ValueError("the two servers use different --disaggregation-transfer-backend settings")
            header = {"room": job.room, "first_token": job.first_token, "start": start, "end": end,
                      "layers": len(self.pool.k_buffers), "row_bytes": _rows(self.pool)}
            frames = []
            if self.writes is not None:  # the rows are in the decode pool already when this returns
                header["written"] = job.sent_bytes = self.writes.write(msg["mooncake"], job.slots, start, end)
            else:
                idx = job.slots[start:end]
                for k, v in zip(self.pool.k_buffers, self.pool.v_buffers):
                    frames += [_raw(k.index_select(0, idx)), _raw(v.index_select(0, idx))]
                job.sent_bytes = sum(f.nbytes for f in frames)
            self._sock.send_multipart([ident, json.dumps(header).encode(), *frames], copy=False)
            job.sent_tokens = end - start
            logger.info("P/D prefill room=%d: sent tokens %d-%d (%d bytes)", job.room, start, end, job.sent_bytes)
        except Exception as e:  # the decode side must hear why, or it waits for its deadline
            job.error = str(e)
            self._sock.send_multipart([ident, json.dumps({"room": job.room, "error": job.error}).encode()])
            logger.warning("P/D prefill room=%d: %s", job.room, job.error)
        job.done.set()


class KVReceiver:
    """The decode server's side: one DEALER per prefill endpoint; writes received rows into
    the reserved slots. ``submit`` is called on the scheduler thread."""

    def __init__(self, pool: DeviceKVPool, writes: Optional["MooncakeWrites"] = None) -> None:
        """``writes``: the prefill server writes rows into this pool with Mooncake's transfer engine."""
        import zmq

        self.pool, self.writes = pool, writes
        self._ctx = zmq.Context.instance()
        self._jobs: queue.Queue[Optional[Receive]] = queue.Queue()
        self._open: dict[int, Receive] = {}
        self._socks: dict[str, object] = {}
        self._poller = zmq.Poller()
        self._thread = threading.Thread(target=self._run, name="hicache-kv-receiver", daemon=True)
        self._thread.start()

    def submit(self, job: Receive) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def _socket(self, address: str):
        import zmq

        sock = self._socks.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._poller.register(sock, zmq.POLLIN)
            self._socks[address] = sock
        return sock

    def _run(self) -> None:
        try:
            while self._take_jobs():
                for sock, _ in self._poller.poll(POLL_MS) if self._socks else []:
                    self._on_message(sock.recv_multipart(copy=False))
                self._expire(time.perf_counter())
        finally:
            for job in self._open.values():
                job.error = "the decode server stopped"
                job.done.set()
            for sock in self._socks.values():
                sock.close()

    def _take_jobs(self) -> bool:
        while True:
            try:
                job = self._jobs.get(timeout=POLL_MS / 1000) if not self._socks and not self._open \
                    else self._jobs.get_nowait()
            except queue.Empty:
                return True
            if job is None:
                return False
            self._open[job.room] = job
            msg = {"room": job.room, "decode_prefix_len": job.decode_prefix_len, "prompt_len": len(job.slots)}
            if self.writes is not None:
                msg["mooncake"] = self.writes.describe(job.slots, job.decode_prefix_len, len(job.slots))
            self._socket(job.address).send(json.dumps(msg).encode())

    def _on_message(self, frames: list) -> None:
        header = json.loads(frames[0].bytes)
        job = self._open.pop(int(header["room"]), None)
        if job is None:
            return  # a request that was aborted or timed out meanwhile
        if "error" in header:
            job.error = f"the prefill server reported: {header['error']}"
        else:
            self._store(job, header, frames[1:])
        job.done.set()

    def _store(self, job: Receive, header: dict, frames: list) -> None:
        start, end, layers = int(header["start"]), int(header["end"]), int(header["layers"])
        want_frames = 0 if "written" in header else 2 * layers
        if start != job.decode_prefix_len or end != len(job.slots) or layers != len(self.pool.k_buffers) \
                or int(header["row_bytes"]) != _rows(self.pool) or len(frames) != want_frames:
            job.error = f"the prefill server sent tokens {start}-{end} of {layers} layers, not what was asked"
            return
        if "written" in header:  # Mooncake: the rows were written into the reserved pages
            job.received_bytes = int(header["written"])
        else:
            job.received_bytes = self._copy_frames(job.slots[start:end], frames)
        job.first_token = int(header["first_token"])
        job.received_tokens = end - start
        job.seconds = time.perf_counter() - job.submitted

    def _copy_frames(self, idx: torch.Tensor, frames: list) -> int:
        for i, (k, v) in enumerate(zip(self.pool.k_buffers, self.pool.v_buffers)):
            for buf, frame in ((k, frames[2 * i]), (v, frames[2 * i + 1])):
                with warnings.catch_warnings():  # a read-only frame: only read from
                    warnings.simplefilter("ignore", UserWarning)
                    rows = torch.frombuffer(frame.buffer, dtype=buf.dtype).view(len(idx), *buf.shape[1:])
                buf.index_copy_(0, idx, rows.to(buf.device))
        return sum(len(f.buffer) for f in frames)

    def _expire(self, now: float) -> None:
        for room, job in list(self._open.items()):
            if now > job.deadline:
                del self._open[room]
                job.error = f"no KV from the prefill server at {job.address} in time"
                job.done.set()

