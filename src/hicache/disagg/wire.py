"""What may arrive on a P/D socket, checked before use.

The prefill server's bootstrap socket listens on the network, and a decode server's peer is
whatever ``bootstrap_host`` / ``bootstrap_port`` an API client named: every message is hostile
until checked. Each parser here takes one received message and returns a typed value whose
fields are within bounds (integers are integers, not bools or floats; numbers are finite;
lists have the expected length; strings are short), or raises :class:`WireError` with one
sentence. Callers drop (and log) a message that fails; none of these functions raises anything
else, whatever the bytes (deep nesting, huge numbers, NaN, wrong types).

Size limits are enforced twice: ZeroMQ's ``MAXMSGSIZE`` disconnects a peer whose frame is
larger than the socket's limit (:func:`limit_socket`), and :func:`recv_bounded` keeps at most a
fixed number of frames of one message (ZeroMQ has no such option).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from .fields import MAX_HEADS, MAX_TOKENS, WireError, error_text, head_range, host, int_list, integer, number
from .state_tail import StateAsk, positions
from .window_tail import TailAsk, TailPages

MAX_ROOM = 2**63 - 1  # rooms are non-negative signed 64-bit integers, as SGLang draws them
MAX_ASKERS = 1024  # decode ranks that ask one prefill rank (the decode server's TP size)
MAX_RANKS = 64  # prefill ranks in a route (its TP size); each is a socket the decode side opens
MAX_LAYERS = 1 << 16
MAX_ADDRESS = 1 << 64  # Mooncake buffer addresses
JSON_FRAME_BYTES = 64 << 10  # a route ask, a route answer without Mooncake, any answer header
PARTS = (TailAsk,)  # the components an ask asks apart: rows of their own from a start of their own


# ---- receiving ----------------------------------------------------------------------------------
def limit_socket(sock: Any, max_frame_bytes: int, max_queued: int = 1000) -> None:
    """A peer that sends a frame over ``max_frame_bytes`` is disconnected by ZeroMQ before it
    is buffered; at most ``max_queued`` messages wait per peer in each direction (incoming ones
    past it are dropped; a non-blocking send past it raises zmq.Again); closing drops what is unsent."""
    import zmq

    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.RCVHWM, max_queued)
    sock.setsockopt(zmq.SNDHWM, max_queued)


def recv_bounded(sock: Any, max_frames: int, copy: bool = True) -> Optional[list]:
    """One whole message from ``sock`` (ready to read), or None when it had more than
    ``max_frames`` frames (the rest are read and discarded: one past the limit is kept, never more)."""
    import zmq

    frames = [sock.recv(copy=copy)]
    while sock.getsockopt(zmq.RCVMORE):
        frame = sock.recv(copy=copy)
        if len(frames) <= max_frames:
            frames.append(frame)
    return frames if len(frames) <= max_frames else None


def json_object(frame: bytes, limit: int = JSON_FRAME_BYTES) -> dict:
    """A JSON object of at most ``limit`` bytes."""
    if len(frame) > limit:
        raise WireError(f"a {len(frame)}-byte JSON frame (at most {limit})")
    try:
        msg = json.loads(frame)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; nesting a RecursionError
        raise WireError(f"not JSON ({type(e).__name__})") from None
    if not isinstance(msg, dict):
        raise WireError("not a JSON object")
    return msg


class DropLog:
    """Warnings about dropped messages, at most one line per ``interval_s`` (saying how many
    were dropped since the previous line): a peer's flood must not flood the log."""

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0) -> None:
        self.logger, self.interval_s = logger, interval_s
        self._last, self._count = -interval_s, 0

    def __call__(self, message: str, *args: Any) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            more = f" ({self._count - 1} more dropped since the last such line)" if self._count > 1 else ""
            self.logger.warning(message + more, *args)
            self._last, self._count = now, 0


# ---- messages -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MooncakeTarget:
    """Where a prefill rank writes an ask's rows with Mooncake (:mod:`hicache.disagg.mooncake_writes`):
    the decode rank's transfer engine, its K and V buffers' base addresses, the pages reserved
    for the suffix and where the asked heads sit in its rows; ``parts``: the pages of each part
    the ask asks apart (by component: the window's :class:`~.window_tail.TailPages`)."""

    session: str
    page_size: int
    row_heads: int
    first_head: int
    k: list[int]
    v: list[int]
    pages: list[int]
    parts: dict[str, TailPages] = field(default_factory=dict)

    def to_wire(self) -> dict:
        msg = {"session": self.session, "page_size": self.page_size, "row_heads": self.row_heads,
               "first_head": self.first_head, "k": self.k, "v": self.v, "pages": self.pages}
        for part in self.parts.values():
            msg.update(part.to_wire())
        return msg

    def layer_pages(self, asked: Mapping[str, TailAsk]) -> list[list[int]]:
        """Each layer's pages in the decode pool: the suffix's, or those of the part that asked it."""
        pages = [self.pages] * len(self.k)
        for name, part in self.parts.items():
            for layer, own in asked[name].destinations(part).items():
                pages[layer] = own
        return pages

    @classmethod
    def parse(cls, msg: Any, layers: int, start: int, prompt_len: int,
              asked: Mapping[str, TailAsk] = {}) -> "MooncakeTarget":
        """The suffix from token ``start``; ``asked``: the ask's parts (each reads its own pages)."""
        if not isinstance(msg, dict):
            raise WireError("'mooncake' must be an object")
        session = msg.get("session")
        if not isinstance(session, str) or ":" not in session:
            raise WireError("'mooncake.session' must be host:port")
        host(session.rpartition(":")[0].strip("[]"), "the Mooncake session's host")
        page_size = integer(msg, "page_size", 1, 1 << 20)
        pages = -(-(prompt_len - start) // page_size)
        parts = {name: part.parse_pages(msg, page_size, prompt_len) for name, part in asked.items()}
        return cls(session, page_size, integer(msg, "row_heads", 1, MAX_HEADS), integer(msg, "first_head", 0, MAX_HEADS),
                   int_list(msg, "k", layers, 0, MAX_ADDRESS), int_list(msg, "v", layers, 0, MAX_ADDRESS),
                   int_list(msg, "pages", pages, 0, MAX_TOKENS), parts)


@dataclass(frozen=True)
class Ask:
    """A decode rank's ask to a prefill rank (protocol step 2): tokens
    ``[decode_prefix_len, prompt_len)`` of ``room``'s prompt, model-global KV ``heads``;
    ``askers``: how many decode ranks ask; ``expires_in``: seconds until the asker gives up;
    ``parts``: the layers asked apart, by component (a hybrid decode pool's window tail);
    ``state``: the recurrent states wanted (:mod:`~.state_tail`; None: none)."""

    room: int
    decode_prefix_len: int
    prompt_len: int
    heads: range
    askers: int
    expires_in: float
    mooncake: Optional[MooncakeTarget] = None
    parts: dict[str, TailAsk] = field(default_factory=dict)
    state: Optional[StateAsk] = None

    def to_wire(self) -> dict:
        msg = {"room": self.room, "decode_prefix_len": self.decode_prefix_len, "prompt_len": self.prompt_len,
               "heads": [self.heads.start, self.heads.stop], "askers": self.askers, "expires_in": self.expires_in}
        if self.mooncake is not None:
            msg["mooncake"] = self.mooncake.to_wire()
        for part in self.parts.values():
            msg.update(part.to_wire())
        if self.state is not None:
            msg.update(self.state.to_wire())
        return msg

    @classmethod
    def parse(cls, msg: dict, layers: int) -> "Ask":
        """``layers``: the prefill pool's (a Mooncake target lists one address per layer)."""
        prompt_len = integer(msg, "prompt_len", 0, MAX_TOKENS)
        start = integer(msg, "decode_prefix_len", 0, prompt_len)
        parts = {p.name: part for p in PARTS if (part := p.parse(msg, layers, prompt_len)) is not None}
        mooncake = MooncakeTarget.parse(msg["mooncake"], layers, start, prompt_len, parts) \
            if "mooncake" in msg else None
        return cls(integer(msg, "room", 0, MAX_ROOM), start, prompt_len, head_range(msg, "heads"),
                   integer(msg, "askers", 1, MAX_ASKERS), number(msg, "expires_in", 0.0, math.inf), mooncake, parts,
                   StateAsk.parse(msg, prompt_len))


@dataclass(frozen=True)
class RouteAnswer:
    """The prefill server's route (protocol step 1): every rank's KV socket and heads, and the
    shape of its KV (to refuse a prefill server of another model or dtype) and of a rank's
    recurrent state slot (``state_bytes``; 0: none)."""

    ranks: list[list]  # RankEndpoint wire items, checked
    layers: int
    head_bytes: int
    dtype: str
    state_bytes: int = 0

    @classmethod
    def parse(cls, msg: dict) -> "RouteAnswer":
        ranks = msg.get("route")
        if not isinstance(ranks, list) or not 1 <= len(ranks) <= MAX_RANKS:
            raise WireError(f"'route' must list 1 to {MAX_RANKS} ranks")
        for item in ranks:
            if not isinstance(item, list) or len(item) != 4:
                raise WireError("a route entry must be [host, port, first_head, end_head]")
            host(item[0], "a prefill rank's host")
            integer({"port": item[1]}, "port", 1, 65535)
            head_range({"heads": item[2:]}, "heads")
        dtype = msg.get("dtype")
        if not isinstance(dtype, str) or len(dtype) > 64:
            raise WireError("'dtype' must be a short string")
        state_bytes = integer(msg, "state_bytes", 0, 1 << 40) if "state_bytes" in msg else 0
        return cls(ranks, integer(msg, "layers", 1, MAX_LAYERS), integer(msg, "head_bytes", 1, 1 << 24), dtype,
                   state_bytes)


@dataclass(frozen=True)
class Answer:
    """A prefill rank's answer header (protocol step 3): an error, or tokens ``[start, end)``
    of ``layers`` layers for ``heads``, sent as frames or (``written`` bytes) by Mooncake, and the
    recurrent states at ``state_at`` (positions; empty: none)."""

    room: int
    error: str = ""
    first_token: int = -1
    start: int = 0
    end: int = 0
    layers: int = 0
    heads: range = range(0)
    written: Optional[int] = None
    parts: dict[str, int] = field(default_factory=dict)  # the ask's parts' first tokens, echoed
    state_at: tuple[int, ...] = ()

    @classmethod
    def parse(cls, msg: dict, vocab_size: int) -> "Answer":
        """``vocab_size``: the decode model's; a first token outside it would crash its forward."""
        room = integer(msg, "room", 0, MAX_ROOM)
        if "error" in msg:
            return cls(room, error=error_text(msg["error"]))
        end = integer(msg, "end", 0, MAX_TOKENS)
        written = integer(msg, "written", 0, 1 << 62) if "written" in msg else None
        return cls(room, "", integer(msg, "first_token", 0, vocab_size - 1), integer(msg, "start", 0, end), end,
                   integer(msg, "layers", 1, MAX_LAYERS), head_range(msg, "heads"), written,
                   {p.name: first for p in PARTS if (first := p.parse_echo(msg, end)) is not None},
                   positions(msg, "state_at", end) if "state_at" in msg else ())
