"""Chat templates rendered within limits (issue 56: a model file's template with nested
``range(99999)`` loops hung ``--chat``; one that doubles a string 40 times asks for 1 TB).

A template is code from the model file. It runs in jinja2's immutable sandbox (no ``_`` attribute,
no mutation of lists or dicts) as transformers renders it, and here within two limits per render:

- time: :data:`RENDER_SECONDS` of wall clock, checked at every loop iteration, call (macros,
  methods), attribute or item access, operator and piece of output;
- size: ``max_chars`` characters of output, and of any string, list or number the template builds
  on the way (``~``, ``+``, ``*``, ``%``, ``**``, ``format`` widths, a call's or filter's integer
  arguments). The engine allows :data:`CHARS_PER_TOKEN` characters (each at least one byte) per
  token of its context, at least :data:`MIN_RENDER_CHARS`: room for any prompt that can fit.

Past either limit the render ends with :class:`ChatTemplateError`, an InvalidRequestError (a server
answers 400). Sources longer than :data:`MAX_TEMPLATE_CHARS` are not compiled.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
import types
from datetime import datetime
from typing import Any, Callable, Sequence

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from hicache.errors import InvalidRequestError
from hicache.model.errors import cut

RENDER_SECONDS = 2.0
CHARS_PER_TOKEN = 32
MIN_RENDER_CHARS = 1 << 20
MAX_TEMPLATE_CHARS = 256 << 10  # a template's source (real ones: up to ~30 KB with tools)
MAX_INT_BITS = 4096  # numbers a template computes with (a squaring loop would take minutes)
_WIDE = re.compile(r"\d{7,}")  # a format width or precision of a million or more
_LIMITS = threading.local()  # this thread's render: .deadline (time.monotonic), .max_chars


class ChatTemplateError(InvalidRequestError):
    """A chat template that cannot render these messages: it raised, ran past a limit, or does not compile."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="messages")


def render_limit_chars(context_tokens: int) -> int:
    """The output limit for a model of ``context_tokens`` positions."""
    return max(CHARS_PER_TOKEN * context_tokens, MIN_RENDER_CHARS)


def _tick() -> None:
    if time.monotonic() > _LIMITS.deadline:
        raise ChatTemplateError(f"the chat template ran past its {RENDER_SECONDS:g} s limit.")


def _check_size(value: Any, what: str = "a value") -> Any:
    """``value`` when within the limits (a string's or list's length, an integer's bits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise ChatTemplateError(f"the chat template computed a number of more than {MAX_INT_BITS} bits.")
    if isinstance(value, (str, list, tuple)) and len(value) > _LIMITS.max_chars:
        raise ChatTemplateError(f"the chat template built {what} longer than its limit of {_LIMITS.max_chars}.")
    return value


def _check_args(args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """A call's integer arguments (widths, counts) within the output limit."""
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > _LIMITS.max_chars:
            raise ChatTemplateError(f"the chat template passed {_check_size(arg)} to a call, past its limit of "
                                    f"{_LIMITS.max_chars}.")


def _check_format(text: str) -> None:
    """A format string (``%`` or ``str.format``) asking for a width or precision of a million or more."""
    specs = re.findall(r"%[-#0 +]*\d*(?:\.\d*)?[a-zA-Z%]", text) + re.findall(r"\{[^{}]*\}", text)
    if any(_WIDE.search(spec) for spec in specs):
        raise ChatTemplateError("the chat template asked for a format width past its limit.")


def _len(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def _shown_len(value: Any) -> int:
    """About ``len(str(value))``, cheaply, for what templates format (a container's repr: 64 an item)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int):  # (bools and numbers of at most MAX_INT_BITS)
        return value.bit_length() // 3 + 2
    return 64 * len(value) if isinstance(value, (list, tuple, dict)) else 24 if isinstance(value, float) else 64


def _grown(op: str, text: str, args: Sequence[Any]) -> int:
    """An upper bound of the length of what the str operation ``op`` (a method, or the jinja filter of
    the same name) makes of ``text``, for those whose result can outgrow their inputs by a product."""
    strings = [a for a in args if isinstance(a, str)]
    number = next((a for a in args if isinstance(a, int) and not isinstance(a, bool)), None)
    longest = max((_shown_len(a) for a in args if a is not None and not isinstance(a, bool)), default=0)
    if op == "replace":  # every place ``old`` matches (every position, for "") gets ``new``
        old = strings[0] if strings else "x"
        return len(text) + (len(text) + 1 if not old else text.count(old)) * longest
    if op == "join":  # the separator between every two items
        items = args[0] if args and isinstance(args[0], (list, tuple)) else ()
        return sum(map(_shown_len, items)) + len(text) * len(items)
    if op in ("format", "format_map", "%"):  # every placeholder gets the longest argument
        return len(text) + (text.count("%") + text.count("{")) * longest
    if op == "expandtabs":
        return len(text) + text.count("\t") * (8 if number is None else number)
    if op == "indent":  # every line gets the indent
        width = len(strings[0]) if strings else 4 if number is None else number
        return len(text) + (text.count("\n") + 1) * width
    if op == "wordwrap":  # every line ends in the wrap string
        return len(text) * (1 + max(map(len, strings), default=1))
    if op == "translate" and args and isinstance(args[0], dict):  # every character becomes the longest value
        return len(text) * (1 + max(map(_shown_len, args[0].values()), default=0))
    return 0


def _check_growth(op: str, text: Any, args: Sequence[Any]) -> None:
    if isinstance(text, str) and _grown(op, text, args) > _LIMITS.max_chars:
        raise ChatTemplateError(f"the chat template's {op} would build a string longer than its limit of "
                                f"{_LIMITS.max_chars}.")


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the limits checked at each hook it offers."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's own)
        _tick()
        if isinstance(__obj, types.BuiltinFunctionType):  # str.center(10 ** 9)...: sizes taken from arguments
            _check_args(args, kwargs)
            if __obj.__name__ == "join" and args and not isinstance(args[0], (list, tuple)):
                args = (list(_ticks(args[0])), *args[1:])
            _check_growth(__obj.__name__, getattr(__obj, "__self__", None), [*args, *kwargs.values()])
        return _check_size(super().call(__context, __obj, *args, **kwargs), "a value")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        for value in (left, right):
            _check_size(value)
        if operator == "*" and isinstance(left, int) != isinstance(right, int):  # a sequence repeated
            count, seq = (left, right) if isinstance(left, int) else (right, left)
            if count * _len(seq) > _LIMITS.max_chars:
                raise ChatTemplateError(f"the chat template built a value longer than its limit of {_LIMITS.max_chars}.")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and right * left.bit_length() > MAX_INT_BITS:
            raise ChatTemplateError(f"the chat template computed a number of more than {MAX_INT_BITS} bits.")
        elif operator == "+" and _len(left) + _len(right) > _LIMITS.max_chars:
            raise ChatTemplateError(f"the chat template built a value longer than its limit of {_LIMITS.max_chars}.")
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
            _check_growth("%", left, right if isinstance(right, tuple) else [right])
        return _check_size(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        text = value.__self__
        _check_format(text)

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_growth("format", text, [*args, *kwargs.values()])
            return wrapped(*args, **kwargs)

        return checked


def _ticks(values: Any) -> Any:
    """A loop's items, the time limit checked before each."""
    for value in values:
        _tick()
        yield value


def _concat(parts: tuple) -> str:
    """``a ~ b ~ ...``: jinja's own join, within the size limit."""
    texts = [str(p) for p in parts]
    if sum(map(len, texts)) > _LIMITS.max_chars:
        raise ChatTemplateError(f"the chat template built a string longer than its limit of {_LIMITS.max_chars}.")
    return "".join(texts)


class _Guard(NodeTransformer):
    """Every ``for`` loop iterates through :func:`_ticks`; every ``~`` joins through :func:`_concat`."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "hicache_ticks", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        joined = nodes.Tuple(node.nodes, "load", lineno=node.lineno)
        return nodes.Filter(joined, "hicache_concat", [], [], None, None, lineno=node.lineno)


def _filter(name: str, function: Callable) -> Callable:
    """A jinja filter with its integer arguments (widths, counts), its format string (``format``) and
    its result within the limits."""

    first = 2 if hasattr(function, "jinja_pass_arg") else 1  # the context (where passed), then the value

    @functools.wraps(function)  # (keeps jinja's pass_context / pass_environment marks)
    def limited(*args: Any, **kwargs: Any) -> Any:
        _tick()
        head, value, params = args[:first - 1], args[first - 1], args[first:]
        _check_args(params, kwargs)
        if name == "format":
            _check_format(str(value))
        if name == "join":
            value = value if isinstance(value, (str, list, tuple)) else list(_ticks(value))
            _check_growth("join", params[0] if params else kwargs.get("d", ""), [list(value)])
        else:
            _check_growth(name, value, [*params, *kwargs.values()])
        return _check_size(function(*head, value, *params, **kwargs))

    return limited


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


def compile_chat_template(text: str):
    """A chat template as transformers renders it (trimmed blocks, loop controls, ``raise_exception``,
    ``strftime_now``, a ``tojson`` that keeps non-ASCII text), guarded for :func:`render`. Raises
    TemplateError (a syntax error, a source longer than :data:`MAX_TEMPLATE_CHARS`) or RecursionError."""
    if len(text) > MAX_TEMPLATE_CHARS:
        raise TemplateError(f"its source is {len(text)} characters, more than {MAX_TEMPLATE_CHARS}")
    env = _LimitedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals.pop("lipsum", None)
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.filters = {name: _filter(name, f) for name, f in env.filters.items()}
    env.filters.update(hicache_ticks=_ticks, hicache_concat=_concat)
    return env.from_string(_Guard().visit(env.parse(text)))


def render(template: Any, max_chars: int, **context: Any) -> str:
    """``template`` (:func:`compile_chat_template`'s) rendered with ``context`` within
    :data:`RENDER_SECONDS` and ``max_chars``; ChatTemplateError past them, or when the template
    raises (its message, cut to 200 characters)."""
    _LIMITS.deadline, _LIMITS.max_chars = time.monotonic() + RENDER_SECONDS, max_chars
    pieces, size = [], 0
    try:
        for piece in template.generate(**context):
            _tick()
            size += len(piece)
            if size > max_chars:
                raise ChatTemplateError(f"the chat template's output is longer than its limit of {max_chars} "
                                        "characters.")
            pieces.append(piece)
    except ChatTemplateError:
        raise
    except Exception as e:  # whatever the template's code raised (raise_exception, a type error, recursion...)
        raise ChatTemplateError(f"the chat template cannot render these messages: {cut(str(e)).rstrip('.')}.") from None
    return "".join(pieces)
