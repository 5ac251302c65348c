"""Anthropic's Messages API over the chat machinery: ``POST /v1/messages`` (streamed as its typed
events or not) and ``POST /v1/messages/count_tokens``.

A request becomes the chat request it means (:func:`as_chat`): ``system`` a system message (less
Claude Code's attribution line, :data:`BILLING_HEADER`, whose per-request values would defeat the prefix cache;
a ``system`` role message mid-conversation one too, placed where the template can take it:
server/system_turns.py), text blocks the turn's text, an assistant's ``tool_use`` blocks its tool
calls, a user's ``tool_result`` blocks tool messages; ``tools`` (``input_schema``) function tools; ``tool_choice`` auto / any / tool
/ none the chat API's auto / required / named / none (``disable_parallel_tool_use``:
``parallel_tool_calls: false``); ``stop_sequences`` stop strings. It is then prepared, vetted and
run exactly as a chat completion (the template, forced-call grammars, the prefix cache), and the
reply written back as content blocks: text, then one ``tool_use`` block per call (parsed from the
reply as :mod:`.tools` parses it; a call cut by ``max_tokens`` is dropped).

Image and document blocks (in a message or a tool result) are refused in a sentence of their own:
the models served are text-only.

Server tools (a ``type`` other than ``custom``: ``web_search_20250305``, ...) are dropped and named
(server/builtin_tools.py). ``max_tokens`` is a cap, served within the context's rest (Claude Code
asks 32K-64K of a model that may hold less). A stream sends ``message_start`` once the prompt is
admitted, before its first token (its usage splits cached and computed input), ``ping`` events while
it waits for that, then empty ``text_delta`` events while the prompt prefills (server/keepalive.py).

``stop_reason``: ``tool_use``, ``max_tokens``, ``stop_sequence`` (with the one that matched) or
``end_turn``. ``cache_control`` breakpoints (on system blocks, tools, content blocks, or the request:
automatic) retain the prompt up to them for their ttl; usage is Anthropic's (``cache_read_input_tokens``
what the prefix cache served, every tier; ``cache_creation_input_tokens`` what this request wrote at its
breakpoints, by ttl in ``cache_creation``; ``input_tokens`` the rest), plus ``hicache_cached_tokens``
per tier and ``hicache_retention`` (what the cache gave the breakpoints): server/cache_control.py; with reuse
after an edit (extension field ``edit_reuse``), ``hicache_edit_reuse`` (its reused tokens are part of
``input_tokens``, never of ``cache_read_input_tokens``: server/edit_reuse_usage.py).
``anthropic-version``, ``anthropic-beta``, ``thinking``, ``metadata``, ``context_management`` and
``output_config`` are accepted and ignored (none changes the output: no thinking blocks are written);
``x-api-key`` is taken as the key (middleware).
Refusals are in Anthropic's error shape (``{"type": "error", "error": {"type", "message"}}``: :func:`error_body`,
which the app answers them with on these routes).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, AsyncIterator, Callable, Iterator, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from ..runtime.request import GenerateResult
from .builtin_tools import dropped_header, note_dropped
from .cache_control import Breakpoint, anthropic_usage, breakpoint_hints, read_breakpoints, tokens_within
from .choices import collect_choices, event_stream, merged_updates, submit_choices
from .edit_reuse_usage import outcome_usage
from .keepalive import ANTHROPIC_PING
from .parsing import parse_body, read_body
from .hints import retention_usage
from .prepare import prepare_chat, render_chat
from .protocol import APIError, ChatCompletionRequest, RequestBody, media_refusal
from .state import ServerState
from .tools import parse_reply
from .submit import (Prepared, ReplyDeltas, engine_dead_during, sse_event, stop_string_matched, vet_grammar,
                     with_reply_room)

logger = logging.getLogger(__name__)


class TextBlock(RequestBody):
    type: Literal["text"]
    text: str
    cache_control: Optional[Any] = None  # a breakpoint (server/cache_control.py), as on the blocks below


class ToolUseBlock(RequestBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Optional[Any] = None


class MediaBlock(RequestBody):
    """An image or document block: parsed only to be refused in a sentence of its own (:func:`as_chat`)."""

    type: Literal["image", "document"]


class ToolResultBlock(RequestBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[Union[TextBlock, MediaBlock]]] = ""
    is_error: bool = False
    cache_control: Optional[Any] = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in _text_blocks(self.content))
        return f"Error: {text}" if self.is_error else text


Block = Union[TextBlock, ToolUseBlock, ToolResultBlock, MediaBlock]


def _text_blocks(blocks: list[Any]) -> list[TextBlock]:
    """``blocks``' text blocks; APIError(400) at the first image or document (text-only models)."""
    for b in blocks:
        if isinstance(b, MediaBlock):
            raise media_refusal(b.type, "messages")
    return [b for b in blocks if isinstance(b, TextBlock)]


class AnthropicMessage(RequestBody):
    role: Literal["user", "assistant", "system"]  # system: mid-conversation system text (server/system_turns.py)
    content: Union[str, list[Block]]


class AnthropicTool(RequestBody):
    """A client tool (no ``type``, or ``custom``), or a server tool (``web_search_20250305``, ...),
    which is dropped (server/builtin_tools.py)."""

    type: Optional[str] = None
    name: str
    description: str = ""
    input_schema: Optional[dict[str, Any]] = None
    cache_control: Optional[Any] = None

    @property
    def server_tool(self) -> bool:
        return self.type not in (None, "custom")


class MessagesRequest(RequestBody):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(1024, ge=1)  # required by Anthropic; count_tokens has none
    system: Optional[Union[str, list[TextBlock]]] = None
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)  # None: the server's default (1 unless set)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = None
    stream: bool = False
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[dict[str, Any]] = None
    cache_control: Optional[Any] = None  # automatic caching: a breakpoint on the last message's last block
    edit_reuse: Optional[bool] = None  # hicache's extension: reuse after an edit (docs/edit_reuse.md)


# Claude Code opens its system prompt with an attribution line whose values it derives from the request's
# content (``cc_version=2.1.197.322``; newer versions add a per-request ``cch=``). Anthropic's API reads it as
# metadata; left in the prompt it changes the first tokens between a session's subagents (each one's ~11K-token
# prompt was computed again) and, with ``cch``, between every two requests. SGLang and vllm-mlx drop it too.
BILLING_HEADER = "x-anthropic-billing-header:"


def _without_billing_line(text: str) -> str:
    """``text`` less a leading :data:`BILLING_HEADER` line (a system block of its own, as Claude Code sends it)."""
    return text.partition("\n")[2] if text.startswith(BILLING_HEADER) else text


def as_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request ``body`` means (module docstring), without ``max_tokens``: the
    caller clips it to the context's rest once the prompt is tokenized (:func:`add_anthropic_routes`)."""
    blocks = [body.system] if isinstance(body.system, str) else [b.text for b in body.system or []]
    system = "".join(_without_billing_line(text) for text in blocks)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if body.system else []
    for m in body.messages:
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        text = "".join(b.text for b in _text_blocks(blocks))
        if m.role == "system":
            messages.append({"role": "system", "content": text})
        elif m.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            messages.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
        else:
            results = [{"role": "tool", "content": b.text(), "tool_call_id": b.tool_use_id}
                       for b in blocks if isinstance(b, ToolResultBlock)]
            messages += results
            if text or not results:
                messages.append({"role": "user", "content": text})
    tools = [t for t in body.tools or [] if not t.server_tool]
    for i, t in enumerate(tools):
        if t.input_schema is None:
            raise APIError(400, f"tools[{i}].input_schema: Field required.", param="tools")
    chat: dict[str, Any] = {  # (a None is the field's default: RequestBody)
        "model": body.model, "messages": messages, "temperature": body.temperature, "stream": body.stream,
        "top_p": body.top_p, "top_k": body.top_k, "stop": body.stop_sequences or None, "edit_reuse": body.edit_reuse,
        "tools": [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                    "parameters": t.input_schema}} for t in tools] or None}
    if body.tool_choice is not None:
        chat["tool_choice"], chat["parallel_tool_calls"] = _tool_choice(body.tool_choice)
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValueError as e:  # what the chat API refuses of the translated request
        raise APIError(400, f"the request cannot be served: {str(e).splitlines()[0]}.") from None


def _tool_choice(choice: dict[str, Any]) -> tuple[Any, bool]:
    kind, parallel = choice.get("type"), not choice.get("disable_parallel_tool_use", False)
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice of type 'tool' needs the tool's name.", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    modes = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in modes:
        raise APIError(400, "tool_choice type must be 'auto', 'any', 'tool' or 'none'.", param="tool_choice")
    return modes[kind], parallel


def _usage(res: GenerateResult, p: Prepared) -> dict[str, Any]:
    """A finished request's usage (server/cache_control.py), with what the cache gave its breakpoints."""
    return {**anthropic_usage(res.prompt_tokens, res.cached_tokens_details, res.completion_tokens, p.hints),
            **outcome_usage([res]), **retention_usage(p.hints, res)}


def _sentinel(kind: str, fields: dict[str, Any]) -> Any:
    """A tool, tool_use block or text block (what server/cache_control.py adds after a breakpoint's block)."""
    return {"tool": AnthropicTool, "tool_use": ToolUseBlock, "text": TextBlock}[kind].model_validate(fields)


def request_hints(st: ServerState, body: MessagesRequest, bps: list[Breakpoint], text: str,
                  ends: list[int]) -> tuple:
    """The retention hints of ``body``'s breakpoints (server/cache_control.py): ``text`` its prompt,
    ``ends`` where each of the prompt's tokens ends in it (``Tokenizer.encode_with_ends``)."""
    def render(b: MessagesRequest) -> str:
        return render_chat(as_chat(b), st)[2]

    return breakpoint_hints(body, bps, render, text, tokens_within(ends), _sentinel)


def _stop(res: GenerateResult, p: Prepared, called: bool, decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """``stop_reason`` and ``stop_sequence`` of a finished reply."""
    if res.finish_reason == "length" or called:
        return {"stop_reason": "max_tokens" if res.finish_reason == "length" else "tool_use", "stop_sequence": None}
    matched = stop_string_matched(res, p.sampling.stop_strings, decode)
    return {"stop_reason": "end_turn" if matched is None else "stop_sequence", "stop_sequence": matched}


def _tool_use(name: str, input: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": name, "input": input}


# Anthropic's error types by HTTP status (its error bodies: {"type": "error", "error": {"type", "message"}})
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")  # the routes whose refusals are answered so


def error_body(e: APIError) -> dict[str, Any]:
    """A refusal of a Messages route in Anthropic's error shape (the OpenAI one elsewhere: server/app.py
    answers each in its route's), a tool's parts named as this API names them (the chat machinery's
    ``tools[i].function.parameters``)."""
    message = e.message.replace("].function.parameters", "].input_schema").replace("].function.", "].")
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": message}}


def add_anthropic_routes(app: FastAPI, st: ServerState) -> None:
    """``/v1/messages`` and ``/v1/messages/count_tokens``, prepared as chat requests (:func:`prepare_chat`)."""
    decode = st.engine.tokenizer.decode

    def prepare(raw: bytes, counting: bool = False) -> Prepared:
        """``counting`` (count_tokens): ``max_tokens`` has no say in what the prompt counts."""
        body = parse_body(raw, MessagesRequest)
        bps = read_breakpoints(body) if not counting else []
        seen: list[tuple[str, list[int]]] = []  # the prompt's text and where its tokens end

        def encode(text: str) -> list[int]:
            ids, ends = st.engine.tokenizer.encode_with_ends(text)
            seen.append((text, ends))
            return ids

        p = prepare_chat(as_chat(body), st, encode if bps else None)
        if bps:
            p.hints = request_hints(st, body, bps, *seen[0])
        p.dropped_tools = note_dropped([f"{t.name} ({t.type})" for t in body.tools or [] if t.server_tool])
        if not counting:  # Anthropic's required max_tokens, within the context's rest (Claude Code asks 32K-64K)
            p.sampling = with_reply_room(st, p.sampling, len(p.ids), body.max_tokens)
        return p

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        p: Prepared = await st.off_loop(prepare, await read_body(request, st.opts.max_request_bytes))
        await vet_grammar(st, p, request)
        handles = submit_choices(st, p)
        logger.info("messages rid=%d prompt=%d max_new=%d stream=%s", handles[0].rid, len(p.ids),
                    handles[0].max_new_tokens, p.body.stream)
        base = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": p.body.model}
        headers = dropped_header(p.dropped_tools)
        if p.body.stream:
            return event_stream(st, handles, _events(p, handles, base, decode), headers)
        res = (await collect_choices(st, request, handles))[0]
        content, calls = parse_reply(res.text, res.finish_reason, p.call_names, p.call_format)
        blocks = ([{"type": "text", "text": content}] if content else []) + [
            _tool_use(c.name, json.loads(c.arguments)) for c in calls]
        return JSONResponse({**base, "content": blocks, **_stop(res, p, bool(calls), decode), "usage": _usage(res, p)},
                            headers=headers)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        p: Prepared = await st.off_loop(prepare, await read_body(request, st.opts.max_request_bytes), True)
        return {"input_tokens": len(p.ids)}


async def _events(p: Prepared, handles: list, base: dict[str, Any],
                  decode: Callable[[list[int]], str]) -> AsyncIterator[str]:
    """The Messages stream: ``message_start`` once the prompt is admitted, a text block's
    ``content_block_start`` / ``_delta`` / ``_stop`` as text comes (what may begin a tool call is held,
    as in chat streams), one ``tool_use`` block per call at the end (its input as one
    ``input_json_delta``), ``message_delta`` with the stop reason and usage, ``message_stop``.
    Keep-alives (server/keepalive.py): ``ping`` while queued, then an empty ``text_delta`` in the
    text block (opened for it) while the prompt prefills."""
    reply_deltas = ReplyDeltas(p, decode)
    index, text_open, started = 0, False, False

    def text(piece: str) -> Iterator[str]:
        nonlocal text_open
        if not text_open:
            text_open = True
            yield sse_event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
        yield sse_event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": piece}})

    async for item in merged_updates(handles, admissions=True):
        if item is None:  # queued: Anthropic's ping; prefilling: an event the SDKs yield (Claude Code's watchdog)
            for line in (text("") if started else [ANTHROPIC_PING]):
                yield line
            continue
        _, upd = item
        if not started:  # message_start once the prompt is admitted: its usage splits cached and computed
            started = True
            cached = upd.cached or (upd.result.cached_tokens_details if upd.result is not None else {})
            yield sse_event("message_start", {"message": {
                **base, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": anthropic_usage(len(p.ids), cached, 0, p.hints)}})
        res = upd.result  # (set on the final update only)
        if res is not None and res.finish_reason == "error":
            yield sse_event("error", {"error": {"type": "api_error", "message": engine_dead_during(res).message}})
            return
        deltas = reply_deltas(upd)
        for line in (line for d in deltas if d.get("content") for line in text(d["content"])):
            yield line
        if res is None:
            continue
        if text_open:
            yield sse_event("content_block_stop", {"index": index})
            index += 1
        calls = [call["function"] for call in deltas[-1].get("tool_calls") or []]
        for fn in calls:
            yield sse_event("content_block_start", {"index": index, "content_block": _tool_use(fn["name"], {})})
            yield sse_event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                           "partial_json": fn["arguments"]}})
            yield sse_event("content_block_stop", {"index": index})
            index += 1
        yield sse_event("message_delta", {"delta": _stop(res, p, bool(calls), decode), "usage": _usage(res, p)})
        yield sse_event("message_stop", {})
