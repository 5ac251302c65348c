"""What every HTTP handler shares: the engine loop, metrics, the server's options and the
worker pool that parses and tokenizes request bodies off the event loop. Both the OpenAI
routes (:mod:`.app`) and the operational ones (:mod:`.operations`) take a :class:`ServerState`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..frontend.loop import EngineLoop
from .metrics import ServerMetrics
from .parsing import DEFAULT_MAX_REQUEST_BYTES
from .protocol import APIError
from .tool_formats import choose_format

logger = logging.getLogger(__name__)

PREPARE_WORKERS = 2  # threads that parse and tokenize request bodies
# --max-logprob-tokens: a non-streamed answer with logprobs for 16Ki tokens x 21 entries is ~25 MB of JSON
DEFAULT_MAX_LOGPROB_TOKENS = 16384


@dataclass
class ServerOptions:
    """How the HTTP layer treats clients (``hicache serve`` flags)."""

    served_model_name: str
    max_queued_requests: int = 512
    api_key: Optional[str] = None  # None: no authentication
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    tool_call_parser: str = "auto"  # the tool-call format (server/tool_formats.py); auto: the chat template's
    # lazy: a call the model begins in an ``auto`` reply follows the function's schema from there on
    # (server/tools.py); forced-only: only forced calls are constrained
    tool_call_grammar: str = "lazy"
    max_logprob_tokens: int = DEFAULT_MAX_LOGPROB_TOKENS  # n x prompts x max_tokens of a non-streamed answer with logprobs
    responses_store_size: int = 1024  # responses kept for previous_response_id (server/responses.py)
    responses_store_mb: int = 256  # the bytes they may hold together
    # Chat Completions / Responses requests without a max: at most this many output tokens (None: the
    # rest of the context, OpenAI's default; server/submit.py reply_room)
    default_max_tokens: Optional[int] = None


class ServerState:
    """What the handlers share: the loop, metrics, options and the worker pool."""

    def __init__(self, loop: EngineLoop, metrics: ServerMetrics, opts: ServerOptions) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.metrics = metrics
        self.opts = opts
        self.max_inflight = loop.engine.config.max_running_requests + opts.max_queued_requests
        self.created = int(time.time())
        self.workers = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="hicache-http-prepare")
        self.responses: Any = None  # the Responses API's store (server/responses.py), set by create_app
        template = self.engine.tokenizer.chat_template if self.engine.tokenizer is not None else None
        self.call_format, source = choose_format(opts.tool_call_parser, template)
        logger.info("tool calls: %s format (from %s)", self.call_format.name, source)

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the worker pool."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)

    def check_model(self, name: str) -> None:
        """404 unless ``name`` is the served model (or the model path)."""
        if name not in (self.opts.served_model_name, self.engine.config.model):
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{self.opts.served_model_name}'.", param="model", code="model_not_found")

    def check_capacity(self) -> None:
        """503 when the requests in flight fill the running and queued slots."""
        n = self.loop.num_inflight
        if n >= self.max_inflight:
            raise APIError(503, f"the server is overloaded ({n} requests in flight); retry later.",
                           type="server_error", code="server_overloaded")

    def close(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)
