"""OpenAI's Responses API: ``POST /v1/responses`` (streamed as its typed events or not),
``GET`` / ``DELETE /v1/responses/{id}``, with server-held conversations.

A request becomes the chat request it means (server/responses_request.py: ``instructions``,
``input`` items, ``tools``, ``text.format``, ``max_output_tokens``; its refusals name this API's
fields). It is prepared and run as a chat completion (the template, forced-call grammars, the
prefix cache), and the reply written back as output items: a ``message`` with one ``output_text``
part, then one ``function_call`` item per call.

``store`` (default true, as OpenAI's) keeps each response's conversation -- its messages, its reply,
and the token ids the model saw and wrote -- in a bounded LRU (:class:`ResponseStore`,
``--responses-store-size`` responses, ``--responses-store-mb`` together); a request with ``previous_response_id`` continues that
conversation with only its new items (the previous ``instructions`` are not carried over, as
OpenAI's): its prompt is the stored ids plus the new turn as the template renders it
(:func:`continued_ids`: no re-rendering drift), whose KV the radix cache already holds, so the
continued turn computes little more than its new tokens. Built-in tools
(web search, file search, ...) are dropped and named (server/builtin_tools.py), a ``namespace``'s
function tools flattened in; reasoning items and image / file / audio parts (the models served
are text-only) are refused in one sentence; fields a client sends that cannot change the output
(``include``, ``truncation``, ``metadata`` within OpenAI's bounds, ``reasoning``, ``user``,
``client_metadata``, ...) are accepted. ``prompt_cache_key`` / ``prompt_cache_retention`` are cache
hints (server/hints.py), echoed on the response; a stored conversation (``store`` true) stays retained
while stored, and ``DELETE`` releases it. Without ``max_output_tokens`` a reply may
take the rest of the context (``--default-max-tokens`` caps it). A stream writes keep-alives while
the prompt prefills (server/keepalive.py): ``response.in_progress`` again. A grammar
failure ends the response as ``failed``. Beside the standard usage, hicache's extensions:
``usage.hicache_cached_tokens`` (cached tokens per tier), ``timing`` (seconds: TTFT, queue,
forward) and reuse after an edit (``edit_reuse``; ``input_tokens_details.reused_tokens``,
``usage.hicache_edit_reuse``: server/edit_reuse_usage.py), as on chat completions.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..runtime.request import GenerateResult
from .builtin_tools import dropped_header, note_dropped, split_responses_tools, tool_namespaces
from .choices import collect_choices, event_stream, merged_updates, submit_choices
from .edit_reuse_usage import outcome_usage, reused_details
from .hints import STORED_HINT, retention_usage
from .parsing import parse_body, read_body
from .prepare import prepare_chat
from .protocol import APIError
from .response_store import ResponseStore, Stored
from .responses_request import ResponsesRequest, as_chat, chat_messages
from .state import ServerState
from .tools import parse_reply
from .submit import Prepared, ReplyDeltas, check_fits, sse_event, timing, vet_grammar, with_reply_room

logger = logging.getLogger(__name__)


class _Turn:
    """One request's conversation (for the store) and the response object around its output."""

    def __init__(self, body: ResponsesRequest, messages: list[dict[str, Any]], prepared: Prepared,
                 edit_reuse: bool = False) -> None:
        self.body, self.messages, self.p = body, messages, prepared
        self.edit_reuse = edit_reuse  # the server runs with --enable-edit-reuse (server/edit_reuse_usage.py)
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.namespaces = tool_namespaces(body.tools or [])  # a call of a nested tool names its namespace

    def response(self, status: str, output: list[dict[str, Any]], res: Optional[GenerateResult] = None,
                 error: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        b = self.body
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": b.model,
               "output": output, "instructions": b.instructions, "tools": b.tools or [],
               "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
               "parallel_tool_calls": b.parallel_tool_calls,  # the sampling the reply took (the server's defaults too)
               "temperature": self.p.sampling.temperature, "top_p": self.p.sampling.top_p,
               "max_output_tokens": b.max_output_tokens, "previous_response_id": b.previous_response_id,
               "store": b.store, "text": b.text or {"format": {"type": "text"}}, "metadata": b.metadata or {},
               "prompt_cache_key": b.prompt_cache_key, "prompt_cache_retention": b.prompt_cache_retention,
               "error": error, "incomplete_details": None, "usage": None}
        if res is not None:
            out["usage"] = {"input_tokens": res.prompt_tokens, "output_tokens": res.completion_tokens,
                            "total_tokens": res.prompt_tokens + res.completion_tokens,
                            "input_tokens_details": {"cached_tokens": res.cached_tokens,
                                                     **reused_details([res], self.edit_reuse)},
                            "output_tokens_details": {"reasoning_tokens": 0},
                            "hicache_cached_tokens": dict(res.cached_tokens_details),
                            **outcome_usage([res]), **retention_usage(self.p.hints, res)}
            out["timing"] = timing(res)  # hicache's extension, as on chat completions
            if res.finish_reason == "length":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def finish(self, res: GenerateResult, store: ResponseStore) -> dict[str, Any]:
        """The response of a finished reply (its output items), kept in ``store`` with the reply as a chat message."""
        if res.finish_reason == "error":
            return self.response("failed", [], res, {"code": res.error_code or "server_error", "message": res.error})
        content, calls = parse_reply(res.text, res.finish_reason, self.p.call_names, self.p.call_format)
        tool_calls = [c.openai() for c in calls]
        items = ([_message_item(content, "completed")] if content else []) + [_call_item(t, self.namespaces) for t in tool_calls]
        response = self.response("incomplete" if res.finish_reason == "length" else "completed", items, res)
        if self.body.previous_response_id is not None:
            store.count_continued(res)
        if self.body.store:
            reply = {"role": "assistant", "content": content or "", **({"tool_calls": tool_calls} if calls else {})}
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
        logger.info("continuation re-rendered: the template writes the stored history otherwise (%d ids)", len(history))
        return rendered
    return [*history, *tokenizer.backend.encode(text[len(said):], add_special_tokens=False).ids]


def _message_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: dict[str, Any], namespaces: dict[str, str]) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` entry as a function_call output item (``call_id``: the entry's id), with
    the ``namespace`` of a tool the request nested in one."""
    fn = call["function"]
    namespace = {"namespace": namespaces[fn["name"]]} if fn["name"] in namespaces else {}
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"], "name": fn["name"],
            **namespace, "arguments": fn["arguments"], "status": "completed"}


def add_responses_routes(app: FastAPI, st: ServerState) -> None:
    """``/v1/responses`` and a stored response's ``GET`` / ``DELETE``, prepared as chat requests
    (:func:`prepare_chat`), stored in the server's store (``st.responses``)."""
    store = st.responses

    def prepare(raw: bytes) -> _Turn:
        body = parse_body(raw, ResponsesRequest)
        stored = store.get(body.previous_response_id) if body.previous_response_id is not None else None
        if body.previous_response_id is not None and stored is None:
            raise APIError(404, f"no stored response {body.previous_response_id!r} (never stored, deleted, "
                                "or dropped to keep within --responses-store-size / --responses-store-mb).",
                           param="previous_response_id", code="response_not_found")
        messages = chat_messages(body, stored.messages if stored is not None else [])
        stored_messages = messages[1:] if body.instructions else messages  # instructions are not carried over
        tools, dropped = split_responses_tools(body.tools or [])
        prepared = prepare_chat(as_chat(body, messages, tools), st)
        prepared.dropped_tools = note_dropped([*dropped, *prepared.dropped_tools])
        if body.store:  # the stored conversation's history stays retained while stored (DELETE releases it)
            prepared.hints = (*prepared.hints, STORED_HINT)
        if stored is not None and not body.instructions:
            prepared.prompts[0] = continued_ids(st.engine.tokenizer, stored.ids, prepared.ids)
            check_fits(prepared.ids, body.max_output_tokens, st.engine.context_length, "input")
            if body.max_output_tokens is None:  # the rest of the context, counted on the prompt as sent
                prepared.sampling = with_reply_room(st, prepared.sampling, len(prepared.ids), st.opts.default_max_tokens)
        return _Turn(body, stored_messages, prepared, st.engine.config.enable_edit_reuse)

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        turn: _Turn = await st.off_loop(prepare, await read_body(request, st.opts.max_request_bytes))
        await vet_grammar(st, turn.p, request)
        handles = submit_choices(st, turn.p)
        logger.info("response %s rid=%d prompt=%d stream=%s previous=%s", turn.id, handles[0].rid, len(turn.p.ids),
                    turn.body.stream, turn.body.previous_response_id)
        headers = dropped_header(turn.p.dropped_tools)
        if turn.body.stream:
            return event_stream(st, handles, _events(st, turn, handles, store), headers)
        res = (await collect_choices(st, request, handles))[0]
        st.prompt_cache_keys.count(turn.body.prompt_cache_key, [res])
        return JSONResponse(turn.finish(res, store), headers=headers)

    @app.get("/v1/responses/{response_id}")
    async def get(response_id: str) -> dict:
        stored = store.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response {response_id!r}.", code="response_not_found")
        return stored.response

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict:
        """Forget the response, and release the retention its conversation's tokens held
        (:meth:`ServerState.release_stored`)."""
        stored = store.get(response_id)
        if stored is None or not store.delete(response_id):
            raise APIError(404, f"no stored response {response_id!r}.", code="response_not_found")
        released = st.release_stored(stored)
        if released is not None:
            logger.info("response %s deleted: %d retained tokens released", response_id, await asyncio.wrap_future(released))
        return {"id": response_id, "object": "response.deleted", "deleted": True}


async def _events(st: ServerState, turn: _Turn, handles: list, store: ResponseStore) -> AsyncIterator[str]:
    """The typed event stream: ``response.created`` / ``in_progress``, the message item's text as
    ``response.output_text.delta`` events (what may begin a tool call held back, as in chat streams),
    one function_call item per call at the end (its arguments as one delta), then
    ``response.completed`` / ``incomplete`` / ``failed`` with the whole response."""
    seq = itertools.count()

    def event(kind: str, **data: Any) -> str:
        return sse_event(kind, {"sequence_number": next(seq), **data})

    reply_deltas = ReplyDeltas(turn.p, st.engine.tokenizer.decode)
    yield event("response.created", response=turn.response("in_progress", []))
    yield event("response.in_progress", response=turn.response("in_progress", []))
    message: Optional[dict[str, Any]] = None
    async for item in merged_updates(handles):
        if item is None:  # a prompt still prefilling, or a queue: an event, since Codex's watchdog skips comments
            yield event("response.in_progress", response=turn.response("in_progress", []))
            continue
        _, upd = item
        piece = "".join(d.get("content") or "" for d in reply_deltas(upd))
        if piece:
            if message is None:
                message = {**_message_item("", "in_progress"), "content": []}
                yield event("response.output_item.added", output_index=0, item=message)
                yield event("response.content_part.added", item_id=message["id"], output_index=0,
                            content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            yield event("response.output_text.delta", item_id=message["id"], output_index=0, content_index=0,
                        delta=piece)
        if upd.finished:  # (the last update: one request)
            st.prompt_cache_keys.count(turn.body.prompt_cache_key, [upd.result])
            for line in _finish_events(event, turn.finish(upd.result, store), message):
                yield line


def _finish_events(event: Callable[..., str], response: dict[str, Any],
                   message: Optional[dict[str, Any]]) -> Iterator[str]:
    """The end of a stream: the message item's done events (``message``: the item streamed so far,
    whose id the output keeps), one function_call item per call (its arguments as one delta), then
    ``response.completed`` / ``incomplete`` / ``failed`` (its status) with the whole response."""
    for index, item in enumerate(response["output"]):  # (none when it failed)
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
    yield event(f"response.{response['status']}", response=response)
