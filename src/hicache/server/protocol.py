"""OpenAI-compatible request bodies (pydantic) and the error shape the server returns.

``null`` for any optional field means its default, as in the OpenAI API. Unknown fields are
ignored (the server logs each name once); fields that would change the answer in ways this
engine does not support (``echo``, ``suffix``, ``best_of`` > 1) are refused with one clear sentence.
Types are strict: ``"max_tokens": "3"`` or ``"stream": "yes"`` is an error, not a guess; numbers
must be finite. Structured output: ``response_format`` (``json_object``, ``json_schema``) and
SGLang's ``regex`` / ``ebnf`` become one :class:`GrammarSpec` (:meth:`SamplingBody.grammar_spec`).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, Mapping, Optional, Self, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..disagg.bootstrap import Bootstrap
from ..disagg.wire import MAX_ROOM
from ..runtime.sampling import GrammarSpec

# Strict types (no "3" -> 3, no "yes" -> True) and no inf/NaN in any float field.
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
OPEN = ConfigDict(STRICT, extra="allow")  # the unknown fields kept (model_extra): logged, or refused by name


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        if code is None and status == 400:  # every refusal of a request's values says so in code too
            code = "invalid_value"
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Content that is not text, by the names the APIs give it (Messages: image / document blocks;
# Responses: input_image / input_file / input_audio parts): refused in a sentence of its own, since
# the models served are text-only, rather than as a validation error naming a branch of a union.
MEDIA_TYPES = {"image": "image", "input_image": "image", "document": "document", "input_file": "file",
               "input_audio": "audio"}


def media_refusal(kind: str, param: str) -> APIError:
    """The 400 for content of type ``kind`` (a key of :data:`MEDIA_TYPES`)."""
    return APIError(400, f"{MEDIA_TYPES[kind]} input is not supported: this server runs text-only models "
                         f"(content of type {kind!r}).", param=param)


class RequestBody(BaseModel):
    """A request body: ``null`` is the field's default (OpenAI's rule for optional fields)."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def with_unset(self, defaults: Mapping[str, Any]) -> Self:
        """This body with ``defaults`` in the fields of theirs the client left unset (absent or null)."""
        fill = {k: v for k, v in defaults.items() if k in type(self).model_fields and k not in self.model_fields_set}
        return self.model_copy(update=fill) if fill else self


class StreamOptions(RequestBody):
    include_usage: bool = False


class SamplingBody(RequestBody):
    """Fields shared by both endpoints (OpenAI names; ``top_k``, ``ignore_eos``,
    ``stop_token_ids``, ``cache_salt``, ``edit_reuse``, ``regex`` and ``ebnf`` are extensions)."""

    model_config = OPEN

    model: str
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    # An empty salt would silently share the unsalted namespace: refused, as vLLM does.
    cache_salt: Optional[str] = Field(None, min_length=1)
    # Reuse after an edit (docs/edit_reuse.md): null the server's --enable-edit-reuse, false off for this
    # request, true asks for it (a 400 on a server without the flag)
    edit_reuse: Optional[bool] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM / SGLang extension
    min_p: float = 0.0  # vLLM / SGLang extension
    min_tokens: int = 0  # vLLM extension (SGLang's min_new_tokens)
    logit_bias: Optional[dict[str, float]] = None  # token id (as a string, OpenAI's form) -> bias
    user: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None
    regex: Optional[str] = None  # SGLang: the output matches this regular expression
    ebnf: Optional[str] = None  # SGLang: the output matches this grammar (GBNF)
    # Prefill/decode disaggregation: what sglang-router adds to a request it sends to both
    # servers (SGLang's other extras it adds, e.g. no_stop_trim, are ignored as unknown fields).
    bootstrap_host: Optional[str] = Field(None, min_length=1, max_length=253)
    bootstrap_port: Optional[int] = Field(None, ge=1, le=65535)
    bootstrap_room: Optional[int] = Field(None, ge=0, le=MAX_ROOM)

    def bootstrap(self) -> Optional[Bootstrap]:
        """Where the request's other half runs, or None (all three fields or none)."""
        fields = (self.bootstrap_host, self.bootstrap_port, self.bootstrap_room)
        if all(f is None for f in fields):
            return None
        if any(f is None for f in fields):
            raise APIError(400, "bootstrap_host, bootstrap_port and bootstrap_room go together.", param="bootstrap_room")
        try:
            return Bootstrap(self.bootstrap_host, self.bootstrap_port, self.bootstrap_room)
        except ValueError as e:  # a request that could never connect: said now, not at the transfer timeout
            raise APIError(400, str(e), param="bootstrap_host") from None

    def grammar_spec(self) -> Optional[tuple[str, GrammarSpec]]:
        """``(field, spec)``: what the output must match and the field that said so (response_format,
        regex or ebnf; at most one), or None."""
        given = [(f, spec) for f, spec in (("response_format", _response_format_grammar(self.response_format)),
                                           ("regex", None if self.regex is None else GrammarSpec("regex", self.regex)),
                                           ("ebnf", None if self.ebnf is None else GrammarSpec("ebnf", self.ebnf)))
                 if spec is not None]
        if len(given) > 1:
            raise APIError(400, f"give one of response_format, regex and ebnf, not {' and '.join(f for f, _ in given)}.",
                           param=given[1][0])
        return given[0] if given else None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first option this engine cannot honour, else None."""
        if self.bootstrap_room is not None and (self.n != 1 or self.top_logprobs_k() is not None):
            return ("n" if self.n != 1 else "logprobs",
                    "n > 1 and logprobs are not supported for a disaggregated (P/D) request.")
        return None

    def top_logprobs_k(self) -> Optional[int]:
        """None: no logprobs; k: each token's log-probability and its k most likely alternatives
        (each endpoint names them its own way; none here)."""

    # SamplingParams' names (InvalidRequestError.param) -> this body's fields, where they differ
    FIELDS: ClassVar[dict[str, str]] = {"max_new_tokens": "max_tokens"}  # (grammar: field_of reads the body)

    def field_of(self, param: Optional[str]) -> Optional[str]:
        """The body's field for an engine error's ``param`` (a SamplingParams name)."""
        if param == "grammar":
            return (self.grammar_spec() or ("response_format", None))[0]
        return self.FIELDS.get(param, param) if param else None


# SamplingParams' fields that an OpenAI body and /generate's sampling_params both carry, under these names
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "stop", "ignore_eos", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "edit_reuse")


def sampling_fields(body: Any, bias_param: str) -> dict[str, Any]:
    """``body``'s :data:`SAMPLING_FIELDS`, ``stop_token_ids`` and ``logit_bias`` as SamplingParams takes them."""
    return {**{f: getattr(body, f) for f in SAMPLING_FIELDS}, "stop_token_ids": tuple(body.stop_token_ids or ()),
            "logit_bias": token_id_keys(body.logit_bias, bias_param)}


def token_id_keys(bias: Optional[dict[str, float]], param: str) -> Optional[dict[int, float]]:
    """``logit_bias`` with its keys as token ids. A key must be written in plain decimal digits
    (OpenAI's form, ``"50256"``): ``int()`` would also take ``" 5_0 "`` as 50."""
    if not bias:
        return None
    bad = next((k for k in bias if not (k.isascii() and k.isdigit())), None)
    if bad is not None:
        raise APIError(400, f"{param} keys must be token ids in decimal digits, e.g. {{\"50256\": -100}}; got {bad!r}.",
                       param=param)
    return {int(k): v for k, v in bias.items()}


def _response_format_grammar(fmt: Optional[dict[str, Any]]) -> Optional[GrammarSpec]:
    """OpenAI's response_format as a grammar: text -> None, json_object -> any JSON object,
    json_schema -> its ``schema`` (``strict`` or not: the schema is always enforced)."""
    if fmt is None or fmt.get("type") == "text":
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return GrammarSpec("json_schema", '{"type": "object"}')
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        schema = inner.get("schema", inner.get("schema_")) if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                "{...}}}.", param="response_format")
        return GrammarSpec("json_schema", json.dumps(schema))
    raise APIError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}.",
                   param="response_format")


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's calls (server/tools.py renders them)
    tool_call_id: Optional[str] = None  # a tool result: the call it answers
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: bool = True
    prompt_cache_key: Optional[str] = None  # a grouping key, no salt (server/hints.py)
    prompt_cache_retention: Optional[str] = None  # "in_memory" | "24h" (server/hints.py)

    FIELDS: ClassVar[dict[str, str]] = {**SamplingBody.FIELDS, "logprobs": "top_logprobs"}

    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_k(self) -> Optional[int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingBody):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None  # the k most likely tokens at each position (0: the sampled one's only)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    prompt_cache_key: Optional[str] = None  # as on chat completions (server/hints.py)
    prompt_cache_retention: Optional[str] = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported."
        if self.suffix:
            return "suffix", "suffix is not supported."
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported."
        return super().unsupported()

    def top_logprobs_k(self) -> Optional[int]:
        return self.logprobs


class TokenizeRequest(RequestBody):
    """``/tokenize`` (extension): token counts with the served model's tokenizer."""

    prompt: Union[str, list[str]]
    return_ids: bool = False
