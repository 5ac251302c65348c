"""Mooncake-format traces (the FAST'25 release's ``conversation_trace.jsonl`` and its kind).

One JSON object per line: ``timestamp`` (ms since the trace's start), ``input_length`` and
``output_length`` (tokens), ``hash_ids`` (the prompt's blocks, ``BLOCK_TOKENS`` tokens each, the
last one partial; equal ids mean an equal block *and* an equal prefix before it, so a
request's prefix is reusable exactly as far as its ids were seen in that order before).

Optional fields (the agentic trace, :mod:`hicache.sim.agentic`, writes them; Mooncake files lack
them): ``block_tokens`` (real tokens per block when not ``BLOCK_TOKENS``), ``class``,
``session``, ``turn``, ``after_pause``, ``pause_s``, ``roles`` and ``hints`` (retention hints in whole
blocks: ``{"blocks": k or null, "seconds": s, "ttl": "5m"}``); they are kept, not interpreted.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, Iterator, TypeVar

BLOCK_TOKENS = 512  # real tokens per hash_ids block in the Mooncake release
# The Mooncake FAST'25 conversation trace (Apache-2.0), shipped with hicache: see data/README.md.
SHIPPED_TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "mooncake_conversation_trace.jsonl")


T = TypeVar("T")


class TraceError(ValueError):
    """A trace line that is not a request; the message names the file and line."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int = BLOCK_TOKENS  # real tokens per block
    # The agentic trace's fields (hicache.sim.agentic); a Mooncake line has the defaults.
    cls: str = ""  # "lead" | "subagent" | "flood"
    session: str = ""
    turn: int = 1
    after_pause: bool = False
    pause_s: float = 0.0  # the pause before this turn, after the session's previous turn ended
    hints: tuple[dict, ...] = ()  # {"blocks": int | None, "seconds": float, "ttl": str}
    roles: str = ""  # one letter per block: "s" system, "u" user, "a" assistant ("": unknown)

    def block_lengths(self) -> list[int]:
        """Real tokens of each block: ``block_tokens``, the last one capped at the input length."""
        b = self.block_tokens
        return [min(b, self.input_length - i * b) for i in range(len(self.hash_ids))]


def _request(obj: object) -> TraceRequest:
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    ids, n_in, block = obj["hash_ids"], obj["input_length"], obj.get("block_tokens", BLOCK_TOKENS)
    if not isinstance(block, int) or block < 1:
        raise ValueError("block_tokens must be a positive integer")
    if not isinstance(n_in, int) or n_in <= 0 or not isinstance(obj["output_length"], int) or obj["output_length"] < 0:
        raise ValueError("input_length must be a positive integer and output_length a non-negative one")
    if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError("hash_ids must be a list of non-negative integers")
    if len(ids) != math.ceil(n_in / block):
        raise ValueError(f"{len(ids)} hash_ids for {n_in} input tokens (blocks of {block}: expected "
                         f"{math.ceil(n_in / block)})")
    if not isinstance(obj["timestamp"], (int, float)):
        raise ValueError("timestamp must be a number (ms)")
    return TraceRequest(float(obj["timestamp"]), n_in, obj["output_length"], tuple(ids), block, **_agentic(obj))


def _agentic(obj: dict) -> dict:
    """The optional agentic fields of a line, checked, as :class:`TraceRequest` keywords."""
    hints = obj.get("hints", [])
    if not isinstance(hints, list) or not all(isinstance(h, dict) and isinstance(h.get("seconds"), (int, float))
                                              and (h.get("blocks") is None or isinstance(h["blocks"], int))
                                              for h in hints):
        raise ValueError('hints must be a list of {"blocks": int or null, "seconds": number, "ttl": str}')
    roles = obj.get("roles", "")
    if not isinstance(roles, str) or roles and (len(roles) != len(obj["hash_ids"]) or set(roles) - set("sua")):
        raise ValueError('roles must be a string of one letter per block: "s", "u" or "a"')
    turn = obj.get("turn", 1)
    if not isinstance(turn, int) or turn < 1:
        raise ValueError("turn must be a positive integer")
    return {"cls": str(obj.get("class", "")), "session": str(obj.get("session", "")), "turn": turn,
            "after_pause": bool(obj.get("after_pause", False)), "pause_s": float(obj.get("pause_s", 0.0)),
            "hints": tuple(hints), "roles": roles}


def json_lines(path: str, parse: Callable[[Any], T], error: type[ValueError] = ValueError) -> Iterator[T]:
    """``parse`` of each non-blank line of the JSON Lines file ``path``, in file order; raises
    ``error`` naming the line of the first one that does not parse (ValueError, TypeError or
    AttributeError from ``parse``)."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield parse(json.loads(line))
            except (ValueError, TypeError, AttributeError) as e:  # json.JSONDecodeError is a ValueError
                raise error(f"{path} line {number}: {e}") from None


def read_trace(path: str, limit: int | None = None) -> Iterator[TraceRequest]:
    """The requests of ``path`` in file order (the first ``limit``); raises :class:`TraceError`
    naming the line of the first malformed one."""
    return islice(json_lines(path, _request, TraceError), limit)


def load_trace(path: str, limit: int | None = None) -> list[TraceRequest]:
    """:func:`read_trace` as a list, sorted by arrival (stable: file order breaks ties)."""
    return sorted(read_trace(path, limit), key=lambda r: r.timestamp_ms)


def largest_conversations(path: str, conversations: int, requests: int, max_blocks: int) -> list[str]:
    """Lines of ``path`` kept whole (real requests, for small replays with plenty of reuse): the
    requests of its ``conversations`` largest conversations (requests sharing their first two
    blocks), prompts of at most ``max_blocks`` blocks, the first ``requests`` of them in file order."""
    from collections import Counter

    with open(path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    ids = [json.loads(line)["hash_ids"] for line in lines]
    big = {h for h, _ in Counter(tuple(i[:2]) for i in ids if len(i) >= 2).most_common(conversations)}
    return [line for line, i in zip(lines, ids) if tuple(i[:2]) in big and len(i) <= max_blocks][:requests]
