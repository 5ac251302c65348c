"""The OpenAI-compatible HTTP API over an :class:`EngineLoop`.

Endpoints: ``/v1/chat/completions``, ``/v1/completions`` (streaming as server-sent events or
not), ``/v1/models`` and ``/v1/models/{id}``; the Responses API is in :mod:`.responses`,
Anthropic's ``/v1/messages`` in :mod:`.anthropic`, SGLang's native ``/generate`` in :mod:`.native`.
What they share lies below them all: a request made ready in :mod:`.prepare`, submitted and
collected in :mod:`.submit`, its choices in :mod:`.choices`. The operational endpoints (health,
cache flush, metrics, stats, tokenize, L3 layout, what sglang-router asks at start) are in
:mod:`.operations`. Every error is OpenAI-shaped JSON. A request carrying ``bootstrap_host`` /
``bootstrap_port`` / ``bootstrap_room`` (what sglang-router adds in PD mode) runs as one half of a
P/D pair.

The event loop only moves bytes: parsing a body, rendering the chat template and tokenizing
run on a small worker pool (:class:`~.state.ServerState`; :func:`_prepare_chat`,
:func:`_prepare_completion`), so one huge
request never stalls ``/health`` or the streams of others. If the engine fails, requests in
flight end with 503 ``engine_dead`` (an ``error`` event when streaming) and so do new ones.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import EngineDeadError
from ..frontend.loop import EngineLoop, RequestHandle
from ..runtime.request import GenerateResult
from .anthropic import MESSAGES_PATHS, add_anthropic_routes, error_body
from .builtin_tools import dropped_header
from .choices import (chat_logprobs, check_choices, collect_choices, completion_logprobs, event_stream, merged_updates,
                      submit_choices, usage_of)
from .hints import check_key, openai_hints, retention_usage
from .keepalive import SSE_KEEPALIVE
from .metrics import ServerMetrics
from .middleware import CatchAllErrors, RequireApiKey
from .native import add_native_routes
from .operations import add_operation_routes
from .parsing import parse_body, read_body
from .prepare import prepare_chat, sampling_params
from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from .responses import add_responses_routes
from .responses_request import own_fields
from .options import ServerOptions
from .state import ServerState
from .submit import ChoiceStream, Prepared, check_fits, engine_dead, engine_dead_during, sse_data, timing, vet_grammar
from .tools import ChatChunks, ChunkFn, chat_message

logger = logging.getLogger(__name__)


def _prepare_chat(raw: bytes, st: ServerState) -> Prepared:
    return prepare_chat(parse_body(raw, ChatCompletionRequest), st)


def _prepare_completion(raw: bytes, st: ServerState) -> Prepared:
    body = parse_body(raw, CompletionRequest)
    st.check_model(body.model)
    hints, _ = openai_hints(body.prompt_cache_retention), check_key(body.prompt_cache_key)  # (before tokenizing)
    sp = sampling_params(st, body, body.max_tokens, 16)
    given = body.prompt  # one prompt, or each of a batch (strings or token id lists)
    texts = list(given) if isinstance(given, list) and given and isinstance(given[0], (str, list)) else [given]
    check_choices(body.n, len(texts), sp, body.stream, st.opts.max_logprob_tokens)  # before tokenizing them
    prompts = [st.engine.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in texts]
    for ids in prompts:
        check_fits(ids, body.max_tokens if "max_tokens" in body.model_fields_set else None,
                   st.engine.context_length, "prompt")
    return Prepared(body, prompts, sp, "prompt", n=body.n, grammar_param=body.field_of("grammar"), hints=hints)


def create_app(loop: EngineLoop, metrics: ServerMetrics, opts: ServerOptions) -> FastAPI:
    """The FastAPI app; ``loop`` must be started (and is stopped by whoever started it)."""
    st = ServerState(loop, metrics, opts)
    app = FastAPI(title="hicache", docs_url=None, redoc_url=None)
    app.state.hicache = st
    _add_error_handlers(app, st)
    app.add_middleware(CatchAllErrors, on_error=lambda: metrics.rejected.labels(reason="internal_error").inc())
    if opts.api_key:
        app.add_middleware(RequireApiKey, api_key=opts.api_key,
                           on_reject=lambda: metrics.rejected.labels(reason="invalid_api_key").inc())
    for add_routes in (_add_openai_routes, add_anthropic_routes, add_responses_routes, add_native_routes,
                       add_operation_routes):
        add_routes(app, st)
    return app


def _add_error_handlers(app: FastAPI, st: ServerState) -> None:
    def answer(e: APIError, path: str = "") -> JSONResponse:
        """``e`` counted in ``/metrics`` and answered in the shape of the API whose route ``path`` is (a handler's
        refusal): Anthropic's on the Messages routes, OpenAI's naming the Responses API's fields on its route,
        OpenAI's elsewhere."""
        st.metrics.refused(e.status, e.code or e.type)
        if path in MESSAGES_PATHS:
            return JSONResponse(error_body(e), status_code=e.status)
        return JSONResponse((own_fields(e) if path == "/v1/responses" else e).body(), status_code=e.status)

    @app.exception_handler(APIError)
    @app.exception_handler(EngineDeadError)
    async def _api_error(request: Request, e: APIError | EngineDeadError) -> JSONResponse:
        return answer(e, request.url.path) if isinstance(e, APIError) else answer(engine_dead(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = {404: "no such endpoint.", 405: "method not allowed on this endpoint."}.get(e.status_code, str(e.detail))
        return answer(APIError(e.status_code, msg))

    @app.exception_handler(RequestValidationError)
    async def _bad_params(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0]
        param = str(err["loc"][-1]) if err.get("loc") else None
        return answer(APIError(400, f"{param}: {err['msg'].rstrip('.')}.", param=param))


async def _stream(st: ServerState, handles: list[RequestHandle], p: Prepared, chunks: list[ChunkFn],
                  base: dict) -> AsyncIterator[str]:
    """The choices' chunks as their tokens arrive (``chunks[i]`` writes choice i's), each choice's
    finish chunk, then the usage of all (when ``stream_options.include_usage`` asks) and ``[DONE]``."""
    streams = [ChoiceStream(chunk, p, st.engine.tokenizer.decode) for chunk in chunks]
    results: list[GenerateResult] = []
    async for item in merged_updates(handles):
        if item is None:  # a prompt still prefilling, or a queue
            yield SSE_KEEPALIVE
            continue
        i, upd = item
        if upd.finished and upd.result.finish_reason == "error":  # OpenAI's way to fail a stream that has begun
            yield sse_data(engine_dead_during(upd.result).body())
            yield "data: [DONE]\n\n"
            return
        for chunk in streams[i](upd):
            yield sse_data(chunk)
        if upd.finished:
            results.append(upd.result)
    results.sort(key=lambda r: r.rid)  # choice order: submitted in order, rids increase
    st.prompt_cache_keys.count(p.body.prompt_cache_key, results[::p.n])
    if p.body.stream_options and p.body.stream_options.include_usage:
        yield sse_data({**base, "choices": [], "usage": _usage(st, p, results), "timing": timing(results[0])})
    yield "data: [DONE]\n\n"


def _usage(st: ServerState, p: Prepared, results: list[GenerateResult]) -> dict[str, Any]:
    """The usage of an answer's choices (streamed or not), with what the cache gave its hints."""
    return {**usage_of(results, p.n, st.engine.config.enable_edit_reuse), **retention_usage(p.hints, results[0])}


async def _answer(st: ServerState, request: Request, p: Prepared, base: dict, chunk: Callable[[int], ChunkFn],
                  choice: Callable[[int, GenerateResult], dict]) -> Response:
    """Submit ``p``'s choices; stream their chunks (``chunk(i)`` writes choice i's) or return every
    ``choice(i, result)`` at once."""
    handles = submit_choices(st, p)
    logger.info("%s rid=%s prompt=%s max_new=%d stream=%s", base["object"], ",".join(str(h.rid) for h in handles),
                ",".join(str(len(ids)) for ids in p.prompts), handles[0].max_new_tokens, p.body.stream)
    if p.body.stream:
        return event_stream(st, handles, _stream(st, handles, p, [chunk(i) for i in range(len(handles))], base),
                            dropped_header(p.dropped_tools))
    results = await collect_choices(st, request, handles)
    st.prompt_cache_keys.count(p.body.prompt_cache_key, results[::p.n])
    return JSONResponse({**base, "choices": [choice(i, r) for i, r in enumerate(results)],
                         "usage": _usage(st, p, results),
                         "timing": timing(results[0])},
                        headers=dropped_header(p.dropped_tools))


def _add_openai_routes(app: FastAPI, st: ServerState) -> None:
    decode = st.engine.tokenizer.decode

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        p: Prepared = await st.off_loop(_prepare_chat, await read_body(request, st.opts.max_request_bytes), st)
        await vet_grammar(st, p, request)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": p.body.model,
                "object": "chat.completion.chunk" if p.body.stream else "chat.completion"}
        logprobs = (lambda entries: chat_logprobs(entries, decode)) if p.sampling.logprobs is not None else None

        def choice(i: int, res: GenerateResult) -> dict:
            message, finish = chat_message(res.text, res.finish_reason, p.call_names, p.call_format)
            return {"index": i, "message": message, "logprobs": logprobs and logprobs(res.logprobs),
                    "finish_reason": finish}

        return await _answer(st, request, p, base, lambda i: ChatChunks(base, p.call_names, i, logprobs, p.call_format),
                             choice)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        p: Prepared = await st.off_loop(_prepare_completion, await read_body(request, st.opts.max_request_bytes), st)
        await vet_grammar(st, p, request)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": p.body.model}
        asked = p.sampling.logprobs is not None

        def chunk(i: int) -> ChunkFn:
            sent = [0]  # characters of the choice's text streamed so far (text_offset)

            def write(text: str, finish: Optional[str], first: bool, entries: list) -> dict:
                lp = completion_logprobs(entries, decode, sent[0]) if asked and finish is None else None
                sent[0] += len(text)
                return {**base, "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}]}
            return write

        def choice(i: int, res: GenerateResult) -> dict:
            return {"index": i, "text": res.text, "logprobs": completion_logprobs(res.logprobs, decode) if asked else None,
                    "finish_reason": res.finish_reason}

        return await _answer(st, request, p, base, chunk, choice)

    def model_card() -> dict:
        return {"id": st.opts.served_model_name, "object": "model", "created": st.created, "owned_by": "hicache",
                "root": st.engine.config.model, "max_model_len": st.engine.context_length}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        st.check_model(model_id)  # 404 model_not_found for another id
        return model_card()
