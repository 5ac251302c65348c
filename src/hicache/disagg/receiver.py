"""The decode side of a KV transfer (protocol: :mod:`hicache.disagg.transfer`): one per rank.

Its peer is whatever prefill server an API client named, so every answer is checked before
use (:mod:`hicache.disagg.wire`: frame count and size, header fields, the first token within
the vocabulary, row frames of exactly the asked size); a bad answer fails its request at once,
anything that cannot be tied to a request is logged and dropped, and nothing a peer sends can
stop the thread (if it ever dies, :attr:`KVReceiver.failure` says why and the engine reports
itself dead). Failures that are certain are reported at once, not at the transfer timeout: a
refused or dropped connection (ZeroMQ's socket monitor reports it), a malformed message (its
sender answers nothing else that was asked of it), a bad route, an error answer.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import warnings
from typing import Any, Optional
from urllib.parse import urlsplit

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from ..cache.pools import DeviceKVPool
from ..cache.state_pool import StatePool
from .heads import RankEndpoint, heads_from
from .mooncake_writes import MooncakeWrites
from .state_tail import StateSlots
from .transfer import POLL_MS, IOThread, Receive, head_bytes
from .window_tail import WINDOW, WindowTail
from .wire import (JSON_FRAME_BYTES, Answer, Ask, DropLog, RouteAnswer, WireError, json_object, limit_socket,
                   recv_bounded)

logger = logging.getLogger(__name__)

MAX_PEERS = 256  # prefill endpoints (DEALER sockets) one decode rank holds open at once
_MONITORS = itertools.count()  # inproc endpoint names of socket monitors, unique in the process
WRITE_GRACE_S = 2.0  # Mooncake: a prefill rank's write started in time lands within this (see _ask)


def _close(sock: Any, monitor: Any) -> None:
    """Close a DEALER and its monitor socket."""
    sock.disable_monitor()
    monitor.close()
    sock.close()


class TooManyPeers(RuntimeError):
    """Every socket this receiver may hold is in use by an open request."""


class KVReceiver(IOThread):
    """Learns each prefill server's route once, asks its ranks for this rank's heads (one
    DEALER per endpoint) and writes the received rows into the reserved slots. ``heads``: the
    model-global KV heads of ``pool``; ``askers``: this server's TP size (how many of its ranks
    ask each prefill rank); ``vocab_size``: the model's (a first token must be one of its ids);
    ``states``: the recurrent layers' state slots (None: none), asked of the prefill rank of this
    rank's index ``rank``. ``submit`` is called on the scheduler thread."""

    name = "hicache-kv-receiver"
    server = "decode"

    def __init__(self, pool: DeviceKVPool, heads: range, vocab_size: int, askers: int = 1,
                 writes: Optional[MooncakeWrites] = None, states: Optional[StatePool] = None, rank: int = 0) -> None:
        """``writes``: the prefill ranks write rows into this pool with Mooncake's transfer engine."""
        super().__init__()
        self.pool, self.heads, self.vocab_size, self.askers, self.writes = pool, heads, vocab_size, askers, writes
        self.parts = {WINDOW: WindowTail(pool)}  # the components a job may ask apart
        self.state, self.rank = StateSlots(states), rank
        k = pool.k_buffers[0]
        # rows: at most a whole layer; a state: one slot of one tensor
        self._max_frame = max(k.numel() * k.element_size(), JSON_FRAME_BYTES, *self.state.frame_bytes)
        self._max_frames = 1 + 2 * len(pool.k_buffers) + 2 * len(self.state.tensors)  # header, K and V, 2 states
        self._open: dict[int, Receive] = {}  # room -> asked (or waiting for the route)
        self._routes: dict[str, list[RankEndpoint]] = {}  # bootstrap address -> its prefill ranks
        self._routing: dict[str, list[Receive]] = {}  # bootstrap address -> jobs waiting for its route
        self._socks: dict[str, tuple[Any, Any]] = {}  # address -> (its DEALER, the DEALER's monitor socket)
        self._addresses: dict[Any, str] = {}  # either socket -> address
        self._poller = zmq.Poller()
        self._dropped = DropLog(logger)
        self._thread.start()

    # ---- sockets --------------------------------------------------------------------------
    def _send(self, address: str, msg: dict) -> None:
        """``msg`` to ``address`` without ever blocking this thread: a peer that stops reading
        fills its queue (``SNDHWM``), and then zmq.Again (a certain failure) is raised. Raises
        whatever connecting raised (e.g. a host name that does not resolve), and
        TooManyPeers when this receiver already holds :data:`MAX_PEERS` addresses in use. The
        DEALER to ``address`` is opened on first use (connecting is asynchronous: a refusal
        arrives as a monitor event, :meth:`_on_monitor`)."""
        if address not in self._socks and len(self._socks) >= MAX_PEERS:
            self._close_idle()
            if len(self._socks) >= MAX_PEERS:
                raise TooManyPeers(f"this decode rank already talks to {MAX_PEERS} prefill endpoints")
        if address not in self._socks:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            limit_socket(sock, self._max_frame)
            # A name of our own: pyzmq's default names the socket's fd, which a closed socket's
            # monitor may still hold in the shared context when a new socket reuses the number.
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED,
                                              f"inproc://hicache-kv-monitor-{next(_MONITORS)}")
            try:
                sock.connect(address)
            except zmq.ZMQError:
                _close(sock, monitor)
                raise
            self._socks[address] = (sock, monitor)
            for s in (sock, monitor):
                self._poller.register(s, zmq.POLLIN)
                self._addresses[s] = address
        self._socks[address][0].send(json.dumps(msg).encode(), zmq.NOBLOCK)

    def _close_idle(self) -> None:
        """Close the sockets no open request waits on (and the routes through them)."""
        busy = set(self._routing) | {a for job in self._open.values() for a in job.asked}
        for address in [a for a in self._socks if a not in busy]:
            self._forget(address, "")

    def _forget(self, address: str, error: str) -> None:
        """``address`` cannot be reached: fail every job that waits on it, close its socket,
        and forget the routes through it (the next request connects and asks anew)."""
        for job in self._routing.pop(address, []):
            self._end(job, error)
        for job in [j for j in self._open.values() if address in j.asked]:
            if self.writes is None:  # (with Mooncake that rank may still be writing: its deadline ends it)
                del job.asked[address]
            self._failed(job, error)
        for boot, route in list(self._routes.items()):
            if boot == address or any(r.address == address for r in route):
                del self._routes[boot]
        if (pair := self._socks.pop(address, None)) is not None:
            for s in pair:
                self._poller.unregister(s)
                del self._addresses[s]
            _close(*pair)

    # ---- the I/O thread -------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while not self.closing:
                for job in self._take_jobs(self._open, wait=not self._socks and not self._open):
                    self._route(job)
                for sock, _ in self._poller.poll(POLL_MS) if self._socks else []:
                    address = self._addresses.get(sock)  # (None: closed by a monitor event of this round)
                    if address is not None and sock is self._socks[address][1]:
                        self._on_monitor(address, sock)
                    elif address is not None:
                        self._receive(address, sock)
                self._expire(time.perf_counter())
        finally:
            self._stopped(self._open)
            for pair in self._socks.values():
                _close(*pair)

    def _on_monitor(self, address: str, monitor: Any) -> None:
        """The connection to a prefill server was refused, or dropped (the peer went away, or
        ZeroMQ cut it for a frame over the limit): what was asked there will never come."""
        refused = recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECT_RETRIED
        self._forget(address, f"the prefill server at {address} " +
                     ("refused the connection" if refused else "dropped the connection (or sent a frame over the limit)"))

    def _route(self, job: Receive) -> None:
        """Ask for ``job``'s KV along its prefill server's route, once known (asked for it first)."""
        if job.address in self._routes:
            return self._ask(job, self._routes[job.address])
        if job.address not in self._routing:
            try:
                self._send(job.address, {"route": 1})
            except Exception as e:  # a host name that does not resolve, a peer that stopped reading
                return self._end(job, f"cannot ask the prefill server at {job.address} ({type(e).__name__}: {e})")
        self._routing.setdefault(job.address, []).append(job)

    def _ask(self, job: Receive, route: list[RankEndpoint]) -> None:
        """Ask every prefill rank for the heads it supplies to this rank (maybe none), and the prefill
        rank of this rank's index for the recurrent states (its shard of them is this rank's)."""
        try:
            supply = heads_from(route, self.heads)
        except ValueError as e:
            return self._end(job, str(e))
        start, end = job.decode_prefix_len, len(job.slots)
        # A prefill rank answers no ask after this (its clock). Mooncake: it starts no write after
        # it either, so a write lands before our deadline (when the pages may go to another
        # request) if it takes under the grace; zmq rows that come late are dropped here.
        left = job.deadline - time.perf_counter()
        expires_in = max(left - (min(WRITE_GRACE_S, left / 4) if self.writes is not None else 0.0), 0.0)
        asked = {name: self.parts[name].ask(tail) for name, tail in job.parts.items()}
        pages = {name: self.parts[name].pages(tail, end) for name, tail in job.parts.items()} if self.writes else {}
        state = self.state.ask(job.states, self.writes is not None) if job.states else None
        job.states_from = route[self.rank].address if state is not None else ""
        for i, (rank, heads) in enumerate(zip(route, supply)):
            local = range(heads.start - self.heads.start, heads.stop - self.heads.start)
            target = self.writes.describe(job.slots, start, end, local, pages) if self.writes is not None else None
            ask = Ask(job.room, start, end, heads, self.askers, expires_in, target, asked,
                      state if i == self.rank else None)
            try:
                self._send(rank.address, ask.to_wire())
            except Exception as e:  # (ranks asked before this one may be writing: _failed waits for them)
                return self._failed(job, f"cannot ask the prefill rank at {rank.address} ({type(e).__name__}: {e})")
            job.asked[rank.address] = heads

    def _receive(self, address: str, sock) -> None:
        """One message from ``address``: a route, an answer (its request ends here if it was
        bad), or something that is neither (logged and dropped)."""
        frames = recv_bounded(sock, self._max_frames, copy=False)
        job = None
        try:
            if frames is None:
                raise WireError(f"a message of more than {self._max_frames} frames")
            header = json_object(frames[0].bytes)
            if "route" in header:
                return self._on_route(address, header)
            answer = Answer.parse(header, self.vocab_size)
            job = self._open.get(answer.room)
            if job is None or address not in job.asked:
                return  # a request that was aborted or timed out meanwhile
            heads = job.asked.pop(address)
            if answer.error:
                job.fail(f"the prefill server reported: {answer.error}")
            else:
                self._store(job, answer, frames[1:], heads, address == job.states_from)
        except WireError as e:
            if job is None:  # a peer that breaks the protocol answers none of what was asked there
                self._dropped("P/D decode: a malformed message from %s (%s)", address, e)
                self._forget(address, f"the prefill server at {address} sent a malformed message ({e})")
            else:
                job.fail(f"the prefill server at {address} sent a malformed answer ({e})")
        except Exception as e:  # a bug, not the peer's bytes: only this message (and its request) are lost
            logger.exception("P/D decode: a message from %s could not be handled", address)
            if job is not None:
                job.fail(f"the answer of the prefill server at {address} could not be stored ({type(e).__name__})")
        if job is not None and (not job.asked or job.error):
            self._failed(job, job.error) if job.error else self._end(job, "")

    def _on_route(self, address: str, header: dict) -> None:
        jobs = self._routing.pop(address, [])
        mine = (len(self.pool.k_buffers), head_bytes(self.pool), str(self.pool.k_buffers[0].dtype))
        try:
            answer = RouteAnswer.parse(header)
            error = "" if (answer.layers, answer.head_bytes, answer.dtype) == mine else (
                f"the prefill server's KV has {answer.layers} layers of {answer.head_bytes}-byte {answer.dtype} "
                f"heads, this server's {mine[0]} of {mine[1]}-byte {mine[2]} (not the same model and dtype)")
            error = error or self._state_mismatch(answer)
        except WireError as e:
            error = f"the prefill server at {address} sent a malformed route ({e})"
        if error:
            for job in jobs:
                self._end(job, error)
            return
        host = urlsplit(address).hostname or ""
        route = self._routes[address] = [RankEndpoint.from_wire(item, host) for item in answer.ranks]
        for job in jobs:
            if job.room in self._open:
                self._ask(job, route)

    def _state_mismatch(self, answer: RouteAnswer) -> str:
        """Why this server cannot take the route's recurrent states ('' when it can): each rank holds
        its TP shard of them, so they cross rank to rank between equal TP sizes."""
        if answer.state_bytes != self.state.slot_bytes:
            return (f"the prefill server's recurrent state is {answer.state_bytes} bytes a slot per rank, this "
                    f"server's {self.state.slot_bytes} (not the same model, dtype or --tp-size)")
        if self.state.slot_bytes and len(answer.ranks) != self.askers:
            return (f"the prefill server runs {len(answer.ranks)} ranks and this one {self.askers}: a recurrent "
                    "model's state shards cross only between servers of the same --tp-size")
        return ""

    def _store(self, job: Receive, answer: Answer, frames: list, heads: range, states: bool) -> None:
        """Rows of ``heads`` for tokens ``[start, end)`` into the job's slots, and (``states``: this
        prefill rank was asked for them) the recurrent states into theirs; raises WireError when they
        are not exactly what was asked."""
        start, end, layers = answer.start, answer.end, answer.layers
        want_frames = 0 if answer.written is not None or not heads else 2 * layers
        frames, state_frames = frames[:want_frames], frames[want_frames:]
        if states:
            self.state.check_answer(job.states, answer.state_at)
        elif answer.state_at:
            raise WireError("recurrent states from a prefill rank not asked for them")
        if len(state_frames) != (0 if answer.written is not None else len(answer.state_at) * len(self.state.tensors)):
            raise WireError(f"{len(state_frames)} state frames for the states at {list(answer.state_at)}")
        if start != job.decode_prefix_len or end != len(job.slots) or layers != len(self.pool.k_buffers) \
                or answer.heads != heads or len(frames) != want_frames \
                or answer.parts != {name: tail.start for name, tail in job.parts.items()}:
            raise WireError(f"tokens {start}-{end} of {layers} layers in {len(frames)} frames, not what was asked")
        if (answer.written is not None) != (self.writes is not None):  # rows in frames xor written by Mooncake
            raise WireError("a Mooncake answer on a zmq transfer (or the reverse)")
        rows = self._rows(job)
        row_bytes = len(heads) * head_bytes(self.pool)
        if any(len(f.buffer) != len(rows[i // 2]) * row_bytes for i, f in enumerate(frames)):
            raise WireError("row frames of other sizes than asked")
        if job.first_token not in (-1, answer.first_token):
            raise WireError("the prefill ranks sent different first tokens")
        if answer.written is not None:  # Mooncake: the rows (and states) were written into the reserved slots
            job.received_bytes += answer.written
        else:
            if heads:
                local = slice(heads.start - self.heads.start, heads.stop - self.heads.start)
                job.received_bytes += self._copy_frames(rows, frames, local)
            job.received_bytes += self.state.store(job.states, answer.state_at, state_frames)
        if states:
            job.states_got = answer.state_at
        job.first_token = answer.first_token
        job.received_tokens = end - start

    def _rows(self, job: Receive) -> list[torch.Tensor]:
        """Per layer, the slots the answer's rows go to: the prompt's from ``decode_prefix_len``, or
        those of the part that asked the layer apart, from its start."""
        rows = dict.fromkeys(range(len(self.pool.k_buffers)), (job.decode_prefix_len, job.slots))
        for name, tail in job.parts.items():
            rows.update(self.parts[name].targets(tail))
        return [slots[first:len(job.slots)] for first, slots in rows.values()]

    def _copy_frames(self, slots: list[torch.Tensor], frames: list, heads: slice) -> int:
        """Each layer's K and V frames into its ``slots`` (one per row), for ``heads``."""
        for i, (k, v) in enumerate(zip(self.pool.k_buffers, self.pool.v_buffers)):
            idx = slots[i]
            for buf, frame in ((k, frames[2 * i]), (v, frames[2 * i + 1])):
                with warnings.catch_warnings():  # a read-only frame: only read from
                    warnings.simplefilter("ignore", UserWarning)
                    rows = torch.frombuffer(frame.buffer, dtype=buf.dtype).view(len(idx), -1, buf.shape[-1])
                buf[:, heads].index_copy_(0, idx.to(buf.device), rows.to(buf.device))
        if self.pool.k_buffers[0].is_cuda:  # landed before the scheduler sees the job done
            torch.cuda.current_stream(self.pool.k_buffers[0].device).synchronize()
        return sum(len(f.buffer) for f in frames)

    def _failed(self, job: Receive, error: str) -> None:
        """``job`` cannot succeed: end it now, unless Mooncake may still write into its pages
        (another prefill rank not heard from yet): then when that rank answers, or at the deadline."""
        job.fail(error)
        if not job.asked or self.writes is None:  # zmq: rows that come later are dropped, never stored
            self._end(job, job.error)

    def _end(self, job: Receive, error: str) -> None:
        """The job is over (every asked rank answered, or ``error``) and waits for no route (nobody
        waiting: the next job asks anew); a failed job forgets its prefill server's route, so the
        next request asks again (it may have restarted)."""
        if self._open.get(job.room) is job:
            del self._open[job.room]
        if waiting := [j for j in self._routing.pop(job.address, []) if j is not job]:
            self._routing[job.address] = waiting
        if error:
            job.fail(error)
            self._routes.pop(job.address, None)
        job.seconds = time.perf_counter() - job.submitted
        job.done.set()

    def _expire(self, now: float) -> None:
        """End the jobs past their deadline, and those whose prefill server has not answered
        the route by the handshake deadline (a dead or hostile peer, named by a client)."""
        for job in [j for j in self._open.values() if now > j.deadline]:
            self._end(job, f"no KV from the prefill server at {job.address} in time")
        for address, waiting in list(self._routing.items()):
            for job in [j for j in waiting if now > j.handshake_deadline]:
                self._end(job, f"the prefill server at {address} did not answer within the handshake timeout "
                               "(--disaggregation-handshake-timeout)")
