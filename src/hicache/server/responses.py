"""OpenAI's Responses API: ``POST /v1/responses`` (streamed as its typed events or not),
``GET`` / ``DELETE /v1/responses/{id}``, with server-held conversations.

A request becomes the chat request it means (:func:`chat_messages`): ``instructions`` a system
message, ``input`` text or items (messages with text parts, ``function_call`` items as the
assistant's tool calls, ``function_call_output`` items as tool messages); function ``tools`` and
``tool_choice`` the chat API's; ``text.format`` (json_schema / json_object) its ``response_format``;
``max_output_tokens`` its ``max_tokens``. It is prepared and run as a chat completion (the template,
forced-call grammars, the prefix cache), and the reply written back as output items: a ``message``
with one ``output_text`` part, then one ``function_call`` item per call.

``store`` (default true, as OpenAI's) keeps each response's conversation -- its messages, its reply,
and the token ids the model saw and wrote -- in a bounded LRU (:class:`ResponseStore`,
``--responses-store-size`` responses, ``--responses-store-mb`` together); a request with ``previous_response_id`` continues that
conversation with only its new items (the previous ``instructions`` are not carried over, as
OpenAI's): its prompt is the stored ids plus the new turn as the template renders it
(:func:`continued_ids`: no re-rendering drift), whose KV the radix cache already holds, so the
continued turn computes little more than its new tokens. Built-in tools
(web search, file search, ...), reasoning items and image / file / audio parts (the models served
are text-only) are refused in one sentence; fields a pinned SDK sends at neutral values
(``include``, ``truncation``, ``metadata``, ``reasoning``, ``user``, ...) are accepted. A grammar
failure ends the response as ``failed``. Beside the standard usage, hicache's extensions:
``usage.hicache_cached_tokens`` (cached tokens per tier) and ``timing`` (seconds: TTFT, queue,
forward), as on chat completions.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from ..runtime.request import GenerateResult
from .choices import abort_unfinished, collect_choices, merged_updates, submit_choices
from .detok import IncrementalText
from .parsing import parse_body, read_body
from .protocol import MEDIA_TYPES, APIError, ChatCompletionRequest, _Body, media_refusal
from .response_store import ResponseStore, Stored
from .state import ServerState
from .submit import Prepared, _check_fits, _timing, vet_grammar
from .tools import ChatChunks, parse_calls

logger = logging.getLogger(__name__)



class ResponsesRequest(_Body):
    model: str
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: bool = True
    text: Optional[dict[str, Any]] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "a message's content must be text or a list of text parts.", param="input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind in MEDIA_TYPES:
                raise media_refusal(kind, "input")
            raise APIError(400, f"input content of type {kind!r} is not supported (text only).", param="input")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def chat_messages(body: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation ``history`` (a stored response's) plus this request's instructions and input
    items, as chat messages."""
    out = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + list(history)
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise APIError(400, f"input message role {item.get('role')!r} is not supported.", param="input")
            out.append({"role": role, "content": _text_of(item.get("content", ""))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", []), call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text_of(output)})
        else:
            raise APIError(400, f"input items of type {kind!r} are not supported (messages, function_call and "
                                "function_call_output are).", param="input")
    return out


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for t in tools:
        if t.get("type") != "function":
            raise APIError(400, f"tools of type {t.get('type')!r} (built-in tools) are not supported; function tools "
                                "are.", param="tools")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}})
    return out


def _chat_tool_choice(choice: Union[str, dict[str, Any]]) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                                "\"name\": ...}.", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict", False)}}
    raise APIError(400, f"text.format type {kind!r} is not supported (text, json_object, json_schema are).",
                   param="text.format")


def as_chat(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "temperature": body.temperature,
                            "top_p": body.top_p, "stream": body.stream, "parallel_tool_calls": body.parallel_tool_calls}
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    if body.tools:
        chat["tools"] = _chat_tools(body.tools)
    if body.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(body.tool_choice)
    fmt = _response_format(body.text)
    if fmt is not None:
        chat["response_format"] = fmt
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValueError as e:
        raise APIError(400, f"the request cannot be served: {str(e).splitlines()[0]}.") from None


class _Turn:
    """One request's conversation (for the store) and the response object around its output."""

    def __init__(self, body: ResponsesRequest, messages: list[dict[str, Any]], prepared: Prepared) -> None:
        self.body, self.messages, self.p = body, messages, prepared
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]], res: Optional[GenerateResult] = None,
                 error: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        b = self.body
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": b.model,
               "output": output, "instructions": b.instructions, "tools": b.tools or [],
               "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
               "parallel_tool_calls": b.parallel_tool_calls, "temperature": b.temperature, "top_p": b.top_p,
               "max_output_tokens": b.max_output_tokens, "previous_response_id": b.previous_response_id,
               "store": b.store, "text": b.text or {"format": {"type": "text"}}, "metadata": b.metadata or {},
               "error": error, "incomplete_details": None, "usage": None}
        if res is not None:
            out["usage"] = {"input_tokens": res.prompt_tokens, "output_tokens": res.completion_tokens,
                            "total_tokens": res.prompt_tokens + res.completion_tokens,
                            "input_tokens_details": {"cached_tokens": res.cached_tokens},
                            "output_tokens_details": {"reasoning_tokens": 0},
                            "hicache_cached_tokens": dict(res.cached_tokens_details)}
            out["timing"] = _timing(res)  # hicache's extension, as on chat completions
            if res.finish_reason == "length":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def output(self, res: GenerateResult) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The output items of a finished reply and the reply as a chat message (for the store)."""
        names = set(self.p.call_names)
        content, calls = parse_calls(res.text, names, res.finish_reason == "length") if names else (res.text, [])
        items: list[dict[str, Any]] = []
        if content:
            items.append(_message_item(content, "completed"))
        reply: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if calls:
            fcs = [_call_item(c.name, c.arguments) for c in calls]
            items += fcs
            reply["tool_calls"] = [{"id": f["call_id"], "type": "function",
                                    "function": {"name": f["name"], "arguments": f["arguments"]}} for f in fcs]
        return items, reply

    def finish(self, res: GenerateResult, store: ResponseStore) -> dict[str, Any]:
        if res.finish_reason == "error":
            return self.response("failed", [], res, {"code": res.error_code or "server_error", "message": res.error})
        items, reply = self.output(res)
        response = self.response("incomplete" if res.finish_reason == "length" else "completed", items, res)
        if self.body.previous_response_id is not None:
            store.count_continued(res)
        if self.body.store:
            store.put(self.id, Stored([*self.messages, reply], [*self.p.ids, *res.output_ids], response))
        return response


def continued_ids(tokenizer: Any, history: list[int], rendered: list[int]) -> list[int]:
    """A continuation's prompt: the ids the model saw and wrote (``history``, as the cache holds them)
    and the rest of the conversation as the template renders it, tokenized on its own -- no
    re-rendering drift in the history. ``rendered``: the whole conversation rendered and tokenized,
    used as it is where the history is not its prefix as text (a template that renders a past reply
    otherwise than the model wrote it)."""
    said = tokenizer.decode(history, skip_special_tokens=False)
    text = tokenizer.decode(rendered, skip_special_tokens=False)
    if not text.startswith(said):
        logger.info("continuation re-rendered: the template writes the stored history otherwise (%d ids)",
                    len(history))
        return rendered
    return [*history, *tokenizer.backend.encode(text[len(said):], add_special_tokens=False).ids]


def _message_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": f"call_{uuid.uuid4().hex[:24]}",
            "name": name, "arguments": arguments, "status": "completed"}


def add_responses_routes(app: FastAPI, st: ServerState,
                         prepare_chat: Callable[[ChatCompletionRequest, ServerState], Prepared],
                         store: ResponseStore) -> None:
    """``prepare_chat``: the chat endpoint's preparation of a parsed body (template, tools, sampling)."""

    def prepare(raw: bytes) -> _Turn:
        body = parse_body(raw, ResponsesRequest)
        history: list[dict[str, Any]] = []
        stored: Optional[Stored] = None
        if body.previous_response_id is not None:
            stored = store.get(body.previous_response_id)
            if stored is None:
                raise APIError(404, f"no stored response {body.previous_response_id!r} (never stored, deleted, "
                                    "or dropped to keep within --responses-store-size / --responses-store-mb).",
                               param="previous_response_id", code="response_not_found")
            history = stored.messages
        messages = chat_messages(body, history)
        stored_messages = messages[1:] if body.instructions else messages  # instructions are not carried over
        prepared = prepare_chat(as_chat(body, messages), st)
        if stored is not None and not body.instructions:
            prepared.prompts[0] = continued_ids(st.engine.tokenizer, stored.ids, prepared.ids)
            _check_fits(prepared.ids, body.max_output_tokens, st.engine.context_length, "input")
        return _Turn(body, stored_messages, prepared)

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        turn: _Turn = await st.off_loop(prepare, await read_body(request, st.opts.max_request_bytes))
        await vet_grammar(st, turn.p, request)
        handles = submit_choices(st, turn.p)
        logger.info("response %s rid=%d prompt=%d stream=%s previous=%s", turn.id, handles[0].rid, len(turn.p.ids),
                    turn.body.stream, turn.body.previous_response_id)
        if turn.body.stream:
            return StreamingResponse(_events(st, turn, handles, store), media_type="text/event-stream")
        res = (await collect_choices(st, request, handles))[0]
        return JSONResponse(turn.finish(res, store))

    @app.get("/v1/responses/{response_id}")
    async def get(response_id: str) -> dict:
        stored = store.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response {response_id!r}.", code="response_not_found")
        return stored.response

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict:
        if not store.delete(response_id):
            raise APIError(404, f"no stored response {response_id!r}.", code="response_not_found")
        return {"id": response_id, "object": "response.deleted", "deleted": True}


async def _events(st: ServerState, turn: _Turn, handles: list, store: ResponseStore) -> AsyncIterator[str]:
    """The typed event stream: ``response.created`` / ``in_progress``, the message item's text as
    ``response.output_text.delta`` events (what may begin a tool call held back, as in chat streams),
    one function_call item per call at the end (its arguments as one delta), then
    ``response.completed`` / ``incomplete`` / ``failed`` with the whole response."""
    seq = [0]

    def event(kind: str, **data: Any) -> str:
        seq[0] += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq[0] - 1, **data})}\n\n"

    chunks = ChatChunks({}, turn.p.call_names)
    detok = IncrementalText(st.engine.tokenizer.decode, turn.p.sampling.stop_strings)
    yield event("response.created", response=turn.response("in_progress", []))
    yield event("response.in_progress", response=turn.response("in_progress", []))
    message: Optional[dict[str, Any]] = None
    streamed = ""
    try:
        async for _, upd in merged_updates(handles):
            res = upd.result if upd.finished else None
            text = detok.finish(res.text) if res is not None else detok.add(upd.token_ids)
            piece = chunks(text, None, False, [])["choices"][0]["delta"].get("content")
            if res is not None and res.finish_reason != "error":
                piece = (piece or "") + (chunks("", res.finish_reason, False, [])["choices"][0]["delta"].get("content")
                                         or "")
            if piece:
                if message is None:
                    message = _message_item("", "in_progress")
                    message["content"] = []
                    yield event("response.output_item.added", output_index=0, item=message)
                    yield event("response.content_part.added", item_id=message["id"], output_index=0,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                streamed += piece
                yield event("response.output_text.delta", item_id=message["id"], output_index=0, content_index=0,
                            delta=piece)
            if res is None:
                continue
            response = turn.finish(res, store)
            for line in _finish_events(event, response, message):
                yield line
            return
    finally:
        abort_unfinished(st, handles, "stream closed early")  # the client went away (or the server is stopping)


def _finish_events(event: Callable[..., str], response: dict[str, Any],
                   message: Optional[dict[str, Any]]) -> Iterator[str]:
    """The end of a stream: the message item's done events (``message``: the item streamed so far,
    whose id the output keeps), one function_call item per call (its arguments as one delta), then
    ``response.completed`` / ``incomplete`` / ``failed`` with the whole response."""
    if response["status"] == "failed":
        yield event("response.failed", response=response)
        return
    for index, item in enumerate(response["output"]):
        if item["type"] == "message":
            item["id"] = message["id"] if message is not None else item["id"]
            part = item["content"][0]
            yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"])
            yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part)
        else:
            yield event("response.output_item.added", output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield event(kind, response=response)
