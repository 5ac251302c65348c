"""Function calling over the OpenAI chat API: the tool list in the prompt, forced calls through a
grammar, the model's reply parsed into ``message.tool_calls``.

The format calls are written in is the model family's (:mod:`.tool_formats`: Hermes/Qwen2.5
``<tool_call>`` tags, Llama 3.x JSON, Mistral ``[TOOL_CALLS]``), chosen from the chat template
(``--tool-call-parser auto``) or named. A chat template that takes ``tools`` renders the list
itself; otherwise (SmolLM2's) the list and the format are described in a system message, assistant
calls in the history are written back in the format and ``tool`` results go in as user turns
inside ``<tool_response>`` tags.

``tool_choice``: ``none`` -- the tools are not shown, nothing is parsed; ``auto`` -- the model may
call (its reply is parsed; a malformed call stays text); ``required`` or a named function -- the
reply is one or more calls (one with ``parallel_tool_calls: false``, exactly one for a named
function) under a Lark grammar whose arguments follow each function's JSON schema, so they always
parse and validate. Under ``auto`` the same grammar is *lazy* (``--tool-call-grammar lazy``, the
default, as llama.cpp's): the reply is free until it begins a call in the format's way
(``CallFormat.lazy_grammar``: ``<tool_call>``, a reply that opens with ``{"name"``), then the call
names one of the functions and its arguments follow the schema. A reply cut by ``max_tokens`` keeps every call finished before the cut (its
finish reason stays ``length``); the unfinished one is dropped, never returned as text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .protocol import APIError
from .tool_formats import HERMES, CallFormat, SpecialId, ToolCall, Triggers, template_calls


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


@dataclass
class ChatPrompt:
    """A chat request made ready for the template: its messages, the ``tools`` for a template
    that renders them, the functions whose calls are parsed from the reply (empty: none), the
    grammar of a forced call (Lark) or None, and under ``auto`` the lazy grammar of a call the model
    begins with its triggers, or None."""

    messages: list[dict[str, Any]]
    template_tools: Optional[list[dict[str, Any]]]
    call_names: frozenset[str]
    forced_grammar: Optional[str]
    lazy_grammar: Optional[tuple[str, Triggers]] = None


def chat_prompt(messages: list[Any], tools: Optional[list[Any]], tool_choice: Any, parallel: bool,
                renders_tools: bool, fmt: CallFormat = HERMES, special_id: SpecialId = lambda _: None,
                lazy: bool = False) -> ChatPrompt:
    """``messages`` (protocol ChatMessage) with the tools and past calls written in (module docstring),
    in ``fmt``; ``special_id``: a marker's id where the vocabulary has it as a special token; ``lazy``:
    make the lazy grammar of ``auto`` calls."""
    schemas = check_tools(tools or [])
    mode, names = chosen(schemas, tool_choice)
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = ("system" if m.role == "developer" else m.role), m.text()
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls and renders_tools:
            msg["tool_calls"] = template_calls(m.tool_calls)
        elif m.tool_calls:
            msg["content"] = f"{content}\n{fmt.render(m.tool_calls)}" if content else fmt.render(m.tool_calls)
        if role == "tool" and not renders_tools:
            msg = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        out.append(msg)
    # The tools stay in the prompt under tool_choice "none" too (vLLM's default): the conversation's
    # prefix, cached on earlier turns, stays the same; only calls are not parsed.
    if tools and not renders_tools:
        text = fmt.system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    # A named function is called exactly once (as vLLM and SGLang force it); "required" follows parallel_tool_calls.
    named = mode == "forced" and isinstance(tool_choice, dict)
    grammar = fmt.grammar(schemas, names, parallel and not named, special_id) if mode == "forced" else None
    lazy_grammar = fmt.lazy_grammar(schemas, names, parallel, special_id) if mode == "auto" and lazy else None
    return ChatPrompt(out, tools if tools and renders_tools else None,
                      frozenset(names) if mode != "none" else frozenset(), grammar, lazy_grammar)


# A choice's streamed chunk: (new text, finish reason or None, first chunk?, the new tokens' logprobs)
ChunkFn = Callable[[str, Optional[str], bool, list], dict[str, Any]]


class ChatChunks:
    """Streamed chat deltas of choice ``index``: text is sent as it comes, except what may begin a
    tool call, which is held until the reply is whole and parsed into ``tool_calls`` deltas (one per
    call, with its whole arguments, as the OpenAI SDK's stream accumulators expect). ``logprobs``
    writes the chunk's tokens' logprobs (None: not asked)."""

    def __init__(self, base: dict[str, Any], call_names: frozenset[str], index: int = 0,
                 logprobs: Optional[Callable[[list], dict[str, Any]]] = None, fmt: CallFormat = HERMES) -> None:
        self.base, self.call_names, self.index, self.logprobs, self.fmt = base, call_names, index, logprobs, fmt
        self.text, self.sent = "", 0

    def __call__(self, text: str, finish: Optional[str], first: bool, entries: list) -> dict[str, Any]:
        self.text += text
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if finish is None:
            end = len(self.text) - self.fmt.held_back(self.text) if self.call_names else len(self.text)
            piece, self.sent = self.text[self.sent:max(end, self.sent)], max(end, self.sent)
            if piece or first:
                delta["content"] = piece
        else:
            content, calls = parse_reply(self.text[self.sent:], finish, self.call_names, self.fmt)
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = [c.openai(index=i) for i, c in enumerate(calls)]
                finish = _finish(finish, calls)
        lp = self.logprobs(entries) if self.logprobs is not None and finish is None else None
        return {**self.base, "choices": [{"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}


def parse_reply(text: str, finish_reason: str, call_names: frozenset[str],
                fmt: CallFormat = HERMES) -> tuple[Optional[str], list[ToolCall]]:
    """A whole reply's ``(content, calls)``: calls to ``call_names`` only (none without tools); a call
    that max_tokens cut is dropped, not returned as content."""
    return fmt.parse(text, set(call_names), finish_reason == "length") if call_names else (text, [])


def chat_message(text: str, finish_reason: str, call_names: frozenset[str],
                 fmt: CallFormat = HERMES) -> tuple[dict[str, Any], str]:
    """A whole reply as the OpenAI ``message`` and its finish reason ("tool_calls" when it calls)."""
    content, calls = parse_reply(text, finish_reason, call_names, fmt)
    if not calls:
        return {"role": "assistant", "content": content if finish_reason == "length" else text}, finish_reason
    return ({"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]},
            _finish(finish_reason, calls))


def _finish(finish_reason: str, calls: list[ToolCall]) -> str:
    """"tool_calls" for a reply that calls, unless max_tokens cut it ("length": a call may be missing)."""
    return "tool_calls" if calls and finish_reason != "length" else finish_reason
