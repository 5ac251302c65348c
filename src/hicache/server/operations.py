"""The server's operational endpoints: ``/`` (GET or HEAD: the connectivity check Claude Code makes
before its first request), ``/health``, ``/flush_cache``, ``/metrics``, ``/stats``,
``/tokenize``, ``/get_hicache_l3_cache_layout``, and what sglang-router asks every worker at
start (``/model_info``, ``/server_info``, also under their ``/get_*`` names)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .parsing import parse_body, read_body
from .protocol import APIError, TokenizeRequest
from .state import ServerState

logger = logging.getLogger("hicache.server.app")


def _tokenize(raw: bytes, st: ServerState) -> dict[str, Any]:
    body = parse_body(raw, TokenizeRequest)
    ids = [st.engine.tokenizer.encode(t) for t in ([body.prompt] if isinstance(body.prompt, str) else body.prompt)]
    return {"counts": [len(x) for x in ids], "max_model_len": st.engine.context_length,
            **({"tokens": ids} if body.return_ids else {})}


def add_operation_routes(app: FastAPI, st: ServerState) -> None:
    """Health, cache control, metrics and introspection endpoints."""
    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        return JSONResponse({"status": "ok", "model": st.opts.served_model_name})

    @app.get("/health")
    async def health() -> Response:
        st.loop.check_alive()  # EngineDeadError -> 503 engine_dead, saying why
        return JSONResponse({"status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        """Empty the prefix cache; refused while requests run unless they finish within ``timeout`` s."""
        raw = request.query_params.get("timeout", "0")
        try:
            timeout = float(raw)
            if not 0.0 <= timeout <= 3600.0:
                raise ValueError
        except ValueError:
            raise APIError(400, f"timeout must be a number of seconds in [0, 3600], got {raw!r}.",
                           param="timeout") from None
        if await st.loop.flush(timeout):
            logger.info("flush_cache ok")
            return JSONResponse({"flushed": True, "message": "the cache was flushed."})
        raise APIError(400, f"cannot flush the cache while {st.loop.num_inflight} request(s) are running or waiting; "
                            "retry when idle or pass ?timeout=SECONDS to wait for them.", code="server_busy")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if st.loop.alive:
            st.metrics.update_from_stats(await st.loop.stats())
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/get_hicache_l3_cache_layout")
    async def l3_cache_layout() -> dict:
        """How L3 objects are cut and named (unified key scheme: grid, namespace, rank cells)."""
        return st.engine.storage_layout()

    _add_info_routes(app, st)

    @app.get("/stats")
    async def stats() -> dict:
        return {**(await st.loop.stats()), "inflight_requests": st.loop.num_inflight, "responses": st.responses.stats(),
                "prompt_cache_keys": st.prompt_cache_keys.stats()}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        return await st.off_loop(_tokenize, await read_body(request, st.opts.max_request_bytes), st)


def _add_info_routes(app: FastAPI, st: ServerState) -> None:
    """What SGLang's router and bench_serving ask a worker: the model, the server's settings and state."""
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict:
        """What sglang-router asks every worker at start (SGLang's fields). ``tokenizer_path`` is a
        directory a client can load (bench_serving does when given no --tokenizer), else null:
        the embedded and GGUF models carry their tokenizer inside the weights file."""
        folder = Path(st.engine.config.model)
        return {"model_path": st.engine.config.model,
                "tokenizer_path": str(folder.resolve()) if (folder / "tokenizer.json").is_file() else None,
                "served_model_name": st.opts.served_model_name, "is_generation": True,
                "preferred_sampling_params": st.opts.preferred_sampling_params, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        """The engine's configuration (SGLang's server args where the names agree), and the
        scheduler's state as SGLang's ``internal_states`` (its bench_serving reads the accept length there)."""
        spec = (await st.loop.stats()).get("speculative")
        state = {"avg_spec_accept_length": spec["accept_length"]} if spec is not None else {}
        return {**{k: v for k, v in dataclasses.asdict(st.engine.config).items()
                   if isinstance(v, (str, int, float, bool, type(None)))},
                "served_model_name": st.opts.served_model_name, "context_length": st.engine.context_length,
                "sampling_defaults": st.opts.sampling_defaults,
                "preferred_sampling_params": st.opts.preferred_sampling_params,
                "default_sampling_params": st.sampling_defaults,  # what a request's unset fields take
                "internal_states": [state]}
