"""Request bodies from untrusted clients: bounded reads, strict JSON, one clear error each.

What a body must pass before any handler sees it:
- at most ``max_bytes`` bytes (413 ``request_too_large``; the read stops at the limit, so a
  huge body costs no more memory than the limit);
- JSON without ``NaN`` / ``Infinity`` (not JSON, though Python's parser takes them), nested
  at most :data:`MAX_JSON_DEPTH` levels, strings that are valid Unicode (a lone surrogate such
  as ``"\\ud800"`` would fail later, inside the tokenizer);
- the endpoint's pydantic model (strict types).

:func:`parse_body` is CPU work (a multi-megabyte body takes tens of milliseconds): the app runs
it off the event loop, together with tokenization.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from .protocol import APIError

MAX_JSON_DEPTH = 32  # OpenAI bodies nest ~6 levels (tools schemas a little more)

M = TypeVar("M", bound=BaseModel)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes (--max-request-bytes).", code="request_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, refusing one longer than ``max_bytes`` as soon as that is known."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        parts.append(chunk)
    return b"".join(parts)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def load_json(raw: bytes) -> Any:
    """``raw`` as a JSON value, or APIError(400) saying what is wrong with it."""
    try:
        # Decoded here: json.loads(bytes) would guess UTF-16/32 from the first bytes.
        obj = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno} column {e.colno}).",
                       code="invalid_json") from None
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8.", code="invalid_json") from None
    except ValueError as e:  # NaN / Infinity
        raise APIError(400, f"the request body is not valid JSON: {e}.", code="invalid_json") from None
    except RecursionError:  # deeper than the parser's own stack allows
        raise _too_deep() from None
    _check_tree(obj)
    return obj


def _too_deep() -> APIError:
    return APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels.", code="invalid_json")


def _check_tree(obj: Any) -> None:
    """Depth limit and valid Unicode in every string (keys too); iterative, so no input can
    exhaust the stack."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key)
                if isinstance(item, (str, dict, list)):
                    stack.append((item, depth + 1))


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the request body contains a string that is not valid Unicode (a lone surrogate "
                            "such as \\ud800).") from None


def parse_body(raw: bytes, model: type[M]) -> M:
    """``raw`` validated as ``model``; every failure is one APIError(400) naming the field."""
    obj = load_json(raw)
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ").rstrip(".")
        raise APIError(400, f"{param}: {msg}." if param else f"{msg}.", param=param) from None
