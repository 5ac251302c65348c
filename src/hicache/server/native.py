"""SGLang's native API: ``POST /generate``, as SGLang answers it.

Units are tokens. One request is one prompt (``text`` or ``input_ids``); a batch of prompts is
refused with a 400. ``sampling_params`` carries SGLang's names and defaults (``max_new_tokens``
128, ``sampling_seed`` is the seed, ``min_new_tokens``, penalties, ``min_p``, ``logit_bias``,
structured output as ``json_schema`` / ``regex`` / ``ebnf``); a parameter hicache cannot honour
is refused unless it is at its neutral value (``n`` 1, ``beam_width`` 1...), so an answer never
silently differs from what was asked. ``null`` means the default for every field; unknown
fields are ignored, as SGLang's extras such as ``lora_path: null`` or ``logprob_start_len``.
``return_logprob`` (with ``top_logprobs_num``) adds SGLang's ``output_token_logprobs`` and
``output_top_logprobs`` (``[logprob, token id, text]`` each; runtime/logprobs.py says which
distribution) to ``meta_info``; prompt logprobs are not computed (``input_token_logprobs`` is empty).

The answer is ``{"text", "output_ids", "meta_info"}``; ``meta_info`` holds ``id`` (the ``rid``),
``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` and SGLang's
``cached_tokens_details`` (device / host / storage), ``finish_reason`` as
``{"type": "stop" | "length" | "abort", "matched" | "length" | "message": ...}``,
``e2e_latency`` (seconds), and hicache's extensions (``timing``, speculative and P/D figures,
``reused_tokens`` / ``hicache_edit_reuse``: server/edit_reuse_usage.py; ``edit_reuse`` in
``sampling_params`` or at the top level switches it per request).
SGLang's ``retention_seconds`` (with ``priority``) asks the cache to keep the prompt and reply
that long (server/hints.py); what it gave is ``meta_info.hicache_retention``.
Streamed, every ``data:`` chunk carries the CUMULATIVE text and output ids so far (SGLang's
default, what its ``bench_serving`` and ``bench_multiturn.py`` read); the last chunk is the
whole answer, then ``data: [DONE]``. ``bootstrap_host`` / ``bootstrap_port`` /
``bootstrap_room`` make the request one half of a P/D pair, as on ``/v1/completions``.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from ..errors import InvalidRequestError
from ..frontend.loop import RequestHandle
from ..runtime.request import GenerateResult
from ..runtime.sampling import GrammarSpec, SamplingParams
from .choices import check_choices, event_stream, merged_updates
from .edit_reuse_usage import outcome_usage, reused_details
from .hints import retention_usage, sglang_hints
from .keepalive import SSE_KEEPALIVE
from .parsing import parse_body, read_body
from .protocol import OPEN, APIError, RequestBody, SamplingBody, sampling_fields
from .state import ServerState
from .submit import (IncrementalText, Prepared, check_fits, collect_result, disagg_figures, engine_dead_during,
                     spec_figures, sse_data, stop_string_matched, submit_request, timing, vet_grammar)

logger = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default

# sampling_params hicache does not implement, with the values that leave the answer unchanged (read from
# the body's extra fields, as the UNSUPPORTED_FIELDS; other unknown fields, e.g. stream_interval, are ignored).
NEUTRAL: dict[str, tuple] = {
    "n": (1,), "no_stop_trim": (False,), "skip_special_tokens": (True,), "stop_regex": ("", []), "beam_width": (1,),
    "custom_params": ({},), "structural_tag": ("",),
}
# Top-level fields refused unless null, false or empty: each would change or add to the answer.
UNSUPPORTED_FIELDS: dict[str, str] = {
    "lora_path": "LoRA adapters are not supported.",
    "image_data": "image inputs are not supported.",
    "audio_data": "audio inputs are not supported.",
    "video_data": "video inputs are not supported.",
    "return_hidden_states": "hidden states are not returned.",
    "custom_logit_processor": "custom logit processors are not supported.",
    "session_params": "sessions are not supported.",
}


class NativeSamplingParams(RequestBody):
    """``sampling_params`` of ``/generate`` (SGLang's names and defaults; null = the default)."""

    model_config = OPEN
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    seed: Optional[int] = Field(None, alias="sampling_seed")  # (SamplingParams' names: protocol.sampling_fields)
    min_tokens: int = Field(0, alias="min_new_tokens")
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[str, float]] = None  # token id (a string) -> bias
    edit_reuse: Optional[bool] = None  # hicache: reuse after an edit (docs/edit_reuse.md); also top-level
    json_schema: Optional[str] = None  # structured output: at most one of these three
    regex: Optional[str] = None
    ebnf: Optional[str] = None

    def grammar(self) -> Optional[GrammarSpec]:
        given = [GrammarSpec(k, v) for k, v in (("json_schema", self.json_schema), ("regex", self.regex),
                                                 ("ebnf", self.ebnf)) if v is not None]
        if len(given) > 1:
            raise APIError(400, "give one of sampling_params.json_schema, regex and ebnf.", param="sampling_params")
        return given[0] if given else None


class GenerateRequest(SamplingBody):
    """The body of ``/generate``. It shares ``SamplingBody``'s ``cache_salt`` and bootstrap fields
    (SGLang's names too); that class's OpenAI sampling fields are not read here: SGLang keeps
    them in ``sampling_params``."""

    model: str = ""  # /generate names no model
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[NativeSamplingParams] = None  # one prompt: one object, not a list
    stream: Optional[bool] = None  # type: ignore[assignment]
    rid: Optional[str] = Field(None, min_length=1, max_length=256)
    return_logprob: Optional[bool] = None
    top_logprobs_num: int = Field(0, ge=0)
    # SGLang's retention (server/hints.py): keep the sequence cached this long, ordered by priority
    retention_seconds: Optional[float] = None
    priority: Optional[int] = None


# SamplingParams' names (InvalidRequestError.param) -> /generate's fields, where they differ
NATIVE_FIELDS = {"seed": "sampling_params.sampling_seed", "min_tokens": "sampling_params.min_new_tokens",
                 "logprobs": "top_logprobs_num"}


def _native_field(param: Optional[str], sp: NativeSamplingParams) -> Optional[str]:
    if param == "grammar":
        return next((f"sampling_params.{k}" for k in ("json_schema", "regex", "ebnf") if getattr(sp, k) is not None),
                    "sampling_params")
    return NATIVE_FIELDS.get(param, f"sampling_params.{param}") if param else None


def _refuse(field: str, message: str) -> APIError:
    return APIError(400, message, param=field, code="unsupported_parameter")


def _check_supported(body: GenerateRequest, sp: NativeSamplingParams) -> None:
    for name, message in UNSUPPORTED_FIELDS.items():
        if body.model_extra.get(name):  # null, false and empty ("lora_path": "", as bench_multiturn.py sends) pass
            raise _refuse(name, f"{name}: {message}")
    for name, neutral in NEUTRAL.items():
        value = sp.model_extra.get(name)
        if value is not None and value not in neutral:
            raise _refuse(f"sampling_params.{name}", f"sampling_params.{name} is not supported; leave it at "
                                                     f"{neutral[0]!r}, got {value!r}.")
    if body.return_logprob and body.bootstrap_room is not None:
        raise _refuse("return_logprob", "return_logprob is not supported for a disaggregated (P/D) request.")


def _prompt(body: GenerateRequest, st: ServerState) -> tuple[list[int], str]:
    """The one prompt's token ids and the field that held it."""
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of text and input_ids.", param="text")
    if body.text is not None:
        if not isinstance(body.text, str):
            raise APIError(400, "one prompt per request is supported; send text as a string.", param="text")
        return st.engine.tokenizer.encode(body.text), "text"
    if body.input_ids and isinstance(body.input_ids[0], list):
        raise APIError(400, "one prompt per request is supported; send input_ids as a list of ints.", param="input_ids")
    return list(body.input_ids), "input_ids"  # type: ignore[arg-type]


def _prepare_generate(raw: bytes, st: ServerState) -> Prepared:
    """The request made ready: hicache's SamplingParams (an invalid combination or an unusable grammar is a 400),
    then its one prompt."""
    body = parse_body(raw, GenerateRequest)
    sp = body.sampling_params or NativeSamplingParams()
    _check_supported(body, sp)
    top_level = sp.edit_reuse is None and body.edit_reuse is not None  # (edit_reuse may be top-level, as cache_salt)
    if top_level:
        sp = sp.model_copy(update={"edit_reuse": body.edit_reuse})
    filled = sp.with_unset(st.sampling_defaults)
    sampling = SamplingParams(max_new_tokens=filled.max_new_tokens, grammar=filled.grammar(),
                              **sampling_fields(filled, "sampling_params.logit_bias"),
                              logprobs=body.top_logprobs_num if body.return_logprob else None)
    try:
        st.engine.check_sampling(sampling)  # (the grammar is vetted next, without holding this thread: vet_grammar)
    except InvalidRequestError as e:
        if e.param == "edit_reuse" and top_level:
            raise APIError(400, str(e), param="edit_reuse") from None
        raise APIError(400, f"sampling_params: {e}", param=_native_field(e.param, sp) or "sampling_params") from None
    check_choices(1, 1, sampling, bool(body.stream), st.opts.max_logprob_tokens, "sampling_params.max_new_tokens")
    hints = sglang_hints(body.retention_seconds, body.priority)
    ids, param = _prompt(body, st)
    explicit = sp.max_new_tokens if "max_new_tokens" in sp.model_fields_set else None  # a default one is shortened
    check_fits(ids, explicit, st.engine.context_length, param)
    return Prepared(body, [ids], sampling, param, grammar_param=_native_field("grammar", sp), hints=hints)


def _finish_reason(res: GenerateResult, p: Prepared, st: ServerState) -> Optional[dict[str, Any]]:
    """SGLang's finish reason: what stopped the request (a token id or stop string), the length."""
    if res.finish_reason == "length":
        return {"type": "length", "length": res.completion_tokens}
    if res.finish_reason == "abort":
        return {"type": "abort", "message": "the request was aborted."}
    last = res.output_ids[-1] if res.output_ids else None
    eos = st.engine.tokenizer.eos_token_ids if not p.sampling.ignore_eos else set()
    if last is not None and (last in eos or last in p.sampling.stop_token_ids):
        return {"type": "stop", "matched": last}
    return {"type": "stop", "matched": stop_string_matched(res, p.sampling.stop_strings, st.engine.tokenizer.decode)}


def _answer_of(rid: str, res: GenerateResult, p: Prepared, st: ServerState) -> dict[str, Any]:
    """The whole answer: non-streaming body, and the last streamed chunk."""
    return {"text": res.text, "output_ids": list(res.output_ids), "meta_info": {
        "id": rid, "finish_reason": _finish_reason(res, p, st), "prompt_tokens": res.prompt_tokens,
        "completion_tokens": res.completion_tokens, "cached_tokens": res.cached_tokens,
        "cached_tokens_details": dict(res.cached_tokens_details), "e2e_latency": res.e2e_s,
        **reused_details([res], st.engine.config.enable_edit_reuse), **outcome_usage([res]),
        "timing": timing(res), **spec_figures(res), **disagg_figures(res), **_logprobs(res, p, st),
        **retention_usage(p.hints, res)}}


def _logprobs(res: GenerateResult, p: Prepared, st: ServerState) -> dict[str, Any]:
    """SGLang's logprob fields of ``meta_info`` (absent unless ``return_logprob``)."""
    if p.sampling.logprobs is None:
        return {}
    decode = st.engine.tokenizer.decode
    return {"input_token_logprobs": [], "input_top_logprobs": [],
            "output_token_logprobs": [[e.logprob, e.token, decode([e.token])] for e in res.logprobs],
            "output_top_logprobs": [[[lp, t, decode([t])] for t, lp in e.top] for e in res.logprobs]}


async def _stream(st: ServerState, handle: RequestHandle, rid: str, p: Prepared) -> AsyncIterator[str]:
    """A chunk per update with the cumulative text and ids; the last chunk is the whole answer."""
    detok = IncrementalText(st.engine.tokenizer.decode, p.sampling.stop_strings)
    text, ids = "", []
    async for item in merged_updates([handle]):
        if item is None:
            yield SSE_KEEPALIVE
            continue
        _, upd = item
        if upd.finished:
            res = upd.result
            yield sse_data(engine_dead_during(res).body() if res.finish_reason == "error" else
                           _answer_of(rid, res, p, st))
            yield "data: [DONE]\n\n"
            return
        text += detok.add(upd.token_ids)
        ids.extend(upd.token_ids)
        yield sse_data({"text": text, "output_ids": ids, "meta_info": {"id": rid, "finish_reason": None,
                        "prompt_tokens": handle.prompt_tokens, "completion_tokens": upd.num_output_tokens}})


def add_native_routes(app: FastAPI, st: ServerState) -> None:
    """SGLang's ``POST /generate``."""
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        p: Prepared = await st.off_loop(_prepare_generate, await read_body(request, st.opts.max_request_bytes), st)
        await vet_grammar(st, p, request)
        rid = p.body.rid or uuid.uuid4().hex  # type: ignore[attr-defined]
        handle = submit_request(st, p)
        logger.info("generate rid=%d id=%s prompt=%d max_new=%d stream=%s", handle.rid, rid, handle.prompt_tokens,
                    handle.max_new_tokens, p.body.stream)
        if p.body.stream:
            return event_stream(st, [handle], _stream(st, handle, rid, p))
        return JSONResponse(_answer_of(rid, await collect_result(st, request, handle), p, st))
