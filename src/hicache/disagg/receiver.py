"""The decode side of a KV transfer (protocol: :mod:`hicache.disagg.transfer`): one per rank."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import warnings
from typing import TYPE_CHECKING, Optional
from urllib.parse import urlsplit

import torch

from ..cache.pools import DeviceKVPool
from .heads import RankEndpoint, heads_from
from .transfer import POLL_MS, Receive, head_bytes

if TYPE_CHECKING:
    from .mooncake_writes import MooncakeWrites

logger = logging.getLogger(__name__)

WRITE_GRACE_S = 2.0  # Mooncake: a prefill rank's write started in time lands within this (see _ask)


class KVReceiver:
    """Learns each prefill server's route once, asks its ranks for this rank's heads (one
    DEALER per endpoint) and writes the received rows into the reserved slots. ``heads``: the
    model-global KV heads of ``pool``; ``askers``: this server's TP size (how many of its ranks
    ask each prefill rank). ``submit`` is called on the scheduler thread."""

    def __init__(self, pool: DeviceKVPool, heads: range, askers: int = 1,
                 writes: Optional["MooncakeWrites"] = None) -> None:
        """``writes``: the prefill ranks write rows into this pool with Mooncake's transfer engine."""
        import zmq

        self.pool, self.heads, self.askers, self.writes = pool, heads, askers, writes
        self._ctx = zmq.Context.instance()
        self._jobs: queue.Queue[Optional[Receive]] = queue.Queue()
        self._open: dict[int, Receive] = {}  # room -> asked (or waiting for the route)
        self._routes: dict[str, list[RankEndpoint]] = {}  # bootstrap address -> its prefill ranks
        self._routing: dict[str, list[Receive]] = {}  # bootstrap address -> jobs waiting for its route
        self._socks: dict[str, object] = {}
        self._addresses: dict[object, str] = {}
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
            self._socks[address], self._addresses[sock] = sock, address
        return sock

    def _run(self) -> None:
        try:
            while self._take_jobs():
                for sock, _ in self._poller.poll(POLL_MS) if self._socks else []:
                    self._on_message(self._addresses[sock], sock.recv_multipart(copy=False))
                self._expire(time.perf_counter())
        finally:
            for job in self._open.values():
                job.fail("the decode server stopped")
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
            if job.room in self._open:  # a client reused a room: the first one keeps it
                job.fail(f"room {job.room} is already in use on this decode server")
                job.done.set()
                continue
            self._open[job.room] = job
            if job.address in self._routes:
                self._ask(job, self._routes[job.address])
            else:
                if job.address not in self._routing:
                    self._socket(job.address).send(json.dumps({"route": 1}).encode())
                self._routing.setdefault(job.address, []).append(job)

    def _ask(self, job: Receive, route: list[RankEndpoint]) -> None:
        """Ask every prefill rank for the heads it supplies to this rank (maybe none)."""
        try:
            parts = heads_from(route, self.heads)
        except ValueError as e:
            return self._end(job, str(e))
        start, end = job.decode_prefix_len, len(job.slots)
        # A prefill rank answers no ask after this (its clock). Mooncake: it starts no write after
        # it either, so a write lands before our deadline (when the pages may go to another
        # request) if it takes under the grace; zmq rows that come late are dropped here.
        left = job.deadline - time.perf_counter()
        expires_in = max(left - (min(WRITE_GRACE_S, left / 4) if self.writes is not None else 0.0), 0.0)
        for rank, heads in zip(route, parts):
            msg = {"room": job.room, "decode_prefix_len": start, "prompt_len": end,
                   "heads": [heads.start, heads.stop], "askers": self.askers, "expires_in": expires_in}
            if self.writes is not None:
                local = range(heads.start - self.heads.start, heads.stop - self.heads.start)
                msg["mooncake"] = self.writes.describe(job.slots, start, end, local)
            job.asked[rank.address] = heads
            self._socket(rank.address).send(json.dumps(msg).encode())

    def _on_message(self, address: str, frames: list) -> None:
        try:
            header = json.loads(frames[0].bytes)
            if "route" in header:
                return self._on_route(address, header)
            room = int(header["room"])
        except (ValueError, TypeError, KeyError) as e:  # (json's errors are ValueErrors)
            logger.warning("P/D decode: dropped a malformed message from %s (%s)", address, e)
            return
        job = self._open.get(room)
        if job is None or address not in job.asked:
            return  # a request that was aborted or timed out meanwhile
        heads = job.asked.pop(address)
        if "error" in header:
            job.fail(f"the prefill server reported: {header['error']}")
        else:
            try:
                self._store(job, header, frames[1:], heads)
            except (ValueError, TypeError, KeyError, RuntimeError) as e:
                job.fail(f"the prefill server sent rows this server cannot store ({e})")
        if not job.asked:
            self._end(job, job.error)

    def _on_route(self, address: str, header: dict) -> None:
        jobs = self._routing.pop(address, [])
        layers, hb, dtype = int(header["layers"]), int(header["head_bytes"]), str(header["dtype"])
        mine = str(self.pool.k_buffers[0].dtype)
        if layers != len(self.pool.k_buffers) or hb != head_bytes(self.pool) or dtype != mine:
            error = (f"the prefill server's KV has {layers} layers of {hb}-byte {dtype} heads, this server's "
                     f"{len(self.pool.k_buffers)} of {head_bytes(self.pool)}-byte {mine} (not the same model and dtype)")
            for job in jobs:
                self._end(job, error)
            return
        host = urlsplit(address).hostname or ""
        route = self._routes[address] = [RankEndpoint.from_wire(item, host) for item in header["route"]]
        for job in jobs:
            if job.room in self._open:
                self._ask(job, route)

    def _store(self, job: Receive, header: dict, frames: list, heads: range) -> None:
        start, end, layers = int(header["start"]), int(header["end"]), int(header["layers"])
        want_frames = 0 if "written" in header or not heads else 2 * layers
        if start != job.decode_prefix_len or end != len(job.slots) or layers != len(self.pool.k_buffers) \
                or range(*header["heads"]) != heads or len(frames) != want_frames:
            return job.fail(f"the prefill server sent tokens {start}-{end} of {layers} layers, not what was asked")
        if job.first_token not in (-1, int(header["first_token"])):
            return job.fail("the prefill ranks sent different first tokens")
        if "written" in header:  # Mooncake: the rows were written into the reserved pages
            job.received_bytes += int(header["written"])
        elif heads:
            local = slice(heads.start - self.heads.start, heads.stop - self.heads.start)
            job.received_bytes += self._copy_frames(job.slots[start:end], frames, local)
        job.first_token = int(header["first_token"])
        job.received_tokens = end - start

    def _copy_frames(self, idx: torch.Tensor, frames: list, heads: slice) -> int:
        for i, (k, v) in enumerate(zip(self.pool.k_buffers, self.pool.v_buffers)):
            for buf, frame in ((k, frames[2 * i]), (v, frames[2 * i + 1])):
                with warnings.catch_warnings():  # a read-only frame: only read from
                    warnings.simplefilter("ignore", UserWarning)
                    rows = torch.frombuffer(frame.buffer, dtype=buf.dtype).view(len(idx), -1, buf.shape[-1])
                buf[:, heads].index_copy_(0, idx, rows.to(buf.device))
        if self.pool.k_buffers[0].is_cuda:  # landed before the scheduler sees the job done
            torch.cuda.current_stream(self.pool.k_buffers[0].device).synchronize()
        return sum(len(f.buffer) for f in frames)

    def _end(self, job: Receive, error: str) -> None:
        """The job is over (every asked rank answered, or ``error``); a failed job forgets its
        prefill server's route, so the next request asks again (it may have restarted)."""
        self._open.pop(job.room, None)
        if error:
            job.fail(error)
            self._routes.pop(job.address, None)
        job.seconds = time.perf_counter() - job.submitted
        job.done.set()

    def _expire(self, now: float) -> None:
        for job in [j for j in self._open.values() if now > j.deadline]:
            for address, waiting in list(self._routing.items()):
                waiting[:] = [j for j in waiting if j is not job]
                if not waiting:  # nobody waits for that route any more: the next job asks anew
                    del self._routing[address]
            self._end(job, f"no KV from the prefill server at {job.address} in time")
