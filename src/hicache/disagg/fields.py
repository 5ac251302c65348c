"""The fields of a P/D message, each checked on its own: a parser returns a value within bounds
(integers are integers, not bools or floats; numbers are finite; lists have the expected length;
strings are short) or raises :class:`WireError` with one sentence, whatever the value. The
messages that use them: :mod:`hicache.disagg.wire` (and a component's part of one, like
:mod:`hicache.disagg.window_tail`)."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_HEADS = 1 << 16  # model-global KV heads
MAX_TOKENS = 1 << 31  # prompt tokens
MAX_ERROR_CHARS = 500  # a peer's error text kept (it ends up in a log line and an HTTP error)
_HOST = re.compile(r"[A-Za-z0-9._:%-]{1,253}")  # a host name, an IPv4 or an IPv6 address (maybe scoped)


class WireError(ValueError):
    """A message that is not what the protocol allows (one sentence)."""


def integer(msg: dict, key: str, lo: int, hi: int) -> int:
    value = msg.get(key)
    if type(value) is not int or not lo <= value <= hi:  # (bool is an int subclass: refused too)
        raise WireError(f"{key!r} must be an integer in [{lo}, {hi}]")
    return value


def number(msg: dict, key: str, lo: float, hi: float) -> float:
    value = msg.get(key)
    if type(value) not in (int, float) or not lo <= value <= hi:  # NaN fails the comparison; 10**400 > hi
        raise WireError(f"{key!r} must be a number in [{lo}, {hi}]")
    return float(value)


def int_list(msg: dict, key: str, length: int, lo: int, hi: int) -> list[int]:
    value = msg.get(key)
    if not isinstance(value, list) or len(value) != length \
            or any(type(v) is not int or not lo <= v <= hi for v in value):
        raise WireError(f"{key!r} must be a list of {length} integers in [{lo}, {hi}]")
    return value


def head_range(msg: dict, key: str, limit: int = MAX_HEADS) -> range:
    start, stop = int_list(msg, key, 2, 0, limit)
    if start > stop:
        raise WireError(f"{key!r} must be [first, end) with first <= end")
    return range(start, stop)


def host(value: Any, what: str = "host") -> str:
    """A host name or IP address (no scheme, port, spaces or wildcards)."""
    if not isinstance(value, str) or not _HOST.fullmatch(value):
        raise WireError(f"{what} must be a host name or an IP address")
    return value


def error_text(value: Any) -> str:
    return (value if isinstance(value, str) else json.dumps(value)[:MAX_ERROR_CHARS])[:MAX_ERROR_CHARS] or "no reason"
