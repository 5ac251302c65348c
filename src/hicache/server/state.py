"""What every HTTP handler shares: the engine loop, metrics, the server's options and the
worker pool that parses and tokenizes request bodies off the event loop. Both the OpenAI
routes (:mod:`.app`) and the operational ones (:mod:`.operations`) take a :class:`ServerState`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Optional

from ..errors import EngineDeadError
from ..frontend.loop import EngineLoop
from ..sampling_ranges import range_error
from .hints import PromptCacheKeys
from .metrics import ServerMetrics
from .options import ServerOptions
from .protocol import APIError
from .response_store import ResponseStore, Stored
from .tool_formats import choose_format

logger = logging.getLogger(__name__)

PREPARE_WORKERS = 2  # threads that parse and tokenize request bodies


class ServerState:
    """What the handlers share: the loop, metrics, options and the worker pool."""

    def __init__(self, loop: EngineLoop, metrics: ServerMetrics, opts: ServerOptions) -> None:
        self.loop, self.engine, self.metrics, self.opts = loop, loop.engine, metrics, opts
        self.max_inflight = loop.engine.config.max_running_requests + opts.max_queued_requests
        self.created = int(time.time())
        self.workers = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="hicache-http-prepare")
        # the Responses API's store (server/responses.py; /stats reports it)
        self.responses = ResponseStore(opts.responses_store_size, opts.responses_store_mb << 20,
                                       on_drop=self._release_dropped)
        self.prompt_cache_keys = PromptCacheKeys()  # /stats "prompt_cache_keys" (server/hints.py)
        tok = self.engine.tokenizer
        self.call_format, source = choose_format(opts.tool_call_parser, tok.chat_template if tok is not None else None)
        logger.info("tool calls: %s format (from %s)", self.call_format.name, source)
        self.sampling_defaults = sampling_defaults(opts, tok.sampling_defaults if tok is not None else {})

    def release_stored(self, stored: Stored) -> Optional[concurrent.futures.Future]:
        """Release the retention of a Responses conversation no longer stored (deleted, or dropped by the
        store's bounds): its prompt and reply as the model saw and wrote them (Responses requests carry
        no salt), on the loop thread; the future holds the tokens released. None (nothing released)
        while another turn of that conversation is stored -- a release clears the whole path, theirs
        too -- or once the engine is gone."""
        ids = stored.ids
        if self.responses.in_a_stored_chain(ids):
            return None
        try:
            return self.loop.call(lambda: self.engine.release_retention(ids, None))
        except EngineDeadError:
            return None

    def _release_dropped(self, stored: Stored) -> None:
        released = self.release_stored(stored)
        if released is not None:  # (nobody waits for it: a failure is logged)
            released.add_done_callback(lambda f: f.exception() and logger.warning(
                "releasing a dropped response's retention failed: %s", f.exception()))

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


def sampling_defaults(opts: ServerOptions, recommended: Mapping[str, float]) -> dict[str, float]:
    """What a request's unset sampling fields take (``RequestBody.with_unset``): --preferred-sampling-params
    (checked with the flags) over the model's ``recommended`` values (``--sampling-defaults model``); a
    model value out of a request's range is left out (logged)."""
    model = {}
    for name, value in recommended.items() if opts.sampling_defaults == "model" else ():
        if (error := range_error(name, value)) is None:
            model[name] = value
        else:
            logger.warning("the model's recommended %s is not used: %s", name, error)
    preferred = opts.preferred_sampling()
    out = {**model, **preferred}
    if out:
        logger.info("sampling for the fields a request leaves unset: %s (%s)",
                    ", ".join(f"{k}={v}" for k, v in out.items()),
                    " over ".join(w for w, d in (("--preferred-sampling-params", preferred), ("the model's", model)) if d))
    return out
