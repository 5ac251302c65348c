"""Several choices in one answer: ``n`` per prompt, several prompts per ``/v1/completions``.

Choice ``index = prompt * n + j`` (OpenAI's order) runs as a request of its own, seeded
``seed + index`` (:meth:`SamplingParams.for_choice`): seeded choices differ, and each is what a
single request with that seed answers. A prompt's choices after the first wait for its prompt to
be computed and cached, then compute only the last partial page: one prefill, ``n`` decodes
(``/v1/stats`` ``prefill_computed_tokens``). Usage counts each prompt once (OpenAI's rule), with
the cache hits of its first choice; ``timing`` is the first choice's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..frontend.loop import RequestHandle, Update
from ..runtime.logprobs import TokenLogprob
from ..runtime.request import GenerateResult
from ..runtime.sampling import SamplingParams
from . import keepalive
from .edit_reuse_usage import outcome_usage, reused_details
from .protocol import APIError
from .state import ServerState
from .submit import Prepared, collect_result, disagg_figures, spec_figures, submit_request

logger = logging.getLogger(__name__)

MAX_CHOICES = 128  # n x prompts in one request


def submit_choices(st: ServerState, p: Prepared) -> list[RequestHandle]:
    """Queue every choice of ``p`` (``p.prompts`` x ``p.n``); if one is refused, abort the rest."""
    handles: list[RequestHandle] = []
    try:
        for k, ids in enumerate(p.prompts):
            for j in range(p.n):  # (a prompt's later choices wait for its first: handles[k * n])
                handles.append(submit_request(st, p, ids, p.sampling.for_choice(k * p.n + j),
                                              handles[k * p.n].rid if j else None))
    except BaseException:
        abort_unfinished(st, handles)
        raise
    return handles


def abort_unfinished(st: ServerState, handles: list[RequestHandle], why: str = "") -> None:
    """Abort every request of ``handles`` still running (a stream closed early: the client went away
    or the server is stopping; ``why`` says so in the log line), so its pages are freed."""
    for h in (h for h in handles if not h.finished):
        if why:
            logger.info("%s rid=%d; aborting", why, h.rid)
        st.loop.abort(h.rid)


def event_stream(st: ServerState, handles: list[RequestHandle], events: AsyncIterator[str],
                 headers: Optional[dict[str, str]] = None) -> StreamingResponse:
    """``events`` as a server-sent event stream; whatever of ``handles`` still runs when it ends (the
    client went away, or the server is stopping) is aborted, so its pages are freed."""
    async def guarded() -> AsyncIterator[str]:
        try:
            async for line in events:
                yield line
        finally:
            abort_unfinished(st, handles, "stream closed early")
    return StreamingResponse(guarded(), media_type="text/event-stream", headers=headers)


async def collect_choices(st: ServerState, request: Request, handles: list[RequestHandle]) -> list[GenerateResult]:
    """Every choice's result; if one fails (or the client leaves), the others are aborted."""
    try:
        return list(await asyncio.gather(*(collect_result(st, request, h) for h in handles)))
    except BaseException:
        abort_unfinished(st, handles)
        raise


async def merged_updates(handles: list[RequestHandle],
                         admissions: bool = False) -> AsyncIterator[Optional[tuple[int, Update]]]:
    """``(choice index, update)`` as the choices' updates arrive, until every choice finished, and a
    None each :data:`~.keepalive.KEEPALIVE_INTERVAL_S`, updates or not (the caller writes its API's
    keep-alive for it: server/keepalive.py; an update may write nothing, as a tool call's tokens held
    until the call is whole); a choice's admission update (no tokens yet: :attr:`Update.admission`)
    only with ``admissions`` (the Messages stream's ``message_start``: the other APIs have no event for it)."""
    queue: asyncio.Queue[tuple[int, Update]] = asyncio.Queue()
    clock = asyncio.get_running_loop().time

    async def pump(i: int, h: RequestHandle) -> None:
        async for upd in h:
            await queue.put((i, upd))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        left, due = len(handles), clock() + keepalive.KEEPALIVE_INTERVAL_S
        while left:
            try:  # (a get cut by the timeout loses no update: wait_for returns one that came meanwhile)
                i, upd = await asyncio.wait_for(queue.get(), max(0.0, due - clock()))
            except asyncio.TimeoutError:
                due = clock() + keepalive.KEEPALIVE_INTERVAL_S
                yield None
                continue
            left -= upd.finished
            if admissions or not upd.admission:
                yield i, upd
    finally:
        for t in tasks:
            t.cancel()


def usage_of(results: list[GenerateResult], n: int, edit_reuse: bool = False) -> dict[str, Any]:
    """OpenAI's usage of all choices, with hicache's extensions: each prompt once (its first choice's
    hits, per tier, and tokens reused after an edit -- ``edit_reuse``: the server runs with it,
    server/edit_reuse_usage.py; speculative and P/D figures the first choice's), every completion."""
    firsts = results[::n]
    prompt, completion = sum(r.prompt_tokens for r in firsts), sum(r.completion_tokens for r in results)
    tiers = {t: sum(r.cached_tokens_details[t] for r in firsts) for t in firsts[0].cached_tokens_details}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts),
                                      "cached_tokens_details": tiers, **reused_details(firsts, edit_reuse)},
            # The same per-tier counts under a name of hicache's own: proxies (litellm) drop the field above,
            # whose name another shape of theirs takes.
            "hicache_cached_tokens": dict(tiers), **outcome_usage(firsts), **spec_figures(firsts[0]),
            **disagg_figures(firsts[0])}


def check_choices(n: int, prompts: int, sampling: SamplingParams, stream: bool, max_logprob_tokens: int,
                  max_param: str = "max_tokens") -> None:
    """400 for more choices than one answer may hold, before anything is tokenized: ``n`` x
    ``prompts`` over :data:`MAX_CHOICES`, or a non-streamed answer with logprobs whose
    ``n x prompts x max_tokens`` exceeds ``max_logprob_tokens`` (``--max-logprob-tokens``: each
    token's entry carries its ``top_logprobs`` alternatives, ~70 bytes each in JSON)."""
    if n < 1:
        raise APIError(400, f"n must be at least 1, got {n}.", param="n")
    if n * prompts > MAX_CHOICES:
        raise APIError(400, f"n x prompts is {n * prompts}; at most {MAX_CHOICES} choices per request.", param="n")
    tokens = n * prompts * sampling.max_new_tokens
    if sampling.logprobs is not None and not stream and tokens > max_logprob_tokens:
        raise APIError(400, f"a response with logprobs for n x prompts x max_tokens = {tokens} tokens is more than "
                            f"this server answers at once ({max_logprob_tokens}, --max-logprob-tokens); lower n or "
                            "max_tokens, or stream it.", param=max_param)


# ---- logprobs as OpenAI writes them ---------------------------------------------------------------
def _logprob(x: float) -> float:
    return max(x, -9999.0)  # OpenAI's floor; JSON has no -inf


def chat_logprobs(entries: list[TokenLogprob], decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def item(tok: int, lp: float) -> dict[str, Any]:
        text = decode([tok])
        return {"token": text, "logprob": _logprob(lp), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(entries: list[TokenLogprob], decode: Callable[[list[int]], str],
                        offset: int = 0) -> dict[str, Any]:
    """Completions' ``logprobs``: parallel lists; ``text_offset`` counts characters of the choice's
    text from ``offset`` (where a streamed chunk starts)."""
    tokens = [decode([e.token]) for e in entries]
    return {"tokens": tokens, "token_logprobs": [_logprob(e.logprob) for e in entries],
            "top_logprobs": [{decode([t]): _logprob(lp) for t, lp in e.top} for e in entries],
            "text_offset": list(itertools.accumulate(map(len, tokens), initial=offset))[:-1]}
