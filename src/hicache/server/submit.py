"""What every generating endpoint shares (the OpenAI routes in :mod:`.app`, the Messages and Responses
APIs, SGLang's native ``/generate`` in :mod:`.native`): a prepared request, submitting it, waiting
for its result while watching the client, the per-request figures of the answer, and server-sent
events, their text detokenized as it becomes final (:class:`IncrementalText`). Counts are tokens; times are
seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from fastapi import Request

from ..cache_hints import RetentionHint
from ..errors import ContextLengthError, EngineDeadError, HicacheError, InvalidRequestError, OverloadedError
from ..frontend.loop import RequestHandle, Update
from ..runtime.request import GenerateResult
from ..runtime.sampling import SamplingParams
from .protocol import APIError, SamplingBody
from .state import ServerState
from .tool_formats import HERMES, CallFormat
from .tools import ChatChunks, ChunkFn

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks whether its client left


@dataclass
class Prepared:
    """A validated request, tokenized, ready to submit: ``n`` choices for each of ``prompts``."""

    body: SamplingBody
    prompts: list[list[int]]
    sampling: SamplingParams
    param: str  # the field that holds the prompt, for errors about it
    call_names: frozenset[str] = frozenset()  # chat with tools: functions whose calls are parsed
    n: int = 1
    grammar_param: Optional[str] = None  # the field that holds the grammar, for errors about it
    call_format: CallFormat = HERMES  # how the model writes its calls (server/tool_formats.py)
    dropped_tools: tuple[str, ...] = ()  # tools listed that the server cannot run (server/builtin_tools.py)
    hints: tuple[RetentionHint, ...] = ()  # cache hints the body carries (hicache.cache_hints)

    @property
    def ids(self) -> list[int]:
        """The (first) prompt's token ids."""
        return self.prompts[0]


def stop_string_matched(res: GenerateResult, stop_strings: Sequence[str], decode: Callable[[list[int]], str]) -> Optional[str]:
    """The stop string that ended ``res`` (cut from its text), or None (EOS, a stop token, the length)."""
    if res.finish_reason != "stop" or not stop_strings:
        return None
    rest = decode(res.output_ids)[len(res.text):]
    return next((s for s in stop_strings if rest.startswith(s)), None)


def engine_dead(e: BaseException | str) -> APIError:
    return APIError(503, str(e), type="server_error", code="engine_dead")


def engine_dead_during(res: GenerateResult) -> APIError:
    """A request the engine ended with finish_reason "error". A P/D request whose KV transfer
    failed (503 ``kv_transfer_failed``) or whose grammar could not be kept (422 ``grammar_failed``:
    the same request would fail again, so not a status clients retry) failed alone; anything
    else is the engine's failure (503 ``engine_dead``)."""
    if res.error_code == "kv_transfer_failed":
        return APIError(503, f"the KV transfer for this request failed: {res.error}", type="server_error",
                        code=res.error_code)
    if res.error_code == "grammar_failed":
        return APIError(422, f"{res.error}.", type="invalid_request_error", code=res.error_code)
    return engine_dead(f"the engine failed during this request: {res.error}")


def disagg_figures(res: GenerateResult) -> dict[str, Any]:
    """P/D per-request figures (extension; absent for a request without a bootstrap)."""
    if not res.disaggregated:
        return {}
    return {"decode_prefix_len": res.decode_prefix_len, "kv_transferred_tokens": res.kv_transferred_tokens,
            "kv_transferred_bytes": res.kv_transferred_bytes}


def spec_figures(res: GenerateResult) -> dict[str, Any]:
    """Speculative decoding's per-request figures (extension; absent when it is off)."""
    if not res.spec_verify_steps:
        return {}
    return {"spec_accept_length": res.spec_accept_length, "spec_verify_steps": res.spec_verify_steps}


def timing(res: GenerateResult) -> dict[str, float]:
    """Server-side timing of one request (extension), seconds."""
    return {"ttft_s": res.ttft_s, "queue_time_s": res.queue_time_s, "forward_time_s": res.forward_time_s,
            "e2e_s": res.e2e_s}


def with_reply_room(st: ServerState, sampling: SamplingParams, prompt_tokens: int,
                    cap: Optional[int]) -> SamplingParams:
    """``sampling`` with ``max_new_tokens`` set to the output tokens a request may take: the rest of the
    context (OpenAI's default for a chat or Responses request that sets no max), within what the device
    pool can reserve for one request (admission reserves the prompt plus its most output), at most
    ``cap`` (``--default-max-tokens``, or a Messages request's ``max_tokens``; None: no cap). Checked
    again: a ``min_tokens`` past the room is refused (400) as it is past an explicit max."""
    eng = st.engine
    pool = eng.capacity_pages * eng.config.page_size - eng.config.speculative_steps
    room = min(eng.context_length, pool) - prompt_tokens
    room = max(1, min(room, cap) if cap is not None else room)  # (a prompt that fills it is refused later)
    sampling = dataclasses.replace(sampling, max_new_tokens=room)
    try:
        sampling.validate()
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    return sampling


def check_fits(ids: list[int], max_new: Optional[int], context_length: int, param: str) -> None:
    """An explicit max_tokens that cannot fit is an error (a default one is shortened)."""
    if max_new is not None and len(ids) + max_new > context_length:
        raise APIError(400, f"the prompt has {len(ids)} tokens and max_tokens is {max_new}, but the context length "
                            f"is {context_length}; lower max_tokens or shorten the prompt.",
                       param=param, code="context_length_exceeded")


async def vet_grammar(st: ServerState, p: Prepared, request: Request) -> None:
    """Wait for the verdict on ``p``'s grammar (compiled in the engine's contained grammar checker,
    runtime/grammar_vet.py) without holding any thread; attach its cost to ``p.sampling``. A grammar
    the engine refuses is a 400 naming its field; one it could not check (too many waiting, the
    checker down), a 503. Grammars are checked fairly between clients (the peer's address); a
    client that goes away meanwhile gives up its place (its job leaves the checker's queue, or is
    stopped there if nobody else waits for it) and gets 499."""
    spec = p.sampling.grammar
    if spec is None or spec.cost is not None:
        return
    waiting: Optional[asyncio.Future] = None
    try:
        waiting = asyncio.wrap_future(st.engine.vet_grammar(spec, request.client.host if request.client else None))
        vetted = await _unless_gone(request, waiting, "client disconnected while its grammar waited to be checked")
    except (InvalidRequestError, OverloadedError) as e:
        if spec.lazy:  # (the grammar of calls the request did not force: it runs without it)
            logger.warning("tool calls under tool_choice auto run without their grammar: %s", e)
            vetted = None
        elif isinstance(e, InvalidRequestError):
            raise APIError(400, str(e), param=p.grammar_param) from None
        else:
            raise APIError(503, str(e), type="server_error", code="server_overloaded") from None
    finally:
        if waiting is not None and not waiting.done():
            waiting.cancel()  # (cancels the engine's future too: the checker drops the job)
    p.sampling = dataclasses.replace(p.sampling, grammar=vetted)


async def _unless_gone(request: Request, waiting: asyncio.Future, gone: str) -> Any:
    """``waiting``'s result; APIError 499 (and the log line ``gone``) once the client has closed the
    connection (checked every :data:`DISCONNECT_POLL_S` seconds; the caller cancels what it waited for)."""
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
        if done:
            return waiting.result()
        if await request.is_disconnected():
            logger.info(gone)
            raise APIError(499, "the client closed the connection.", code="client_closed")


class IncrementalText:
    """Decodes the growing output and hands out only text that cannot change any more.

    Held back: a trailing replacement character (an incomplete UTF-8 sequence may still be
    completed by the next token) and, when stop strings are set, the last ``len(stop) - 1``
    characters (they may be the start of a stop string the final text will cut).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str]) -> None:
        self._decode, self._emitted = decode, 0  # _emitted: characters already handed out
        self._ids: list[int] = []
        self._hold = max((len(s) for s in stops), default=1) - 1

    def add(self, token_ids: Sequence[int]) -> str:
        """Text that became final with these new tokens (may be empty)."""
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        end = len(text) - self._hold
        while end > self._emitted and text[end - 1] == "\ufffd":
            end -= 1
        out, self._emitted = text[self._emitted : end], max(end, self._emitted)
        return out

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the engine's text, stop string already cut)."""
        out, self._emitted = final_text[self._emitted :], len(final_text)
        return out


class ChoiceStream:
    """One choice's updates as its stream's chunks (``chunk``: a :data:`ChunkFn`): text as it becomes
    final (:class:`IncrementalText`), then the rest and the finish chunk (none after an engine failure: the
    caller answers that in its API's way)."""

    def __init__(self, chunk: ChunkFn, p: Prepared, decode: Callable[[list[int]], str]) -> None:
        self.chunk, self.detok, self.first = chunk, IncrementalText(decode, p.sampling.stop_strings), True

    def __call__(self, upd: Update) -> list[dict[str, Any]]:
        res = upd.result if upd.finished else None
        text = self.detok.finish(res.text) if res is not None else self.detok.add(upd.token_ids)
        out = []
        if res is None or text or self.first or upd.logprobs:  # (a finished reply: its last text, when any)
            out.append(self.chunk(text, None, self.first, upd.logprobs))
        if res is not None and res.finish_reason != "error":
            out.append(self.chunk("", res.finish_reason, False, []))
        self.first = False
        return out


class ReplyDeltas(ChoiceStream):
    """A single-choice chat reply as the chat stream's deltas, update by update (what the Messages and
    Responses streams write as events of their own): what may begin a tool call held back, and at the
    end the rest with the calls parsed."""

    def __init__(self, p: Prepared, decode: Callable[[list[int]], str]) -> None:
        super().__init__(ChatChunks({}, p.call_names, fmt=p.call_format), p, decode)

    def __call__(self, upd: Update) -> list[dict[str, Any]]:
        return [chunk["choices"][0]["delta"] for chunk in super().__call__(upd)]


def sse_data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_event(kind: str, data: dict[str, Any]) -> str:
    """A typed server-sent event (the Messages and Responses streams): ``data`` with its ``type``."""
    return f"event: {kind}\n" + sse_data({"type": kind, **data})


def submit_request(st: ServerState, p: Prepared, ids: Optional[list[int]] = None,
                   sampling: Optional[SamplingParams] = None, waits_for: Optional[int] = None) -> RequestHandle:
    """Queue a prepared request (or one of its choices: ``ids``, ``sampling``, ``waits_for``);
    engine-side refusals become OpenAI errors."""
    st.check_capacity()
    try:
        return st.loop.submit(p.ids if ids is None else ids, sampling or p.sampling, p.body.cache_salt,
                              bootstrap=p.body.bootstrap(), waits_for=waits_for, hints=p.hints)
    except ContextLengthError as e:
        raise APIError(400, str(e), param=p.param, code="context_length_exceeded") from None
    except EngineDeadError as e:
        raise engine_dead(e) from None
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=p.param if e.param == "prompt" else p.body.field_of(e.param)) from None
    except HicacheError as e:
        raise APIError(400, str(e)) from None


async def collect_result(st: ServerState, request: Request, handle: RequestHandle) -> GenerateResult:
    """Wait for the result; abort the request if the client goes away meanwhile."""
    task = asyncio.ensure_future(handle.wait())
    try:
        res = await _unless_gone(request, task, f"client disconnected rid={handle.rid}; aborting")
    finally:
        if not task.done():
            task.cancel()
            st.loop.abort(handle.rid)
    if res.finish_reason == "error":
        raise engine_dead_during(res)
    return res

