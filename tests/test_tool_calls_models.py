"""Tool calls on the shipped models through all three APIs (issue 57, items 2-4): Qwen2.5 Coder 0.5B
(its template renders the tools; ``<tool_call>`` is a user-defined token), Gemma 3 270M (the
``gemma`` template given; tools described in a system message) and SmolLM2. A forced call
(``required`` / Anthropic ``any``) is grammar-constrained and parses on every API, streamed or not;
an automatic one is parsed from what the model writes. And the packaged Qwen2.5 file is the one
pinned (its header, its size and its SHA-256) and a plain chat turn on it answers sensibly."""

from __future__ import annotations

import hashlib
import json

import pytest
from live_server import serving
from tool_call_apis import TURNS

from hicache.model.errors import ModelNotFoundError
from hicache.model.gguf_file import GGUFFile
from hicache.model.packaged import QWEN_CODER_PARTS, packaged_model_path
from hicache.server.tool_formats import HERMES, detect_format

pytestmark = [pytest.mark.server, pytest.mark.slow]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = "What is the weather in Paris right now?"
MODELS = {  # name: engine options
    "qwen2.5-coder-0.5b": {},
    "gemma3-270m": {"chat_template": "gemma"},
    "smollm2": {},
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    name = request.param
    try:
        packaged_model_path(name)
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    with serving(name, name=name, dtype="auto", max_total_tokens=4096, **MODELS[name]) as srv:
        yield name, srv


STREAMED = {"chat": True, "responses": False, "messages": True}  # forced; automatic calls the other way


@pytest.mark.parametrize("api", list(TURNS))
def test_forced_and_automatic_calls_on_every_api(model, api):
    """Forced: a call that parses and follows the schema. Automatic (greedy: the model picks the tool
    itself): whatever shape it writes the call in (Qwen2.5's tags or the bare object), it comes back
    as a call and nothing of it as text; Qwen2.5 calls, the 135M and 270M models may answer instead.
    Each API streamed once and not once (streamed calls read back from their deltas)."""
    name, srv = model
    _, calls = TURNS[api](srv.base_url, name, ASK, [WEATHER], "required", STREAMED[api])
    assert calls and all(fn == "get_weather" and set(args) == {"city"} for fn, args in calls), calls
    text, calls = TURNS[api](srv.base_url, name, ASK, [WEATHER], "auto", not STREAMED[api])
    if name == "qwen2.5-coder-0.5b":
        assert [fn for fn, _ in calls] == ["get_weather"] and calls[0][1]["city"].lower() == "paris", (text, calls)
    assert "<tool_call>" not in text and not (text.strip().startswith("{") and '"get_weather"' in text), text
    if name == "qwen2.5-coder-0.5b" and api == "chat":  # and a plain chat turn answers sensibly
        text, calls = TURNS[api](srv.base_url, name, "What is 17 + 25? Answer with the number only.", [],
                                 "auto", False, max_tokens=16)
        assert "42" in text and not calls


BASH = {"type": "function", "function": {"name": "Bash", "description": "Run a shell command and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
                       "required": ["command"], "additionalProperties": False}}}
READ = {"type": "function", "function": {"name": "Read", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}}


def _fenced_object(text: str) -> dict:
    return json.loads(text.strip().removeprefix("```json").removesuffix("```"))


@pytest.mark.parametrize("model", ["qwen2.5-coder-0.5b"], indirect=True)
def test_a_call_the_model_begins_follows_the_tools(model):
    """Qwen2.5 Coder 0.5B, greedy, as a coding agent's tools (Bash, Read) reach it. Its own reply
    (tool_choice none: the same prompt, nothing constrained or parsed) to "what is in README.md" is
    a fenced call of a function named "README.md"; under auto the call's grammar takes over at its
    first key, so the name is one of the tools and the call comes back (llama.cpp's lazy grammars).
    Where its own call is valid, the grammar changes nothing: the same call, arguments and all."""
    name, srv = model
    ask = "Show me what is in README.md"
    own, _ = TURNS["chat"](srv.base_url, name, ask, [BASH, READ], "none", False, max_tokens=24)
    assert own.startswith("```json") and '"name": "README.md"' in own, own
    _, calls = TURNS["chat"](srv.base_url, name, ask, [BASH, READ], "auto", False, max_tokens=96)
    assert [fn for fn, _ in calls] == ["Read"] and set(calls[0][1]) == {"file_path"}, calls
    ask = "Count the lines of code in src/ using wc."
    own, _ = TURNS["chat"](srv.base_url, name, ask, [BASH, READ], "none", False, max_tokens=96)
    _, calls = TURNS["chat"](srv.base_url, name, ask, [BASH, READ], "auto", False, max_tokens=96)
    wrote = _fenced_object(own)
    assert calls == [(wrote["name"], wrote["arguments"])] and wrote["name"] == "Bash", (own, calls)


def test_the_packaged_qwen_file_is_the_pinned_one():
    try:
        path = packaged_model_path("qwen2.5-coder-0.5b")
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    fields = GGUFFile(path).fields
    assert fields["general.name"] == "Qwen2.5 Coder 0.5B Instruct AWQ" and fields["general.architecture"] == "qwen2"
    assert fields["qwen2.context_length"] == 32768 and fields["general.file_type"] == 15  # Q4_K_M
    assert path.stat().st_size == 491_400_064
    assert detect_format(fields["tokenizer.chat_template"]) is HERMES  # its template writes <tool_call> tags
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    assert digest.hexdigest() == QWEN_CODER_PARTS.sha256
