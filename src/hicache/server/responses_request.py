"""What a Responses API request means as a chat request (server/responses.py runs it as one).

``instructions`` a system message, ``input`` text or items (messages with text parts,
``function_call`` items as the assistant's tool calls, ``function_call_output`` items as tool
messages); function ``tools`` and ``tool_choice`` the chat API's; ``text.format`` (json_schema /
json_object) its ``response_format``; ``max_output_tokens`` its ``max_tokens``. The chat
machinery's refusals are answered naming this API's fields (:func:`own_fields`, as server/app.py answers them).
``metadata`` is held to OpenAI's bounds (it is stored and returned with the response).
"""

from __future__ import annotations

import re
from typing import Any, Optional, Union

from pydantic import Field, ValidationError, field_validator

from .protocol import MEDIA_TYPES, APIError, ChatCompletionRequest, RequestBody, media_refusal

# OpenAI's bounds on ``metadata``: at most 16 pairs, keys of at most 64 characters, string values of at most 512
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


class ResponsesRequest(RequestBody):
    model: str
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: bool = True
    text: Optional[dict[str, Any]] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)  # None: the server's default (1 unless set)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    prompt_cache_key: Optional[str] = None  # server/hints.py
    prompt_cache_retention: Optional[str] = None
    edit_reuse: Optional[bool] = None  # hicache's extension: reuse after an edit (docs/edit_reuse.md)

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, v: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if v is not None and (len(v) > METADATA_PAIRS or any(len(k) > METADATA_KEY_CHARS for k in v)
                              or any(not isinstance(x, str) or len(x) > METADATA_VALUE_CHARS for x in v.values())):
            raise ValueError(f"at most {METADATA_PAIRS} pairs, keys of at most {METADATA_KEY_CHARS} characters and "
                             f"string values of at most {METADATA_VALUE_CHARS}")
        return v


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "a message's content must be text or a list of text parts.", param="input")
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind in MEDIA_TYPES:
                raise media_refusal(kind, "input")
            raise APIError(400, f"input content of type {kind!r} is not supported (text only).", param="input")
    return "".join(str(part.get("text", "")) for part in content)


def chat_messages(body: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation ``history`` (a stored response's) plus this request's instructions and input
    items, as chat messages."""
    out = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + list(history)
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise APIError(400, f"input message role {item.get('role')!r} is not supported.", param="input")
            out.append({"role": role, "content": _text_of(item.get("content", ""))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", []), call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": _text_of(item.get("output", ""))})
        else:
            raise APIError(400, f"input items of type {kind!r} are not supported (messages, function_call and "
                                "function_call_output are).", param="input")
    return out


def _chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Function tools (the built-in ones already dropped: server/builtin_tools.py) in the chat API's shape."""
    out = []
    for t in tools:
        if not isinstance(t, dict) or t.get("type") != "function":
            raise APIError(400, "tools must be objects such as {\"type\": \"function\", \"name\": ..., "
                                "\"parameters\": {...}}.", param="tools")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}})
    return out


def _chat_tool_choice(choice: Union[str, dict[str, Any], None]) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                                "\"name\": ...}.", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """``text.format`` as the chat API's ``response_format`` (``text``: plain text)."""
    fmt = (text or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object such as {\"type\": \"json_schema\", \"name\": ..., "
                            "\"schema\": {...}}.", param="text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format of type json_schema needs its JSON Schema as an object in "
                                "text.format.schema.", param="text.format")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"],
                                                       "strict": fmt.get("strict", False)}}
    raise APIError(400, f"text.format type {kind!r} is not supported (text, json_object, json_schema are).",
                   param="text.format")


def as_chat(body: ResponsesRequest, messages: list[dict[str, Any]], tools: list[Any]) -> ChatCompletionRequest:
    """The chat request ``body`` means, with ``messages`` (:func:`chat_messages`) and its function
    ``tools`` (what server/builtin_tools.py kept of ``body.tools``)."""
    chat = {"model": body.model, "messages": messages, "temperature": body.temperature, "top_p": body.top_p,
            "stream": body.stream, "parallel_tool_calls": body.parallel_tool_calls,
            "max_tokens": body.max_output_tokens, "tools": _chat_tools(tools) or None,  # (None: the default)
            "tool_choice": _chat_tool_choice(body.tool_choice), "response_format": _response_format(body.text),
            "prompt_cache_key": body.prompt_cache_key, "prompt_cache_retention": body.prompt_cache_retention,
            "edit_reuse": body.edit_reuse}
    if not messages:
        raise APIError(400, "input must hold at least one message or item.", param="input")
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:  # what the chat API refuses of the translated request
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"the request cannot be served: {where}: {err['msg'].rstrip('.')}.") from None


# A Responses request is prepared and run as a chat request: what its errors call the chat fields
# they name, and the request fields they are here (a message or a tool that the chat API nests
# under ``function`` is flat here).
CHAT_FIELDS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
               "response_format": "text.format", "messages": "input"}
_CHAT_WORD = re.compile(r"\b(max_completion_tokens|max_tokens|response_format)\b|(\]\.function\.)")


def own_fields(e: APIError) -> APIError:
    """``e`` naming this API's fields where the chat machinery named its own."""
    message = _CHAT_WORD.sub(lambda m: "]." if m.group(2) else CHAT_FIELDS[m.group(1)], e.message)
    return APIError(e.status, message, e.type, CHAT_FIELDS.get(e.param or "", e.param), e.code)
