"""Anthropic's ``cache_control`` breakpoints as retention hints, and the usage Anthropic reports for them.

A breakpoint (``{"type": "ephemeral", "ttl": "5m" | "1h"}``, ttl 5m by default) on a system block,
a tool definition or a message's content block (text, ``tool_use``, ``tool_result``) asks that the
prompt up to and including that block be kept: a :class:`RetentionHint` of ``tokens`` = where that
prefix ends in the rendered prompt, for 300 or 3600 seconds. A top-level ``cache_control`` marks the
last block of the last message (Anthropic's automatic caching). At most :data:`MAX_BREAKPOINTS`
per request, as Anthropic; a bad type or ttl is a 400 naming the field.

Where a block ends (:func:`breakpoint_hints`) is read off the template's own rendering, for any
template: the request is rendered again with :data:`MARK` (a private-use character no template
writes) right after the block -- appended to a text block's or a tool result's text; for a
``tool_use`` block or a tool definition, the container is cut after it and a sentinel call or tool
added, rendered with and without it -- and the block ends where the two renderings first differ.
That character offset becomes a token count through the tokenizer's offsets (whole tokens only),
taken when the prompt is tokenized. It costs one or two renderings per breakpoint (at most eight;
5-8 ms in all for the three breakpoints of a 19K-token Claude Code prompt, on a busy 2-core machine).

Usage (:func:`anthropic_usage`), as Anthropic defines it: ``cache_read_input_tokens`` the prompt
tokens the prefix cache served (every tier); ``cache_creation_input_tokens`` what this request
wrote at its breakpoints, ``max(0, last breakpoint - read)``, split in ``cache_creation`` by the
ttl of the breakpoint span each token falls in; ``input_tokens`` the rest, so that
``input + read + creation`` = the prompt's tokens, always.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..cache_hints import RetentionHint
from .protocol import APIError

logger = logging.getLogger(__name__)

MAX_BREAKPOINTS = 4  # Anthropic's limit per request
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
MARK = "\ue000"  # a private-use character: where a rendering with it first differs, the block ended
SENTINEL = "hicache_breakpoint_sentinel"  # the call or tool added after a tool_use block or a tool


@dataclass(frozen=True)
class Breakpoint:
    """A ``cache_control`` on ``system[index]``, ``tools[index]`` or ``messages[index].content[block]``
    (``block`` None: a message whose content is a string, marked by the top-level cache_control)."""

    where: str  # "system" | "tools" | "messages"
    index: int
    block: Optional[int]
    ttl: str


def _ttl(cc: Any, field: str) -> str:
    """The ttl of one ``cache_control`` object (400 naming the field when it is not one)."""
    if not isinstance(cc, dict):
        raise APIError(400, f"{field} must be an object such as {{\"type\": \"ephemeral\"}}.", param=field)
    if cc.get("type") != "ephemeral":
        raise APIError(400, f"{field}.type must be 'ephemeral', got {cc.get('type')!r}.", param=f"{field}.type")
    ttl = cc.get("ttl", "5m")
    if ttl not in TTL_SECONDS:
        raise APIError(400, f"{field}.ttl must be '5m' or '1h', got {ttl!r}.", param=f"{field}.ttl")
    return ttl


def read_breakpoints(body: Any) -> list[Breakpoint]:
    """The breakpoints of a Messages request (server/anthropic.py's ``MessagesRequest``), in prompt
    order; 400 for a malformed one or more than :data:`MAX_BREAKPOINTS`."""
    found: list[Breakpoint] = []
    for i, tool in enumerate(body.tools or []):
        if tool.cache_control is not None:
            found.append(Breakpoint("tools", i, None, _ttl(tool.cache_control, f"tools[{i}].cache_control")))
    for i, block in enumerate(body.system if isinstance(body.system, list) else []):
        if block.cache_control is not None:
            found.append(Breakpoint("system", i, None, _ttl(block.cache_control, f"system[{i}].cache_control")))
    for i, m in enumerate(body.messages):
        for j, block in enumerate(m.content if isinstance(m.content, list) else []):
            if getattr(block, "cache_control", None) is not None:
                field = f"messages[{i}].content[{j}].cache_control"
                found.append(Breakpoint("messages", i, j, _ttl(block.cache_control, field)))
    if body.cache_control is not None:  # automatic: the last block of the last message
        last = body.messages[-1].content
        block = len(last) - 1 if isinstance(last, list) and last else None
        found.append(Breakpoint("messages", len(body.messages) - 1, block, _ttl(body.cache_control, "cache_control")))
    if len(found) > MAX_BREAKPOINTS:
        raise APIError(400, f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                            f"Found {len(found)}.", param="cache_control")
    return found


def _marked(body: Any, bp: Breakpoint, sentinel: Callable[[str, dict], Any]) -> tuple[Optional[Any], Any]:
    """Two requests whose renderings first differ where ``bp``'s block ends: ``(None: body itself, body
    with MARK after the block's text)``, or ``(cut after the block, cut + a sentinel)`` for a call or a
    tool. ``sentinel(kind, fields)`` builds a "tool", a "tool_use" block or a "text" block. Only what
    changes is copied (``body`` is left as it is)."""
    base = body.model_copy(update={"tool_choice": {"type": "none"}})  # (renders the same; no call grammar built)
    if bp.where == "tools":
        cut = base.model_copy(update={"tools": base.tools[: bp.index + 1]})
        tool = sentinel("tool", {"name": SENTINEL, "input_schema": {"type": "object"}})
        return cut, cut.model_copy(update={"tools": [*cut.tools, tool]})
    if bp.where == "system":
        system = list(base.system)
        system[bp.index] = system[bp.index].model_copy(update={"text": system[bp.index].text + MARK})
        return None, base.model_copy(update={"system": system})
    m = base.messages[bp.index]
    if bp.block is None:
        return None, _with_message(base, bp.index, m.content + MARK)
    block = m.content[bp.block]
    if block.type == "tool_use":
        kept = m.content[: bp.block + 1]
        call = sentinel("tool_use", {"type": "tool_use", "id": SENTINEL, "name": SENTINEL, "input": {}})
        return _with_message(base, bp.index, kept), _with_message(base, bp.index, [*kept, call])
    if block.type == "tool_result":
        text = block.content + MARK if isinstance(block.content, str) else [
            *block.content, sentinel("text", {"type": "text", "text": MARK})]
        block = block.model_copy(update={"content": text})
    else:  # text
        block = block.model_copy(update={"text": block.text + MARK})
    return None, _with_message(base, bp.index, [*m.content[: bp.block], block, *m.content[bp.block + 1:]])


def _with_message(body: Any, index: int, content: Any) -> Any:
    """``body`` with ``messages[index]``'s content replaced (copies of the request and the message only)."""
    messages = list(body.messages)
    messages[index] = messages[index].model_copy(update={"content": content})
    return body.model_copy(update={"messages": messages})


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (slices compared in C, O(n log n))."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def tokens_within(ends: Sequence[int]) -> Callable[[int], int]:
    """``chars -> tokens``: how many of a prompt's tokens lie wholly within its first ``chars``
    characters, from where each ends (``Tokenizer.encode_with_ends``: non-decreasing)."""
    return lambda chars: bisect.bisect_right(ends, chars)


def breakpoint_hints(body: Any, bps: list[Breakpoint], render: Callable[[Any], str], text: str,
                     tokens: Callable[[int], int], sentinel: Callable[[str, dict], Any]) -> tuple[RetentionHint, ...]:
    """A hint per breakpoint: the prompt's tokens up to the end of its block (module docstring).
    ``render(body)`` is a Messages request's prompt text; ``text`` is ``body``'s; ``tokens`` maps
    its characters to tokens (:func:`tokens_within`). A block the rendering does not show (e.g. a
    system block that is only Claude Code's attribution line) asks nothing."""
    hints = []
    for bp in bps:
        cut, marked = _marked(body, bp, sentinel)
        try:
            base = text if cut is None else render(cut)
            end = min(common_prefix(base, render(marked)), common_prefix(base, text))
        except APIError as e:  # (the cut or marked request would not render: said, and nothing asked)
            logger.warning("a cache_control breakpoint at %s[%d] is not honoured: %s", bp.where, bp.index, e.message)
            continue
        if end < len(base):
            hints.append(RetentionHint(tokens=tokens(end), seconds=TTL_SECONDS[bp.ttl], ttl=bp.ttl))
    return tuple(hints)


def anthropic_usage(prompt_tokens: int, cached: dict[str, int], output_tokens: int,
                    hints: Sequence[RetentionHint]) -> dict[str, Any]:
    """Anthropic's usage of a request (module docstring), with ``hicache_cached_tokens`` per tier."""
    read = sum(cached.values())
    marks = sorted((h.tokens, h.ttl) for h in hints if h.tokens is not None)
    last = marks[-1][0] if marks else 0
    by_ttl = {ttl: 0 for ttl in TTL_SECONDS}
    start = 0
    for end, ttl in marks:  # the span (start, end] is written at this breakpoint, with its ttl
        by_ttl[ttl] += max(0, min(end, last) - max(start, read))
        start = max(start, end)
    creation = max(0, last - read)
    return {"input_tokens": prompt_tokens - read - creation, "output_tokens": output_tokens,
            "cache_read_input_tokens": read, "cache_creation_input_tokens": creation,
            "cache_creation": {"ephemeral_5m_input_tokens": by_ttl["5m"], "ephemeral_1h_input_tokens": by_ttl["1h"]},
            "hicache_cached_tokens": dict(cached)}
