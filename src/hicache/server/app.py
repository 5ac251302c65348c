"""The OpenAI-compatible HTTP API over an :class:`EngineLoop`.

Endpoints: ``/v1/chat/completions``, ``/v1/completions`` (streaming as server-sent events or
not), ``/v1/models``; the operational ones (health, cache flush, metrics, stats, tokenize, L3
layout, what sglang-router asks at start) are in :mod:`.operations`. Every error is
OpenAI-shaped JSON. A request carrying ``bootstrap_host`` / ``bootstrap_port`` /
``bootstrap_room`` (what sglang-router adds in PD mode) runs as one half of a P/D pair.

The event loop only moves bytes: parsing a body, rendering the chat template and tokenizing
run on a small worker pool (:class:`~.state.ServerState`; :func:`_prepare_chat`,
:func:`_prepare_completion`), so one huge
request never stalls ``/health`` or the streams of others. If the engine fails, requests in
flight end with 503 ``engine_dead`` (an ``error`` event when streaming) and so do new ones.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ContextLengthError, EngineDeadError, HicacheError
from ..frontend.loop import EngineLoop, RequestHandle
from ..model.tokenizer import Tokenizer
from ..runtime.request import GenerateResult
from ..runtime.sampling import SamplingParams
from .detok import IncrementalText
from .metrics import ServerMetrics
from .middleware import CatchAllErrors, RequireApiKey
from .operations import add_operation_routes
from .parsing import parse_body, read_body
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, _Sampling
from .state import ServerOptions, ServerState

logger = logging.getLogger(__name__)

DEFAULT_CHAT_MAX_TOKENS = 128  # when a chat request gives neither max_tokens nor max_completion_tokens
DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks whether its client left


@dataclass
class Prepared:
    """A validated request, tokenized, ready to submit."""

    body: _Sampling
    ids: list[int]
    sampling: SamplingParams
    param: str  # the field that holds the prompt, for errors about it


def engine_dead(e: BaseException | str) -> APIError:
    return APIError(503, str(e), type="server_error", code="engine_dead")


def engine_dead_during(res: GenerateResult) -> APIError:
    """A request the engine failed while it ran (finish_reason "error"). A P/D request whose
    KV transfer failed is that request's failure, not the engine's."""
    if res.kv_transfer_error:
        return APIError(503, f"the KV transfer for this request failed: {res.error}", type="server_error",
                        code="kv_transfer_failed")
    return engine_dead(f"the engine failed during this request: {res.error}")


def _usage(res: GenerateResult) -> dict[str, Any]:
    return {
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": res.completion_tokens,
        "total_tokens": res.prompt_tokens + res.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": res.cached_tokens,
                                  "cached_tokens_details": dict(res.cached_tokens_details)},
        **_spec(res),
        **_disagg(res),
    }


def _disagg(res: GenerateResult) -> dict[str, Any]:
    """P/D per-request figures (extension; absent for a request without a bootstrap)."""
    if not res.disaggregated:
        return {}
    return {"decode_prefix_len": res.decode_prefix_len, "kv_transferred_tokens": res.kv_transferred_tokens,
            "kv_transferred_bytes": res.kv_transferred_bytes}


def _spec(res: GenerateResult) -> dict[str, Any]:
    """Speculative decoding's per-request figures (extension; absent when it is off)."""
    if not res.spec_verify_steps:
        return {}
    return {"spec_accept_length": res.spec_accept_length, "spec_verify_steps": res.spec_verify_steps}


def _timing(res: GenerateResult) -> dict[str, float]:
    """Server-side timing of one request (extension), seconds."""
    return {"ttft_s": res.ttft_s, "queue_time_s": res.queue_time_s, "forward_time_s": res.forward_time_s,
            "e2e_s": res.e2e_s}


def _sampling(body: _Sampling, max_new: Optional[int], default_max: int) -> SamplingParams:
    bad = body.unsupported()
    if bad:
        raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
    if max_new is not None and max_new < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_new}.", param="max_tokens", code="invalid_value")
    sp = SamplingParams(
        max_new_tokens=max_new if max_new is not None else default_max,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, stop=body.stop,
        stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, seed=body.seed,
    )
    try:
        sp.validate()
    except HicacheError as e:
        raise APIError(400, str(e), code="invalid_value") from None
    return sp


def _check_fits(ids: list[int], max_new: Optional[int], context_length: int, param: str) -> None:
    """An explicit max_tokens that cannot fit is an error (a default one is shortened)."""
    if max_new is not None and len(ids) + max_new > context_length:
        raise APIError(400, f"the prompt has {len(ids)} tokens and max_tokens is {max_new}, but the context length "
                            f"is {context_length}; lower max_tokens or shorten the prompt.",
                       param=param, code="context_length_exceeded")


def _prepare_chat(raw: bytes, st: ServerState) -> Prepared:
    body = parse_body(raw, ChatCompletionRequest)
    st.check_model(body.model)
    sp = _sampling(body, body.max_new_tokens(), DEFAULT_CHAT_MAX_TOKENS)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    tok: Tokenizer = st.engine.tokenizer
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # the model's Jinja template refused these messages
        raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
    ids = tok.encode(text)
    _check_fits(ids, body.max_new_tokens(), st.engine.context_length, "messages")
    return Prepared(body, ids, sp, "messages")


def _prepare_completion(raw: bytes, st: ServerState) -> Prepared:
    body = parse_body(raw, CompletionRequest)
    st.check_model(body.model)
    sp = _sampling(body, body.max_new_tokens(), 16)
    prompt = body.single_prompt()
    ids = st.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    _check_fits(ids, body.max_tokens if "max_tokens" in body.model_fields_set else None,
                st.engine.context_length, "prompt")
    return Prepared(body, ids, sp, "prompt")


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


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
    _add_openai_routes(app, st)
    add_operation_routes(app, st)
    return app


def _add_error_handlers(app: FastAPI, st: ServerState) -> None:
    def answer(e: APIError) -> JSONResponse:
        if e.status != 499:  # a client that left was not refused
            st.metrics.rejected.labels(reason=e.code or e.type).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return answer(e)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return answer(engine_dead(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = {404: "no such endpoint.", 405: "method not allowed on this endpoint."}.get(e.status_code, str(e.detail))
        return answer(APIError(e.status_code, msg))

    @app.exception_handler(RequestValidationError)
    async def _bad_params(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0]
        param = str(err["loc"][-1]) if err.get("loc") else None
        return answer(APIError(400, f"{param}: {err['msg'].rstrip('.')}.", param=param, code="invalid_value"))


def _submit(st: ServerState, p: Prepared) -> RequestHandle:
    """Queue a prepared request; engine-side refusals become OpenAI errors."""
    st.check_capacity()
    try:
        return st.loop.submit(p.ids, p.sampling, p.body.cache_salt, bootstrap=p.body.bootstrap())
    except ContextLengthError as e:
        raise APIError(400, str(e), param=p.param, code="context_length_exceeded") from None
    except EngineDeadError as e:
        raise engine_dead(e) from None
    except HicacheError as e:
        raise APIError(400, str(e), code="invalid_value") from None

async def _collect(st: ServerState, request: Request, handle: RequestHandle) -> GenerateResult:
    """Wait for the result; abort the request if the client goes away meanwhile."""
    task = asyncio.ensure_future(handle.wait())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                res = task.result()
                if res.finish_reason == "error":
                    raise engine_dead_during(res)
                return res
            if await request.is_disconnected():
                logger.info("client disconnected rid=%d; aborting", handle.rid)
                raise APIError(499, "the client closed the connection.", code="client_closed")
    finally:
        if not task.done():
            task.cancel()
            st.loop.abort(handle.rid)

async def _stream(st: ServerState, handle: RequestHandle, stops: list[str],
                  make_chunk: Callable[[str, Optional[str], bool], dict], base: dict,
                  include_usage: bool) -> AsyncIterator[str]:
    detok = IncrementalText(st.engine.tokenizer.decode, stops)
    first = True
    try:
        async for upd in handle:
            if upd.finished:
                res = upd.result
                if res.finish_reason == "error":  # OpenAI's way to fail a stream that has begun
                    yield _sse(engine_dead_during(res).body())
                    yield "data: [DONE]\n\n"
                    return
                text = detok.finish(res.text)
                if text or first:
                    yield _sse(make_chunk(text, None, first))
                yield _sse(make_chunk("", res.finish_reason, False))
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": _usage(res), "timing": _timing(res)})
                yield "data: [DONE]\n\n"
                return
            yield _sse(make_chunk(detok.add(upd.token_ids), None, first))
            first = False
    finally:
        if not handle.finished:  # the client went away (or the server is stopping)
            logger.info("stream closed early rid=%d; aborting", handle.rid)
            st.loop.abort(handle.rid)

async def _answer(st: ServerState, request: Request, p: Prepared, base: dict, make_chunk: Callable,
                  result: Callable) -> Response:
    """Submit ``p``; stream its chunks (``make_chunk``) or return the whole ``result``."""
    handle = _submit(st, p)
    logger.info("%s rid=%d prompt=%d max_new=%d stream=%s", base["object"], handle.rid, handle.prompt_tokens,
                handle.max_new_tokens, p.body.stream)
    if p.body.stream:
        return StreamingResponse(_stream(st, handle, p.sampling.stop_strings, make_chunk, base, p.body.include_usage),
                                 media_type="text/event-stream")
    res = await _collect(st, request, handle)
    return JSONResponse({**base, **result(res), "usage": _usage(res), "timing": _timing(res)})


def _add_openai_routes(app: FastAPI, st: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        p: Prepared = await st.off_loop(_prepare_chat, await read_body(request, st.opts.max_request_bytes), st)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": p.body.model,
                "object": "chat.completion.chunk" if p.body.stream else "chat.completion"}

        def chunk(text: str, finish: Optional[str], first: bool) -> dict:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text or not finish else {})
            return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        def result(res: GenerateResult) -> dict:
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": res.text}, "logprobs": None,
                                 "finish_reason": res.finish_reason}]}

        return await _answer(st, request, p, base, chunk, result)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        p: Prepared = await st.off_loop(_prepare_completion, await read_body(request, st.opts.max_request_bytes), st)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": p.body.model}

        def chunk(text: str, finish: Optional[str], first: bool) -> dict:
            return {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        def result(res: GenerateResult) -> dict:
            return {"choices": [{"index": 0, "text": res.text, "logprobs": None, "finish_reason": res.finish_reason}]}

        return await _answer(st, request, p, base, chunk, result)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": st.opts.served_model_name, "object": "model", "created": st.created, "owned_by": "hicache",
            "root": st.engine.config.model, "max_model_len": st.engine.context_length,
        }]}
