"""Function calling over the OpenAI chat API: the tool list in the prompt, forced calls through a
grammar, the model's reply parsed into ``message.tool_calls``.

One tool-call format (``--tool-call-parser qwen25``, also called ``hermes``): the model writes each
call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. A chat template that
takes ``tools`` renders the list itself; otherwise (SmolLM2's) the list and the format are
described in a system message (:func:`tools_system_text`), assistant calls in the history are
written back in the same tags and ``tool`` results go in as user turns inside
``<tool_response>`` tags.

``tool_choice``: ``none`` -- the tools are not shown, nothing is parsed; ``auto`` -- the model may
call (its reply is parsed; a malformed call stays text); ``required`` or a named function -- the
reply is one or more calls (one with ``parallel_tool_calls: false``, exactly one for a named
function) under a Lark grammar whose arguments follow each function's JSON schema, so they always
parse and validate. A reply cut by ``max_tokens`` keeps every call finished before the cut (its
finish reason stays ``length``); the unfinished one is dropped, never returned as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .protocol import APIError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text

    def openai(self, index: Optional[int] = None) -> dict[str, Any]:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{name: parameters schema}``; 400 for a tool that is not a well-formed function."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}.", param="tools")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise APIError(400, f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'.",
                           param="tools")
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema object.", param="tools")
        if params.get("type", "object") != "object":  # as OpenAI and Anthropic refuse it
            raise APIError(400, f"tools[{i}].function.parameters must describe an object (\"type\": \"object\"): a "
                                f"call's arguments are a JSON object, not {params.get('type')!r}.", param="tools")
        out[name] = params
    return out


def chosen(tools: dict[str, dict[str, Any]], tool_choice: Any) -> tuple[str, list[str]]:
    """``(mode, names)``: mode ``none`` | ``auto`` | ``forced``; the functions a forced call may use."""
    if tool_choice is None or tool_choice == "auto":
        return ("auto", list(tools)) if tools else ("none", [])
    if tool_choice == "none":
        return "none", []
    if tool_choice == "required":
        if not tools:
            raise APIError(400, "tool_choice 'required' needs tools.", param="tool_choice")
        return "forced", list(tools)
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}.", param="tool_choice")
    if name not in tools:
        raise APIError(400, f"tool_choice names '{name}', which is not in tools.", param="tool_choice")
    return "forced", [name]


def call_grammar(tools: dict[str, dict[str, Any]], names: list[str], parallel: bool) -> str:
    """A Lark grammar (llguidance's, with inline ``%json``) for one or more calls of ``names``, whose
    arguments are always a JSON object (what :func:`parse_calls` takes as a call)."""
    rules = []
    for i, name in enumerate(names):
        arguments = {**tools[name], "type": "object"}  # a schema without a type could take any JSON value
        schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
                  "required": ["name", "arguments"], "additionalProperties": False,
                  "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
        rules.append(f"fn{i}: %json {json.dumps(schema)}")
    alternatives = " | ".join(f"fn{i}" for i in range(len(names)))
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    call = f'call: "{CALL_OPEN}\\n" ({alternatives}) "\\n{CALL_CLOSE}"'
    return "\n".join([start, call, *rules])


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """The tool list and the call format, for a chat template that does not render tools."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions to help with the user's request. Their signatures, one JSON object a line, "
            f"are inside <tools></tools>:\n<tools>\n{listing}\n</tools>\n\n"
            "To call a function, answer with one JSON object per call, each inside "
            f"{CALL_OPEN}{CALL_CLOSE} tags:\n{CALL_OPEN}\n"
            '{"name": "<function name>", "arguments": {<arguments as a JSON object>}}\n'
            f"{CALL_CLOSE}")


def render_calls(calls: list[dict[str, Any]]) -> str:
    """Assistant ``tool_calls`` from the history, written back the way the model writes them."""
    parts = []
    for call in calls:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments", "{}")
        try:
            args_obj = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            args_obj = args
        parts.append(f"{CALL_OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': args_obj})}\n{CALL_CLOSE}")
    return "\n".join(parts)


def tool_response(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def parse_calls(text: str, names: set[str], truncated: bool = False) -> tuple[Optional[str], list[ToolCall]]:
    """``(content, calls)`` of a reply: each well-formed ``<tool_call>`` of a known function
    becomes a call; the rest of the text is the content (None when nothing is left). ``truncated``
    (cut by max_tokens): a call left open at the end -- or the start of its tag -- is dropped, not
    returned as content."""
    calls, kept, last = [], [], 0
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(obj.get("arguments", {}), dict):
            continue
        calls.append(ToolCall(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False)))
        kept.append(text[last:m.start()])
        last = m.end()
    tail = text[last:]
    kept.append(tail[:len(tail) - held_back(tail)] if truncated else tail)
    content = "".join(kept).strip()
    return (content or None), calls


def held_back(text: str) -> int:
    """How many characters at the end of streamed ``text`` may begin a tool call: from the first
    ``<tool_call>``, or a tail that is a prefix of it (they are sent once the reply is parsed)."""
    start = text.find(CALL_OPEN)
    if start >= 0:
        return len(text) - start
    for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(CALL_OPEN[:k]):
            return k
    return 0


@dataclass
class ChatPrompt:
    """A chat request made ready for the template: its messages, the ``tools`` for a template
    that renders them, the functions whose calls are parsed from the reply (empty: none), and the
    grammar of a forced call (Lark) or None."""

    messages: list[dict[str, Any]]
    template_tools: Optional[list[dict[str, Any]]]
    call_names: frozenset[str]
    forced_grammar: Optional[str]


def chat_prompt(messages: list[Any], tools: Optional[list[Any]], tool_choice: Any, parallel: bool,
                renders_tools: bool) -> ChatPrompt:
    """``messages`` (protocol ChatMessage) with the tools and past calls written in (module docstring)."""
    schemas = check_tools(tools or [])
    mode, names = chosen(schemas, tool_choice)
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = ("system" if m.role == "developer" else m.role), m.text()
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls and renders_tools:
            msg["tool_calls"] = m.tool_calls
        elif m.tool_calls:
            msg["content"] = f"{content}\n{render_calls(m.tool_calls)}" if content else render_calls(m.tool_calls)
        if role == "tool" and not renders_tools:
            msg = {"role": "user", "content": tool_response(content)}
        out.append(msg)
    # The tools stay in the prompt under tool_choice "none" too (vLLM's default): the conversation's
    # prefix, cached on earlier turns, stays the same; only calls are not parsed.
    if tools and not renders_tools:
        text = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    # A named function is called exactly once (as vLLM and SGLang force it); "required" follows parallel_tool_calls.
    named = mode == "forced" and isinstance(tool_choice, dict)
    grammar = call_grammar(schemas, names, parallel and not named) if mode == "forced" else None
    return ChatPrompt(out, tools if tools and renders_tools else None,
                      frozenset(names) if mode != "none" else frozenset(), grammar)


# A choice's streamed chunk: (new text, finish reason or None, first chunk?, the new tokens' logprobs)
ChunkFn = Callable[[str, Optional[str], bool, list], dict[str, Any]]


class ChatChunks:
    """Streamed chat deltas of choice ``index``: text is sent as it comes, except what may begin a
    tool call, which is held until the reply is whole and parsed into ``tool_calls`` deltas (one per
    call, with its whole arguments, as the OpenAI SDK's stream accumulators expect). ``logprobs``
    writes the chunk's tokens' logprobs (None: not asked)."""

    def __init__(self, base: dict[str, Any], call_names: frozenset[str], index: int = 0,
                 logprobs: Optional[Callable[[list], dict[str, Any]]] = None) -> None:
        self.base, self.call_names, self.index, self.logprobs = base, call_names, index, logprobs
        self.text, self.sent = "", 0

    def __call__(self, text: str, finish: Optional[str], first: bool, entries: list) -> dict[str, Any]:
        self.text += text
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if finish is None:
            end = len(self.text) - held_back(self.text) if self.call_names else len(self.text)
            piece, self.sent = self.text[self.sent:max(end, self.sent)], max(end, self.sent)
            if piece or first:
                delta["content"] = piece
        else:
            rest = self.text[self.sent:]
            content, calls = parse_calls(rest, set(self.call_names), finish == "length") if self.call_names \
                else (rest or None, [])
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = [c.openai(index=i) for i, c in enumerate(calls)]
                finish = _finish(finish, calls)
        lp = self.logprobs(entries) if self.logprobs is not None and finish is None else None
        return {**self.base, "choices": [{"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}


def chat_message(text: str, finish_reason: str, call_names: frozenset[str]) -> tuple[dict[str, Any], str]:
    """A whole reply as the OpenAI ``message`` and its finish reason ("tool_calls" when it calls)."""
    if not call_names:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse_calls(text, set(call_names), finish_reason == "length")
    if not calls:
        return {"role": "assistant", "content": content if finish_reason == "length" else text}, finish_reason
    return ({"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]},
            _finish(finish_reason, calls))


def _finish(finish_reason: str, calls: list[ToolCall]) -> str:
    """"tool_calls" for a reply that calls, unless max_tokens cut it ("length": a call may be missing)."""
    return "tool_calls" if calls and finish_reason != "length" else finish_reason
