"""Tool-call formats per family on text (issue 57, item 3): each parses the shapes its models write,
holds back what may begin a call while streaming, and its forced-call grammar accepts exactly the
calls it parses; the format is chosen from the chat template unless named."""

from __future__ import annotations

import json

import llguidance
import pytest

from hicache.model.chat_render import compile_chat_template, render
from hicache.model.tokenizer import byte_tokenizer
from hicache.runtime.grammar_state import TriggerScan, compile_triggers, unseen_specials
from hicache.runtime.grammar_vet import tokenizer_config
from hicache.runtime.grammar_worker import ll_tokenizer
from hicache.server.tool_formats import FORMATS, HERMES, choose_format, detect_format
from hicache.server.protocol import ChatCompletionRequest
from hicache.server.tools import ChatChunks, chat_prompt

pytestmark = pytest.mark.server
NAMES = {"get_weather", "add"}
CALL = ("get_weather", '{"city": "Paris"}')


def calls(fmt, text, truncated=False):
    content, parsed = FORMATS[fmt].parse(text, NAMES, truncated)
    return content, [(c.name, c.arguments) for c in parsed]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',  # the bare object small models write
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',  # ... or fenced
    '  [{"name": "get_weather", "arguments": {"city": "Paris"}}]\n',
])
def test_hermes_takes_tags_bare_and_fenced_objects(text):
    assert calls("hermes", text) == (None, [CALL])


def test_hermes_keeps_text_around_tags_and_json_that_is_not_a_call():
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert calls("qwen25", text) == ("Let me check.", [("add", '{"a": 1}')])
    for plain in ['{"city": "Paris"}', '{"name": "unknown", "arguments": {}}', 'Use {"name": "add"} like this',
                  '```json\n{"name": "add", "arguments": 3}\n```']:
        assert calls("hermes", plain) == (plain, [])


def test_llama3_json_with_parameters_python_tag_and_several_calls():
    assert calls("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}') == (None, [CALL])
    assert calls("llama3", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}') == (None, [CALL])
    two = '{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert calls("llama3", two) == (None, [("add", '{"a": 1}'), CALL])
    assert calls("llama3", "It is sunny.") == ("It is sunny.", [])


def test_mistral_v3_list_and_v11_args():
    assert calls("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]') == (None, [CALL])
    # the control token left out of the decoded text: the list alone
    assert calls("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]') == (None, [CALL])
    assert calls("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}') == (None, [CALL])
    assert calls("mistral", "[1, 2, 3]") == ("[1, 2, 3]", [])


@pytest.mark.parametrize("fmt,text", [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "add", "argu'),
    ("hermes", '{"name": "add", "argu'),
    ("llama3", '{"name": "add", "param'),
    ("mistral", '[TOOL_CALLS][{"name": "add"'),
])
def test_a_call_cut_by_max_tokens_is_dropped_not_returned_as_text(fmt, text):
    content, parsed = calls(fmt, text, truncated=True)
    assert parsed == [] and content in (None, "Sure.")


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_streamed_calls_are_held_then_sent_as_deltas(fmt):
    """Streaming: text that may begin a call is held back, then the parsed calls go out as
    ``tool_calls`` deltas; the same reply whole gives the same calls."""
    reply = {"hermes": '{"name": "get_weather", "arguments": {"city": "Paris"}}',
             "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
             "mistral": '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'}[fmt]
    chunks = ChatChunks({}, frozenset(NAMES), fmt=FORMATS[fmt])
    sent = [chunks(piece, None, i == 0, [])["choices"][0]["delta"].get("content", "")
            for i, piece in enumerate(reply[k:k + 7] for k in range(0, len(reply), 7))]
    assert "".join(sent) == ""
    last = chunks("", "stop", False, [])["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == CALL


def test_plain_text_streams_as_it_comes():
    chunks = ChatChunks({}, frozenset(NAMES), fmt=HERMES)
    assert chunks("It is ", None, True, [])["choices"][0]["delta"]["content"] == "It is "
    assert chunks("sunny.", None, False, [])["choices"][0]["delta"]["content"] == "sunny."
    assert chunks("```python\nx = 1", None, False, [])["choices"][0]["delta"]["content"] == "```python\nx = 1"


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_the_forced_grammar_accepts_what_the_parser_takes(fmt):
    """Random model's byte tokenizer: each format's grammar accepts its own rendering of two calls and
    refuses a call of a function not forced; the parser reads the rendering back."""
    tokenizer = byte_tokenizer()
    config = tokenizer_config(tokenizer, tokenizer.vocab_size)
    lltok = ll_tokenizer(llguidance, config, lambda t: tokenizer.backend.encode(t, add_special_tokens=False).ids)
    schemas = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}},
               "add": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    history = [{"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
               {"function": {"name": "add", "arguments": '{"a": 1}'}}]
    fmt_ = FORMATS[fmt]
    written = fmt_.render(history)
    assert [(c.name, json.loads(c.arguments)) for c in fmt_.parse(written, NAMES)[1]] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    grammar = fmt_.grammar(schemas, ["get_weather", "add"], True, tokenizer.special_token_id)
    matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", grammar), log_level=0)
    assert matcher.consume_tokens(tokenizer.encode(written)) and matcher.is_accepting(), matcher.get_error()
    only = fmt_.grammar(schemas, ["add"], False, tokenizer.special_token_id)
    matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", only), log_level=0)
    assert not matcher.consume_tokens(tokenizer.encode(written))


LAZY_SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}},
                "add": {"type": "object", "properties": {"a": {"type": "integer"}}}}


def _lazy_start(fmt: str, reply: str):
    """Scan ``reply`` token by token as the engine does: (the grammar's matcher fed the trigger's
    start, the tokens after the one that triggered, the byte tokenizer) or None when nothing triggers."""
    tokenizer = byte_tokenizer()
    config = tokenizer_config(tokenizer, tokenizer.vocab_size)
    lltok = ll_tokenizer(llguidance, config, lambda t: tokenizer.backend.encode(t, add_special_tokens=False).ids)
    grammar, triggers = FORMATS[fmt].lazy_grammar(LAZY_SCHEMAS, list(LAZY_SCHEMAS), True, tokenizer.special_token_id)
    ids, scan = tokenizer.encode(reply), TriggerScan(compile_triggers(triggers))
    unseen = unseen_specials(scan.patterns, config["tokens"], config["special"])
    for k in range(1, len(ids) + 1):
        start = scan.feed(ids[:k], config["tokens"], unseen)
        if start is not None:
            matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", grammar), log_level=0)
            assert matcher.consume_tokens(tokenizer.encode(start)), (start, matcher.get_error())
            return matcher, ids[k:], tokenizer
    return None


@pytest.mark.parametrize("fmt, reply", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("hermes", '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'),
    ("hermes", ' {"name": "add", "arguments": {"a": 1}}'),
    ("llama3", '{\n "name": "add",\n "parameters": {"a": 1}\n}'),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]'),
])
def test_a_lazy_grammar_takes_over_where_a_reply_begins_a_call(fmt, reply):
    """Under tool_choice auto: a trigger matches where the model begins a call (tags after text, a
    reply that opens with a call object, pretty-printed or fenced); the grammar then takes the rest
    of the reply as written, and the parser reads the call back."""
    matcher, rest, _ = _lazy_start(fmt, reply)
    assert matcher.consume_tokens(rest) and matcher.is_accepting(), matcher.get_error()
    assert len(FORMATS[fmt].parse(reply, NAMES)[1]) == 1


def test_a_lazy_grammar_leaves_text_and_json_that_is_no_call_alone_and_steers_an_invented_name():
    for reply in ("The weather is fine.", 'Your package.json:\n```json\n{"name": "my-app"}\n```',
                  '{"city": "Paris"}'):
        assert _lazy_start("hermes", reply) is None, reply
    # a reply that opens with a call object names one of the request's functions from there on
    matcher, rest, tokenizer = _lazy_start("hermes", '```json\n{"name": "ls", "arguments": {}}\n```')
    assert not matcher.consume_tokens(rest)
    matcher, _, _ = _lazy_start("hermes", '```json\n{"name"')
    assert matcher.consume_tokens(tokenizer.encode(': "add"'))


def test_a_special_token_the_reply_does_not_show_does_not_hide_the_call_after_it():
    """Seen in a Claude Code session: the reply showed a bare call object naming no tool (the model had
    opened it with a special token, which decoding leaves out), unsteered: the trigger anchored at the
    reply's start never matched. The scan reads what the reply shows; a special a trigger names stays."""
    reply = '<|im_start|>{"name": "add", "arguments": {"a": 1}}'
    matcher, rest, tokenizer = _lazy_start("hermes", reply)
    assert matcher.consume_tokens(rest) and matcher.is_accepting(), matcher.get_error()
    shown = tokenizer.decode(tokenizer.encode(reply))
    assert shown == reply.removeprefix("<|im_start|>") and len(HERMES.parse(shown, NAMES)[1]) == 1
    matcher, rest, _ = _lazy_start("hermes", '<|im_start|>{"name": "Receive", "arguments": {}}')
    assert not matcher.consume_tokens(rest)  # an invented name is steered as without the special token
    config = tokenizer_config(tokenizer, tokenizer.vocab_size)
    named = compile_triggers([(r"<\|im_start\|>", "")])
    assert tokenizer.special_token_id("<|im_start|>") not in unseen_specials(named, config["tokens"], config["special"])


def test_the_format_comes_from_the_template_unless_named():
    assert detect_format("{% if tools %}<tool_call>{{ tools }}</tool_call>{% endif %}").name == "hermes"
    assert detect_format("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{{ '[TOOL_CALLS]' }}").name == "mistral"
    llama = '<|start_header_id|>ipython<|end_header_id|>{"name": ..., "parameters": ...}<|python_tag|>'
    assert detect_format(llama).name == "llama3"
    assert detect_format(None).name == "hermes" and detect_format("{{ messages }}").name == "hermes"
    assert choose_format("auto", llama) == (FORMATS["llama3"], "the chat template")
    assert choose_format("hermes", llama) == (HERMES, "--tool-call-parser")


# Qwen2.5's template writes a past call's arguments with ``tojson`` (its assistant branch, verbatim)
QWEN25_CALLS = ("{%- for message in messages %}{%- if message.tool_calls %}"
                "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
                "{%- set tool_call = tool_call.function %}{%- endif %}"
                "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
                "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
                "{%- endfor %}{%- endif %}{%- endfor %}")


def test_a_past_call_comes_back_in_the_prompt_as_the_model_wrote_it():
    """A client resends the call as OpenAI writes it (``arguments`` a JSON string): the template gets
    the object, so the history shows what the model wrote (was a JSON string inside the call)."""
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    _, (call,) = HERMES.parse(written, NAMES, False)
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call.openai()]}]})
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in NAMES]
    chat = chat_prompt(body.messages, tools, "auto", True, renders_tools=True)
    assert render(compile_chat_template(QWEN25_CALLS), 10_000, messages=chat.messages).strip() == written
