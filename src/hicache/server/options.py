"""``hicache serve``'s own options (the HTTP layer's; the engine's are :class:`EngineConfig`'s):
dataclass fields that are the flags, declared as EngineConfig's are (hicache/options.py).
Standard library only: ``hicache serve`` refuses a bad flag before torch is imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from ..options import check_bounds, json_object, opt
from ..sampling_ranges import DEFAULTABLE, range_error
from .tool_formats import PARSER_CHOICES

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20  # ~10x a full 128K-token prompt sent as text or as ids
# --max-logprob-tokens: a non-streamed answer with logprobs for 16Ki tokens x 21 entries is ~25 MB of JSON
DEFAULT_MAX_LOGPROB_TOKENS = 16384


@dataclass
class ServerOptions:
    """How the HTTP layer treats clients (``hicache serve`` flags)."""

    served_model_name: Optional[str] = opt(None, "Model name clients use (default: --model).")
    max_queued_requests: int = opt(
        512, "Requests allowed to wait beyond --max-running-requests; more are refused with 503.")
    api_key: Optional[str] = opt(  # None: no authentication
        None, "Require 'Authorization: Bearer <key>' on every endpoint but /health and /metrics (default: "
        "$HICACHE_API_KEY, else no key).")
    max_request_bytes: int = opt(
        DEFAULT_MAX_REQUEST_BYTES, "Largest request body accepted (default 8 MiB); larger ones get 413 before they "
        "are read in full.")
    responses_store_size: int = opt(
        1024, "Responses (/v1/responses with store) kept for previous_response_id, the least recently used dropped "
        "first (0: none kept).", at_least=0)
    responses_store_mb: int = opt(
        256, "Memory those stored responses may hold together (MiB, roughly); the least recently used are dropped "
        "first.", at_least=0)
    # (None: the rest of the context, OpenAI's default; server/submit.py with_reply_room)
    default_max_tokens: Optional[int] = opt(
        None, "Most output tokens of a Chat Completions or Responses request that sets no max (default: the rest "
        "of the context, as OpenAI's; such a request reserves KV up to the context length, so this also lets more "
        "run at once). Completions keep 16, /generate 128, Messages its max_tokens.", at_least=1)
    max_logprob_tokens: int = opt(
        DEFAULT_MAX_LOGPROB_TOKENS, "Most n x prompts x max_tokens a non-streamed answer with logprobs may ask for "
        "(each token carries its top_logprobs alternatives; default 16384, ~25 MB of JSON); larger ones get 400 "
        "and should stream.", at_least=1)
    # server/tool_formats.py writes and parses them; qwen25 and hermes name one format (SGLang's and vLLM's names)
    tool_call_parser: str = opt(
        "auto", "The format tool calls are written and parsed in. auto: the chat template's (<tool_call> tags: "
        "hermes; [TOOL_CALLS]: mistral; <|python_tag|> or Llama 3 headers with \"parameters\": llama3; a template "
        "without tools: hermes, described in a system message); one log line says which "
        "(docs/structured_output.md).", PARSER_CHOICES)
    tool_call_grammar: str = opt(
        "lazy", "lazy: once a reply under tool_choice auto begins a call (<tool_call>, a reply that opens with "
        "{\"name\" ...), the rest of the call is constrained to a given function and its parameters' schema, as "
        "llama.cpp's lazy grammars do; text before it stays free. forced-only: only tool_choice required / a named "
        "function constrains the reply.", ("lazy", "forced-only"))
    # server/state.py sampling_defaults: a request's own value > --preferred-sampling-params > the model's
    sampling_defaults: str = opt(
        "model", "What a request's unset sampling fields (temperature, top_p, top_k, min_p, repetition_penalty) "
        "take. model: the model's recommended values (its generation_config.json, or a GGUF file's "
        "general.sampling.* keys), else OpenAI's defaults; openai: OpenAI's defaults (temperature 1, top_p 1, no "
        "top_k, min_p or penalty). SGLang's flag; one log line at start says what applies.", ("model", "openai"))
    preferred_sampling_params: Optional[str] = opt(
        None, "A JSON object of sampling values for the fields a request leaves unset, over the model's, e.g. "
        "'{\"temperature\": 0.7, \"top_k\": 20}' (fields: " + ", ".join(DEFAULTABLE) + "; SGLang's flag).")

    def __post_init__(self) -> None:
        check_bounds(self)
        self.preferred_sampling()

    def preferred_sampling(self) -> dict[str, float]:
        """--preferred-sampling-params as a dict; ConfigError naming what is wrong (a field no default
        is given for, a value out of the range a request's would be refused in)."""
        if self.preferred_sampling_params is None:
            return {}
        given = json_object(self.preferred_sampling_params, "--preferred-sampling-params")
        for name, value in given.items():
            if name not in DEFAULTABLE:
                raise ConfigError(f"--preferred-sampling-params: {name!r} is not one of {', '.join(DEFAULTABLE)}.")
            if (error := range_error(name, value)) is not None:
                raise ConfigError(f"--preferred-sampling-params: {error}")
        return given
