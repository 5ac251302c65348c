"""Tools a request lists that this server cannot run, dropped rather than refused.

Coding agents list the provider's built-in tools beside their own function tools (Codex: a
``web_search`` tool, and a ``namespace`` tool nesting seven function tools; Anthropic clients:
server tools such as ``web_search_20250305``). The provider runs those itself; this server has
no web search or code interpreter, so such a tool is dropped from the prompt and the request is
served with the rest: the model never sees it and cannot call it. A ``namespace``'s function
tools are flattened in under their own names, and a call of one names its namespace again
(``namespace`` on the ``function_call`` item, as OpenAI's API does: Codex routes such a call by
both). Each dropped tool is named once in the log (per
server process) and, on every response that dropped any, in the :data:`DROPPED_TOOLS_HEADER`
header (comma-separated, each name once). A tool without a ``type`` or a malformed function tool
is kept, for the chat machinery to refuse in its own sentence (server/tools.py ``check_tools``).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

DROPPED_TOOLS_HEADER = "X-Hicache-Dropped-Tools"

_LOGGED: set[str] = set()  # tool names already logged as dropped (once each per process)
_NAME_MAX = 64  # a tool type as logged and in the header (a client may send any string)
_LOGGED_MAX = 256  # names come from clients: past this many, new ones are still dropped and named, not remembered


def split_responses_tools(tools: list[Any]) -> tuple[list[Any], list[str]]:
    """``(function tools, dropped names)`` of a Responses API ``tools`` list: ``function`` tools
    kept, a ``namespace``'s tools flattened in (recursively), every other type dropped."""
    kept: list[Any] = []
    dropped: list[str] = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace" and isinstance(tool.get("tools"), list):
            inner, inner_dropped = split_responses_tools(tool["tools"])
            kept, dropped = kept + inner, dropped + inner_dropped
        elif kind == "function" or not isinstance(kind, str):
            kept.append(tool)
        else:
            dropped.append(kind)
    return kept, dropped


def tool_namespaces(tools: list[Any]) -> dict[str, str]:
    """``{function name: namespace name}`` of the function tools a Responses ``tools`` list nests in a
    ``namespace`` tool (the innermost one where namespaces nest)."""
    found: dict[str, str] = {}
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            if isinstance(tool.get("name"), str):
                found.update({fn["name"]: tool["name"] for fn in tool["tools"] if isinstance(fn, dict)
                              and fn.get("type") == "function" and isinstance(fn.get("name"), str)})
            found.update(tool_namespaces(tool["tools"]))
    return found


def split_chat_tools(tools: list[Any]) -> tuple[list[Any], list[str]]:
    """``(function tools, dropped names)`` of a Chat Completions ``tools`` list (``custom`` and
    other non-function types dropped)."""
    kept = [t for t in tools if not isinstance(t, dict) or t.get("type") == "function"
            or not isinstance(t.get("type"), str)]
    return kept, [t["type"] for t in tools if t not in kept]


def note_dropped(names: list[str]) -> tuple[str, ...]:
    """``names`` once each, in order; logs those not logged before by this process."""
    unique = tuple(dict.fromkeys(n[:_NAME_MAX] for n in names))
    new = [n for n in unique if n not in _LOGGED]
    if new:
        if len(_LOGGED) < _LOGGED_MAX:
            _LOGGED.update(new)
        logger.info("dropping tools this server cannot run (built-in / server tools): %s", ", ".join(new))
    return unique


def dropped_header(names: tuple[str, ...]) -> dict[str, str]:
    """The response header naming the dropped tools (none when nothing was dropped)."""
    return {DROPPED_TOOLS_HEADER: ", ".join(names)} if names else {}
