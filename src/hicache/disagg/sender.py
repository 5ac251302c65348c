"""The prefill side of a KV transfer (protocol: :mod:`hicache.disagg.transfer`): one per rank.

The socket listens on the network, so no message can stop the thread: each is read with a
bound on its frames and bytes (:mod:`hicache.disagg.wire`), checked field by field, and dropped
with one log line when it fails, whatever it raised. Asks wait for their room's prefill at most
until the *smaller* of their own expiry and this server's transfer timeout; a peer holds at most
``MAX_ASKS_PER_PEER`` open asks (more are answered with an error at once); an ask is found by
its room in O(1) and expired from a heap, so a flood of asks never slows the next route ask.
If the thread ever dies, :attr:`KVSender.failure` says why and the engine reports itself dead.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
import zmq

from ..cache.pools import DeviceKVPool
from ..cache.state_pool import StatePool
from .heads import RankEndpoint
from .mooncake_writes import MooncakeWrites
from .state_tail import StateSlots
from .transfer import POLL_MS, IOThread, Send, head_bytes, raw
from .window_tail import WINDOW, Rows, WindowTail
from .wire import JSON_FRAME_BYTES, Ask, DropLog, WireError, json_object, limit_socket, recv_bounded

logger = logging.getLogger(__name__)

MAX_ASKS_PER_PEER = 4096  # open asks of one decode rank (its running requests, with room to spare)
MAX_ASKS = 65536  # open asks of all peers together
BATCH = 256  # messages handled per poll before the jobs are looked at again


@dataclass
class PendingAsk:
    """An ask whose room's prefill is not done yet; ``expires``: perf_counter seconds;
    ``seq``: its entry in the expiry heap."""

    peer: bytes
    ask: Ask
    expires: float
    seq: int


class KVSender(IOThread):
    """Binds this rank's KV socket (rank 0's is the bootstrap socket and also answers route
    asks), matches asks to finished prefills by room and answers them. ``heads``: the
    model-global KV heads of ``pool``; ``max_wait_s``: the longest an ask waits for its room
    (the server's transfer timeout). ``submit`` is called on the scheduler thread."""

    name = "hicache-kv-sender"
    server = "prefill"

    def __init__(self, pool: DeviceKVPool, port: int, host: str, heads: range, max_wait_s: float = 60.0,
                 writes: Optional[MooncakeWrites] = None, states: Optional[StatePool] = None) -> None:
        """``port`` 0: any free port. ``writes``: move rows with Mooncake's transfer engine
        instead of message frames. ``states``: the recurrent layers' state slots (None: none).
        Answers nothing until :meth:`start`."""
        super().__init__()
        self.pool, self.heads, self.writes, self.max_wait_s = pool, heads, writes, max_wait_s
        self.parts = {WINDOW: WindowTail(pool)}  # the components an ask may ask apart
        self.state = StateSlots(states)
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        # A Mooncake ask lists a buffer address per layer, the suffix's pages and (a hybrid decode pool) its
        # tail's pages per sliding group, a group per window layer: bound it by the pool's pages, and the
        # tail by a window (+ the pages it may straddle) where this pool knows the window.
        layers, pages = len(pool.k_buffers), pool.k_buffers[0].shape[0] // pool.page_size
        tail = min(-(-pool.windows.window // pool.page_size) + 3, pages) if pool.windows.window else pages
        self._max_ask_bytes = JSON_FRAME_BYTES + 24 * (3 * layers + pages + layers * tail + len(self.state.tensors))
        limit_socket(self._sock, self._max_ask_bytes)
        self.port = self._sock.bind_to_random_port(f"tcp://{host}") if port == 0 else port
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        self.host = host
        self.route: list[RankEndpoint] = []
        self._asks: dict[int, dict[int, PendingAsk]] = {}  # room -> seq -> ask whose prefill is not done yet
        self._expiry: list[tuple[float, int, int]] = []  # heap of (expires, seq, room); answered asks linger
        self._seq = itertools.count()
        self._per_peer: Counter[bytes] = Counter()  # open asks per decode rank
        self._open = 0  # open asks in all
        self._waiting: dict[int, Send] = {}  # room -> prefill done, asks outstanding
        self._dropped = DropLog(logger)

    def start(self, route: list[RankEndpoint]) -> None:
        """Serve; ``route``: every prefill rank of this server (answered to route asks)."""
        self.route = route
        self._thread.start()

    def refuse(self, room: int, reason: str, deadline: float) -> None:
        """Answer ``room``'s asks with ``reason`` (its prefill ended without KV to send)."""
        self.submit(Send(room, torch.empty(0, dtype=torch.long), -1, deadline, error=reason))

    # ---- the I/O thread -------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while True:
                if self._sock.poll(POLL_MS):
                    for _ in range(BATCH):
                        self._receive()
                        if not self._sock.poll(0):
                            break
                self._take_jobs(self._waiting)
                if self.closing:
                    return
                self._match(time.perf_counter())
        finally:
            self._stopped(self._waiting)
            self._sock.close()

    def _receive(self) -> None:
        """One message: a route ask (answered at once) or a KV ask (kept until its room's
        prefill is done or it expires); anything else is logged and dropped."""
        frames = recv_bounded(self._sock, 2)
        try:
            if frames is None or len(frames) != 2:
                raise WireError("a message of more than one frame")
            peer, msg = frames[0], json_object(frames[1], self._max_ask_bytes)
            if "route" in msg:
                return self._answer_route(peer)
            self._keep(peer, Ask.parse(msg, len(self.pool.k_buffers)))
        except WireError as e:
            self._dropped("P/D prefill: dropped a malformed message on the bootstrap socket (%s)", e)
        except Exception:  # a bug, not the peer's bytes: still only this message is lost
            logger.exception("P/D prefill: dropped a message that could not be handled")

    def _answer_route(self, peer: bytes) -> None:
        answer = {"route": [r.to_wire() for r in self.route], "layers": len(self.pool.k_buffers),
                  "head_bytes": head_bytes(self.pool), "dtype": str(self.pool.k_buffers[0].dtype),
                  "state_bytes": self.state.slot_bytes}
        self._sock.send_multipart([peer, json.dumps(answer).encode()])

    def _keep(self, peer: bytes, ask: Ask) -> None:
        """Hold ``ask`` until its room's prefill is done, at most ``max_wait_s``."""
        if self._per_peer[peer] >= MAX_ASKS_PER_PEER or self._open >= MAX_ASKS:
            self._send_error(peer, ask.room, f"too many open asks (at most {MAX_ASKS_PER_PEER} per decode rank)")
            self._dropped("P/D prefill room=%d: refused an ask: too many open asks", ask.room)
            return
        pending = PendingAsk(peer, ask, time.perf_counter() + min(ask.expires_in, self.max_wait_s), next(self._seq))
        self._asks.setdefault(ask.room, {})[pending.seq] = pending
        self._per_peer[peer] += 1
        self._open += 1
        heapq.heappush(self._expiry, (pending.expires, pending.seq, ask.room))

    def _close(self, a: PendingAsk) -> None:
        """``a`` is no longer open (answered or expired)."""
        self._open -= 1
        self._per_peer[a.peer] -= 1
        if not self._per_peer[a.peer]:
            del self._per_peer[a.peer]

    def _match(self, now: float) -> None:
        """Answer the asks of every room whose prefill is done (O(open prefills)), then drop
        the asks that expired (O(log n) each)."""
        for room, job in list(self._waiting.items()):
            for pending in self._asks.pop(room, {}).values():
                self._close(pending)
                job.askers = pending.ask.askers
                # (the clock again: answers before this one may have taken a while, and a Mooncake
                # write must not start after its asker gave up: its pages may be someone else's now)
                if time.perf_counter() > pending.expires:
                    job.error, job.answered = f"the decode side gave up on room {room}", job.answered + 1
                else:
                    self._answer(pending.peer, pending.ask, job)
            if job.askers and job.answered >= job.askers:
                del self._waiting[room]
                job.done.set()
            elif now > job.deadline:
                del self._waiting[room]
                job.error = job.error or f"not every decode rank asked for room {room} in time ({job.answered} did)"
                logger.warning("P/D prefill room=%d: %s", room, job.error)
                job.done.set()
        while self._expiry and self._expiry[0][0] < now:  # asks for rooms this server never had (aborted, or none)
            _, seq, room = heapq.heappop(self._expiry)
            pending = self._asks.get(room, {}).pop(seq, None)
            if pending is None:  # answered meanwhile
                continue
            if not self._asks[room]:
                del self._asks[room]
            self._close(pending)
            self._send_error(pending.peer, room, "no request for this room reached this prefill server in time")

    def _rows(self, ask: Ask, job: Send) -> list[Rows]:
        """Per layer, the rows the ask wants: tokens from ``decode_prefix_len``, or from the start of
        the part that asked the layer apart (this pool's part decides where it holds them). Raises
        ValueError for rows this pool no longer holds."""
        rows = dict.fromkeys(range(len(self.pool.k_buffers)), (ask.decode_prefix_len, job.slots))
        for name, part in self.parts.items():
            rows.update(part.sources(ask.parts.get(name), job.parts.get(name), job.slots))
        return list(rows.values())

    def _send_error(self, peer: bytes, room: int, error: str) -> None:
        self._sock.send_multipart([peer, json.dumps({"room": room, "error": error}).encode()])

    def _answer(self, peer: bytes, ask: Ask, job: Send) -> None:
        """One multipart message: header, then K and V rows of every layer for the suffix and
        the asked heads (or only the header when Mooncake wrote them)."""
        try:
            if job.error:  # refused before it could compute (see refuse)
                raise ValueError(job.error)
            start, end, heads = ask.decode_prefix_len, len(job.slots), ask.heads
            if ask.prompt_len != end:
                raise ValueError(f"decode asked for tokens {start}-{ask.prompt_len} of a {end}-token prompt")
            if heads and not (self.heads.start <= heads.start and heads.stop <= self.heads.stop):
                raise ValueError(f"decode asked for KV heads {heads.start}-{heads.stop - 1}; this rank holds "
                                 f"{self.heads.start}-{self.heads.stop - 1}")
            if (self.writes is None) != (ask.mooncake is None):
                raise ValueError("the two servers use different --disaggregation-transfer-backend settings")
            local = range(heads.start - self.heads.start, heads.stop - self.heads.start)
            header = {"room": job.room, "first_token": job.first_token, "start": start, "end": end,
                      "layers": len(self.pool.k_buffers), "heads": [heads.start, heads.stop],
                      "head_bytes": head_bytes(self.pool)}
            rows = self._rows(ask, job)
            for part in ask.parts.values():
                header.update(part.echo())
            states = self.state.sendable(ask.state, job.states) if ask.state is not None else ()
            if states:
                header["state_at"] = list(states)
            frames = []
            if self.writes is not None:  # the rows are in the decode pool already when this returns
                pages = ask.mooncake.layer_pages(ask.parts)
                header["written"] = self.writes.write(ask.mooncake, [(*r, p) for r, p in zip(rows, pages)], end, local) \
                    + self.writes.write_spans(ask.mooncake.session, self.state.spans(ask.state, job.states, states))
            else:
                for (k, v), (first, slots) in zip(zip(self.pool.k_buffers, self.pool.v_buffers), rows if heads else []):
                    idx = slots[first:end].to(k.device)  # the slots are CPU tensors; the pool may be on a GPU
                    frames += [raw(buf.index_select(0, idx)[:, local.start:local.stop]) for buf in (k, v)]
                frames += self.state.frames([job.states[p] for p in states])
            sent = header.get("written", sum(f.nbytes for f in frames))
            self._sock.send_multipart([peer, json.dumps(header).encode(), *frames], copy=False)
            job.sent_bytes += sent
            job.sent_states += len(states)
            job.sent_tokens = end - start
            logger.info("P/D prefill room=%d: sent tokens %d-%d, KV heads %d-%d, states at %s (%d bytes)", job.room,
                        start, end, heads.start, heads.stop - 1, list(states), sent)
        except Exception as e:  # the decode side must hear why, or it waits for its deadline
            job.error = str(e)
            self._send_error(peer, job.room, job.error)
            logger.warning("P/D prefill room=%d: %s", job.room, job.error)
        job.answered += 1
