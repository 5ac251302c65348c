"""The OpenAI-compatible HTTP API over an :class:`EngineLoop`.

Endpoints: ``/v1/chat/completions``, ``/v1/completions`` (streaming as server-sent events or
not), ``/v1/models``, ``/health``, ``/flush_cache``, ``/metrics`` (Prometheus text), and two
extensions: ``/stats`` (``Engine.stats()`` as JSON) and ``/tokenize`` (token counts with the
served tokenizer, used by ``hicache bench``). Every error is OpenAI-shaped JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.loop import EngineLoop, RequestHandle
from ..engine.request import GenerateResult
from ..engine.sampling import SamplingParams
from ..errors import ContextLengthError, HicacheError
from .detok import IncrementalText
from .metrics import ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, TokenizeRequest, _Sampling

logger = logging.getLogger(__name__)

DEFAULT_CHAT_MAX_TOKENS = 128  # when a chat request gives neither max_tokens nor max_completion_tokens
DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks whether its client left


class ServerState:
    """What the handlers share: the loop, metrics and the served name."""

    def __init__(self, loop: EngineLoop, metrics: ServerMetrics, served_model_name: str,
                 max_queued_requests: int) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.metrics = metrics
        self.served_model_name = served_model_name
        self.max_inflight = loop.engine.config.max_running_requests + max_queued_requests
        self.created = int(time.time())

    def check_model(self, name: str) -> None:
        if name not in (self.served_model_name, self.engine.config.model):
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.served_model_name}'.",
                           param="model", code="model_not_found")

    def check_capacity(self) -> None:
        n = self.loop.num_inflight
        if n >= self.max_inflight:
            raise APIError(503, f"the server is overloaded ({n} requests in flight); retry later.",
                           type="server_error", code="server_overloaded")


def _usage(res: GenerateResult) -> dict[str, Any]:
    return {
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": res.completion_tokens,
        "total_tokens": res.prompt_tokens + res.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": res.cached_tokens,
                                  "cached_tokens_details": dict(res.cached_tokens_details)},
    }


def _timing(res: GenerateResult) -> dict[str, float]:
    """Server-side timing of one request (extension), seconds."""
    return {"ttft_s": res.ttft_s, "queue_time_s": res.queue_time_s, "forward_time_s": res.forward_time_s,
            "e2e_s": res.e2e_s}


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" (line {e.lineno} column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise APIError(400, f"the request body is not valid JSON: {getattr(e, 'msg', str(e))}{where}.",
                       code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].rstrip(".")
        raise APIError(400, f"{param}: {msg}." if param else f"{msg}.", param=param, code="invalid_value") from None


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
    return sp


def create_app(loop: EngineLoop, metrics: ServerMetrics, served_model_name: str,
               max_queued_requests: int = 512) -> FastAPI:
    """The FastAPI app; ``loop`` must be started (and is stopped by whoever started it)."""
    st = ServerState(loop, metrics, served_model_name, max_queued_requests)
    tok = st.engine.tokenizer
    app = FastAPI(title="hicache", docs_url=None, redoc_url=None)
    app.state.hicache = st

    # ---- errors --------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = {404: "no such endpoint.", 405: "method not allowed on this endpoint."}.get(e.status_code, str(e.detail))
        return JSONResponse(APIError(e.status_code, msg).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return JSONResponse(APIError(500, f"internal server error: {type(e).__name__}.", type="server_error").body(),
                            status_code=500)

    def submit(prompt: Any, sp: SamplingParams, salt: Optional[str], param: str) -> RequestHandle:
        st.check_capacity()
        try:
            return st.loop.submit(prompt, sp, salt)
        except ContextLengthError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except HicacheError as e:
            raise APIError(400, str(e), code="invalid_value") from None

    async def collect(request: Request, handle: RequestHandle) -> GenerateResult:
        """Wait for the result; abort the request if the client goes away meanwhile."""
        task = asyncio.ensure_future(handle.wait())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    logger.info("client disconnected rid=%d; aborting", handle.rid)
                    raise APIError(499, "the client closed the connection.", code="client_closed")
        finally:
            if not task.done():
                task.cancel()
                st.loop.abort(handle.rid)

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def stream(handle: RequestHandle, stops: list[str], make_chunk: Callable[[str, Optional[str], bool], dict],
                     base: dict, include_usage: bool) -> AsyncIterator[str]:
        detok = IncrementalText(tok.decode, stops)
        first = True
        try:
            async for upd in handle:
                if upd.finished:
                    res = upd.result
                    text = detok.finish(res.text)
                    if text or first:
                        yield sse(make_chunk(text, None, first))
                    yield sse(make_chunk("", res.finish_reason, False))
                    if include_usage:
                        yield sse({**base, "choices": [], "usage": _usage(res), "timing": _timing(res)})
                    yield "data: [DONE]\n\n"
                    return
                yield sse(make_chunk(detok.add(upd.token_ids), None, first))
                first = False
        finally:
            if not handle.finished:  # the client went away (or the server is stopping)
                logger.info("stream closed early rid=%d; aborting", handle.rid)
                st.loop.abort(handle.rid)

    # ---- OpenAI endpoints ----------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        st.check_model(body.model)
        sp = _sampling(body, body.max_new_tokens(), DEFAULT_CHAT_MAX_TOKENS)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # the model's Jinja template refused these messages
            raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
        handle = submit(tok.encode(text), sp, body.cache_salt, "messages")
        logger.info("chat rid=%d prompt=%d max_new=%d stream=%s", handle.rid, handle.prompt_tokens,
                    handle.max_new_tokens, body.stream)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": body.model}
        if body.stream:
            base["object"] = "chat.completion.chunk"

            def chunk(text: str, finish: Optional[str], first: bool) -> dict:
                delta = {"role": "assistant", "content": text} if first else ({"content": text} if text or not finish else {})
                return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

            return StreamingResponse(stream(handle, sp.stop_strings, chunk, base, body.include_usage),
                                     media_type="text/event-stream")
        res = await collect(request, handle)
        return JSONResponse({
            **base, "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": res.text}, "logprobs": None,
                         "finish_reason": res.finish_reason}],
            "usage": _usage(res), "timing": _timing(res),
        })

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await _parse(request, CompletionRequest)
        st.check_model(body.model)
        sp = _sampling(body, body.max_new_tokens(), 16)
        prompt = body.single_prompt()
        handle = submit(tok.encode(prompt) if isinstance(prompt, str) else prompt, sp, body.cache_salt, "prompt")
        logger.info("completion rid=%d prompt=%d max_new=%d stream=%s", handle.rid, handle.prompt_tokens,
                    handle.max_new_tokens, body.stream)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": body.model}
        if body.stream:
            def chunk(text: str, finish: Optional[str], first: bool) -> dict:
                return {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

            return StreamingResponse(stream(handle, sp.stop_strings, chunk, base, body.include_usage),
                                     media_type="text/event-stream")
        res = await collect(request, handle)
        return JSONResponse({
            **base,
            "choices": [{"index": 0, "text": res.text, "logprobs": None, "finish_reason": res.finish_reason}],
            "usage": _usage(res), "timing": _timing(res),
        })

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": st.served_model_name, "object": "model", "created": st.created, "owned_by": "hicache",
            "root": st.engine.config.model, "max_model_len": st.engine.context_length,
        }]}

    # ---- operations ----------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not st.loop.alive:
            raise APIError(503, "the engine loop is not running.", type="server_error", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = 0.0) -> Response:
        """Empty the prefix cache; refused while requests run unless they finish within ``timeout`` s."""
        if await st.loop.flush(timeout):
            logger.info("flush_cache ok")
            return JSONResponse({"flushed": True, "message": "the cache was flushed."})
        n = st.loop.num_inflight
        raise APIError(400, f"cannot flush the cache while {n} request(s) are running or waiting; retry when idle "
                            "or pass ?timeout=SECONDS to wait for them.", code="server_busy")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if st.loop.alive:
            st.metrics.update_from_stats(await st.loop.stats())
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats() -> dict:
        return {**(await st.loop.stats()), "inflight_requests": st.loop.num_inflight}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body: TokenizeRequest = await _parse(request, TokenizeRequest)
        texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        ids = [tok.encode(t) for t in texts]
        out: dict[str, Any] = {"counts": [len(x) for x in ids], "max_model_len": st.engine.context_length}
        if body.return_ids:
            out["tokens"] = ids
        return out

    return app
