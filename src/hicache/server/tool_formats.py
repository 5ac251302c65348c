"""Tool-call formats per model family: how a model writes its calls, chosen from its chat
template (as llama.cpp detects its chat formats) or named by ``--tool-call-parser``.

A format parses a whole reply into ``(content, calls)``, says how much of a streamed reply's tail
may begin a call (held back until the reply is whole, then sent as ``tool_calls`` deltas), writes
the Lark grammar of a forced call, writes past calls back into a prompt and describes itself to a
model whose template does not render tools. Calls name a function of the request (``names``) and
carry a JSON object of arguments; anything else stays text.

- ``hermes`` (also ``qwen25``; Qwen2.5, Hermes, and the format described to models whose template
  has no tools): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` a call. Small
  models also answer with the bare object, or with it in a fenced ``json`` block: taken when it is
  the whole reply (llama.cpp's Hermes parser takes both).
- ``llama3``: Llama 3.x's ``{"name": ..., "parameters": {...}}`` (``arguments`` too), the whole
  reply, after ``<|python_tag|>`` or not, several separated by ``;`` or newlines.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 templates), or
  ``[TOOL_CALLS]name[ARGS]{...}`` (v11). ``[TOOL_CALLS]`` is a control token: a forced call's
  grammar names it by id, and the reply's text (special tokens left out) starts after it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

SpecialId = Callable[[str], Optional[int]]  # a marker's id where the vocabulary has it as a special token
Triggers = tuple[tuple[str, str], ...]  # (regular expression over the reply, the text the grammar takes for it)
# A reply that begins with a JSON object whose first key is "name" (pretty-printed or not): a call.
# Any name, as llama.cpp's Llama 3.x trigger: the grammar then names one of the request's functions.
_BARE_CALL = (r'\A\s*\{\s*"name"', '{"name"')


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text

    def openai(self, index: Optional[int] = None) -> dict[str, Any]:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


_DECODER = json.JSONDecoder()
_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)


def _values(text: str, separators: str) -> Iterator[Any]:
    """The JSON values ``text`` is made of, between whitespace and ``separators``; ValueError when
    something else is in it."""
    pos = 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text):
            return
        value, pos = _DECODER.raw_decode(text, pos)
        yield value


def _loads(text: str, fallback: Any = None) -> Any:
    """``text`` as a JSON value, or ``fallback`` when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return fallback


def _call(obj: Any, names: set[str], argument_keys: tuple[str, ...]) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    args = obj.get(key, {}) if key else {}
    if not isinstance(args, dict) or set(obj) - {"name", *argument_keys}:
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def whole_reply_calls(text: str, names: set[str], argument_keys: tuple[str, ...],
                      separators: str = "") -> Optional[list[ToolCall]]:
    """The calls a reply is made of, written as bare JSON objects (or one list of them), in a fenced
    block or not; None when anything in it is not such a call."""
    body = text.strip()
    body = fenced.group(1) if (fenced := _FENCE.fullmatch(body)) else body
    if not body.startswith(("{", "[")):
        return None
    try:
        values = list(_values(body, separators))
    except ValueError:
        return None
    if len(values) == 1 and isinstance(values[0], list):
        values = values[0]
    calls = [_call(v, names, argument_keys) for v in values]
    return calls if calls and all(calls) else None  # type: ignore[return-value]


def _prefix_held(text: str, markers: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that are the start of one of ``markers``."""
    return max((k for m in markers for k in range(min(len(m) - 1, len(text)), 0, -1) if text.endswith(m[:k])),
               default=0)


def _whole_reply_held(text: str, starts: tuple[str, ...]) -> int:
    """All of ``text`` after its leading whitespace when that begins like a bare call (or may)."""
    body = text.lstrip()
    return len(body) if body and any(body.startswith(s) or s.startswith(body) for s in starts) else 0


# JSON the way a forced call writes it: one line, ", " and ": " (what the format's examples show).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A call the model began itself keeps its own layout (small models pretty-print; held to one line, a
# 0.5B model's arguments measurably drift): any whitespace between tokens, at most 40 characters a run.
# Lenient: schema keywords llguidance does not implement (Claude Code's tools use propertyNames) are
# not enforced, rather than the whole grammar refused: it is a help to the model, not a promise.
_AS_WRITTEN = {"whitespace_flexible": True, "whitespace_pattern": "[ \\t\\n]{0,40}", "lenient": True}


def _object_grammar(tools: dict[str, dict[str, Any]], names: list[str], argument_key: str,
                    layout: Optional[dict[str, Any]] = None) -> list[str]:
    """Lark rules ``fn0 .. fnN``: one call object of each function, its arguments under its schema,
    laid out as ``layout`` says (llguidance's JSON options; default :data:`_COMPACT`)."""
    # (the arguments' schema typed "object": a schema without a type could take any JSON value)
    return [f"fn{i}: %json " + json.dumps({
        "type": "object", "properties": {"name": {"const": name}, argument_key: {**tools[name], "type": "object"}},
        "required": ["name", argument_key], "additionalProperties": False, "x-guidance": layout or _COMPACT})
        for i, name in enumerate(names)]


def _literal(marker: str, special_id: SpecialId) -> str:
    """A marker in a Lark grammar: by id where it is a special token (text cannot spell it), else quoted."""
    return f"<[{token}]>" if (token := special_id(marker)) is not None else json.dumps(marker)


def _call_args(call: dict[str, Any]) -> tuple[Any, Any]:
    """(name, arguments as a JSON value) of an OpenAI ``tool_calls`` entry from the history."""
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments", "{}")
    return fn.get("name"), _loads(args, args) if isinstance(args, str) else args


def template_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` from the history as a chat template takes them: ``arguments`` the JSON
    object, not its text (templates write ``arguments | tojson``, as transformers and vLLM pass them:
    the text would be written as a JSON string, not the object the model wrote)."""
    return [{**c, "function": {**c["function"], "arguments": _call_args(c)[1]}}
            if isinstance(c, dict) and isinstance(c.get("function"), dict) else c for c in calls]


class CallFormat:
    """One family's tool-call format (module docstring)."""

    name = ""
    example = ""  # one call, as the model should write it (described to templates without tools)
    _STARTS: tuple[str, ...] = ()  # how a reply that is nothing but calls may begin
    TRIGGERS: Triggers = ()  # where a call begins in a reply, and the grammar's spelling of it
    ARGUMENTS = "arguments"  # the key of a call object its arguments go under (in a grammar)
    BETWEEN = '"\\n"'  # what separates parallel calls, in a grammar
    TAG = ""  # what a reply made of calls may open with (removed before they are parsed)
    PARSED_KEYS, SEPARATORS = ("arguments",), ""  # where parsed calls have their arguments; between bare calls

    def parse(self, text: str, names: set[str], truncated: bool = False) -> tuple[Optional[str], list[ToolCall]]:
        """``(content, calls)`` of a reply; ``truncated`` (cut by max_tokens): a call left open at
        the end is dropped, not returned as content. Here: a reply that is nothing but calls
        (:meth:`_calls`), else all of it is content."""
        calls = self._calls(text.strip().removeprefix(self.TAG), names)
        if calls:
            return None, calls
        return (text[:len(text) - self.held_back(text)] if truncated else text).strip() or None, []

    def _calls(self, body: str, names: set[str]) -> Optional[list[ToolCall]]:
        """The calls a whole reply (its tag removed) is made of, or None (:func:`whole_reply_calls`)."""
        return whole_reply_calls(body, names, self.PARSED_KEYS, self.SEPARATORS)

    def held_back(self, text: str) -> int:
        """How many characters at the end of streamed ``text`` may begin a call (a whole-reply format:
        all of it while it may still be one, see ``_STARTS``)."""
        return _whole_reply_held(text, self._STARTS)

    def grammar(self, tools: dict[str, dict[str, Any]], names: list[str], parallel: bool,
                special_id: SpecialId, layout: Optional[dict[str, Any]] = None) -> str:
        """A Lark grammar (llguidance's, with inline ``%json``) for one or more calls of ``names``, their
        JSON laid out as ``layout`` says (:func:`_object_grammar`)."""
        calls = f"call ({self.BETWEEN} call)*" if parallel else "call"
        start, call = self._wrap(calls, " | ".join(f"fn{i}" for i in range(len(names))), special_id)
        return "\n".join([f"start: {start}", f"call: {call}", *_object_grammar(tools, names, self.ARGUMENTS, layout)])

    def _wrap(self, calls: str, alternatives: str, special_id: SpecialId) -> tuple[str, str]:
        """The grammar's start rule (``calls``: one call, or several) and call rule (``alternatives``:
        one call object of each function): bare call objects unless the format marks them."""
        return calls, alternatives

    def lazy_grammar(self, tools: dict[str, dict[str, Any]], names: list[str], parallel: bool,
                     special_id: SpecialId) -> Optional[tuple[str, Triggers]]:
        """The grammar of the calls a model begins on its own (``tool_choice`` auto) and its triggers
        (``GrammarSpec.triggers``): once the reply starts a call, the rest of the call follows the
        function's schema (as llama.cpp's lazy grammars do). None: this format has none."""
        return (self.grammar(tools, names, parallel, special_id, _AS_WRITTEN), self.TRIGGERS) if self.TRIGGERS else None

    def render(self, calls: list[dict[str, Any]]) -> str:
        """Assistant ``tool_calls`` from the history, written back the way the model writes them."""
        raise NotImplementedError

    def system_text(self, tools: list[dict[str, Any]]) -> str:
        """The tool list and this format, for a chat template that does not render tools."""
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You can call functions to help with the user's request. Their signatures, one JSON object a "
                f"line, are inside <tools></tools>:\n<tools>\n{listing}\n</tools>\n\n{self.example}")


class HermesFormat(CallFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
    _BARE_STARTS = ("{", "```json")  # (another fence, ```python, is sent as it comes)
    example = ("To call a function, answer with one JSON object per call, each inside <tool_call></tool_call> "
               "tags:\n<tool_call>\n"
               '{"name": "<function name>", "arguments": {<arguments as a JSON object>}}\n</tool_call>')

    def parse(self, text: str, names: set[str], truncated: bool = False) -> tuple[Optional[str], list[ToolCall]]:
        calls, kept, last = [], [], 0
        for m in self._CALL.finditer(text):
            call = _call(_loads(m.group(1)), names, ("arguments",))
            if call is None:
                continue
            calls.append(call)
            kept.append(text[last:m.start()])
            last = m.end()
        if not calls:  # a bare call object, or one in a fence
            return super().parse(text, names, truncated)
        tail = text[last:]
        kept.append(tail[:len(tail) - self._tag_held(tail)] if truncated else tail)
        return ("".join(kept).strip() or None), calls

    def _tag_held(self, text: str) -> int:
        start = text.find(self.OPEN)
        return len(text) - start if start >= 0 else _prefix_held(text, (self.OPEN,))

    def held_back(self, text: str) -> int:
        return max(self._tag_held(text), _whole_reply_held(text, self._BARE_STARTS))

    def _wrap(self, calls: str, alternatives: str, special_id: SpecialId) -> tuple[str, str]:
        open_, close = _literal(self.OPEN, special_id), _literal(self.CLOSE, special_id)
        return calls, f'{open_} "\\n" ({alternatives}) "\\n" {close}'

    def lazy_grammar(self, tools: dict[str, dict[str, Any]], names: list[str], parallel: bool,
                     special_id: SpecialId) -> Optional[tuple[str, Triggers]]:
        """Tagged calls from ``<tool_call>`` on (after any text), or a reply that is one call object,
        bare or in a ``json`` fence (how small models write it; :meth:`parse` takes all three)."""
        tagged = self.grammar(tools, names, parallel, special_id, _AS_WRITTEN).replace("start:", "tagged:", 1)
        alternatives = " | ".join(f"fn{i}" for i in range(len(names)))
        whole = f'start: tagged | {json.dumps("```json" + chr(10))} one {json.dumps(chr(10) + "```")} | one'
        fenced = (r'\A\s*```json\s*\{\s*"name"', '```json\n{"name"')
        return "\n".join([whole, f"one: {alternatives}", tagged]), ((re.escape(self.OPEN), self.OPEN), fenced,
                                                                     _BARE_CALL)

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{self.OPEN}\n{json.dumps(dict(zip(('name', 'arguments'), _call_args(c))))}\n{self.CLOSE}"
                         for c in calls)


class Llama3Format(CallFormat):
    name = "llama3"
    TAG = "<|python_tag|>"
    _STARTS = ("{", "```json", TAG)
    TRIGGERS = (_BARE_CALL,)
    ARGUMENTS = "parameters"
    PARSED_KEYS, SEPARATORS = ("parameters", "arguments"), ";"
    example = ('To call a function, answer with only a JSON object per call, one a line, in the format '
               '{"name": "<function name>", "parameters": {<arguments as a JSON object>}}')

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(json.dumps(dict(zip(("name", "parameters"), _call_args(c)))) for c in calls)


class MistralFormat(CallFormat):
    name = "mistral"
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    _STARTS = ("{", "[", "```json", TAG)
    _V11 = re.compile(r"\s*([A-Za-z0-9_.\-]{1,64})\s*(?:\[ARGS\])?\s*(\{.*)", re.DOTALL)
    TRIGGERS = ((re.escape(TAG), TAG),)
    BETWEEN = '", "'
    example = ('To call functions, answer with only [TOOL_CALLS] followed by a JSON list of calls, each '
               '{"name": "<function name>", "arguments": {<arguments as a JSON object>}}')

    def _calls(self, body: str, names: set[str]) -> Optional[list[ToolCall]]:
        """v3's JSON list of calls, else v11's ``name[ARGS]{...}`` calls, one after each tag."""
        v3 = super()._calls(body, names)
        if v3:
            return v3
        matches = [self._V11.fullmatch(piece) for piece in body.split(self.TAG)]
        calls = [_call({"name": m.group(1), "arguments": _loads(m.group(2))}, names, ("arguments",)) if m else None
                 for m in matches]
        return calls if all(calls) else None  # type: ignore[return-value]

    def _wrap(self, calls: str, alternatives: str, special_id: SpecialId) -> tuple[str, str]:
        return f'{_literal(self.TAG, special_id)} "[" {calls} "]"', alternatives

    def render(self, calls: list[dict[str, Any]]) -> str:
        return self.TAG + json.dumps([dict(zip(("name", "arguments"), _call_args(c))) for c in calls])


HERMES = HermesFormat()
FORMATS: dict[str, CallFormat] = {"hermes": HERMES, "qwen25": HERMES, "llama3": Llama3Format(),
                                  "mistral": MistralFormat()}
PARSER_CHOICES = ("auto", *FORMATS)


def detect_format(template: Optional[str]) -> CallFormat:
    """The format a chat template's tool section writes (llama.cpp's order: the markers first);
    Hermes for a template without tools (the server describes that format: :meth:`CallFormat.system_text`)."""
    text = template or ""
    if "<tool_call>" in text:
        return HERMES
    if "[TOOL_CALLS]" in text:
        return FORMATS["mistral"]
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and '"parameters"' in text):
        return FORMATS["llama3"]
    return HERMES


def choose_format(parser: str, template: Optional[str]) -> tuple[CallFormat, str]:
    """(the format, why: "the chat template" or "--tool-call-parser") for ``--tool-call-parser``."""
    if parser == "auto":
        return detect_format(template), "the chat template"
    return FORMATS[parser], "--tool-call-parser"
