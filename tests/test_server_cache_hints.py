"""Cache hints as clients send them (issue 60): Anthropic's ``cache_control`` through the anthropic SDK
(where each breakpoint ends in the prompt, the usage identity, the split by ttl, streamed usage),
OpenAI's ``prompt_cache_retention`` / ``prompt_cache_key`` through the openai SDK (Chat Completions,
Completions, Responses), SGLang's ``retention_seconds`` / ``priority`` on ``/generate``; every API
reports ``hicache_retention``; bad values are 400s naming the field."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from unittest.mock import ANY

import httpx
import pytest
from live_server import serving

from hicache.server import anthropic as messages_api
from hicache.cache_hints import RetentionHint
from hicache.server.cache_control import anthropic_usage, read_breakpoints
from hicache.server.prepare import render_chat
from hicache.server.tool_formats import choose_format

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.server

MODEL = "tiny"
GREEDY = {"temperature": 0.0}
CC = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}
WEATHER = {"name": "get_weather", "description": "The weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CLOCK = {"name": "get_time", "description": "The time.", "input_schema": {"type": "object"}}
SYSTEM = [{"type": "text", "text": "You answer briefly. " * 8}, {"type": "text", "text": "In French.", "cache_control": HOUR}]
CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris? " * 4, "cache_control": CC}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                      {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18 C, sunny"}]}]
DAY_S, HOUR_S = 86400, 3600


def _retained(outcome: dict, seconds: float) -> int:
    """The tokens a hint's outcome says were retained (on the device: this pool is far from full),
    for about ``seconds`` from now."""
    assert set(outcome) == {"retained_tokens", "tier", "until", "clipped"} and outcome["clipped"] is None, outcome
    assert outcome["tier"] == "device" and seconds - 600 < outcome["until"] - time.time() <= seconds, outcome
    return outcome["retained_tokens"]


@pytest.fixture(scope="module")
def server():
    with serving("random:tiny", name=MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="none")


@pytest.fixture(scope="module")
def gpt(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")


def _packaged_state(name: str) -> SimpleNamespace:
    """What rendering a chat needs of a server, for a packaged model's tokenizer (no weights loaded)."""
    from hicache.model.gguf_file import GGUFFile
    from hicache.model.gguf_tokenizer import tokenizer_from_gguf
    from hicache.model.packaged import packaged_model_path
    try:
        fields = GGUFFile(packaged_model_path(name)).fields
    except Exception as e:  # (a model file this machine does not have)
        pytest.skip(f"{name} is not installed: {e}")
    tok = tokenizer_from_gguf(fields, fields["general.architecture"])
    return SimpleNamespace(engine=SimpleNamespace(tokenizer=tok), call_format=choose_format("auto", tok.chat_template)[0],
                           opts=SimpleNamespace(tool_call_grammar="lazy"))


@pytest.mark.parametrize("model", ["smollm2", "qwen2.5-coder-0.5b"])
def test_each_breakpoint_ends_where_its_block_ends_in_the_templates_we_ship(model) -> None:
    st = _packaged_state(model)
    tok = st.engine.tokenizer
    body = messages_api.MessagesRequest.model_validate({
        "model": "m", "system": SYSTEM, "tools": [WEATHER, {**CLOCK, "cache_control": CC}], "messages": [
            {"role": "user", "content": "What is the weather in Paris?"}, {"role": "assistant", "content": [{**CONVERSATION[1]["content"][1], "cache_control": CC}]},
            {"role": "user", "content": [{**CONVERSATION[2]["content"][0], "cache_control": CC}]}]})
    text = render_chat(messages_api.as_chat(body), st)[2]
    ids, ends = tok.encode_with_ends(text)
    assert ids == tok.encode(text)
    hints = messages_api.request_hints(st, body, read_breakpoints(body), text, ends)
    # the tools' JSON (after the system text in these prompts), the system text, the call, the tool result's text
    ends = ['"parameters": {"type": "object"}}}\n', "In French.", "</tool_call>", "18 C, sunny"]
    assert len(hints) == 4 and {h.ttl for h in hints} == {"5m", "1h"}
    for h, end in zip(hints, ends):  # the last whole token within the block, to the character
        block_end = text.rindex(end) + len(end)
        within, one_more = (tok.decode(ids[:n], skip_special_tokens=False) for n in (h.tokens, h.tokens + 1))
        assert text.startswith(within) and len(within) <= block_end < len(one_more), (model, end, within[-40:])


@pytest.mark.parametrize("read, five, hour", [(0, 200, 100), (150, 150, 0), (400, 0, 0)])
def test_creation_splits_by_the_ttl_of_the_span_it_falls_in(read, five, hour) -> None:
    """An hour's breakpoint at token 100, then 5 minutes' at 300, in a 500-token prompt: what this request
    wrote is the part of (read, 300] it computed, each span under its own breakpoint's ttl."""
    hints = [RetentionHint(300, 300.0, ttl="5m"), RetentionHint(100, 3600.0, ttl="1h")]
    u = anthropic_usage(500, {"device": read, "host": 0, "storage": 0}, 7, hints)
    assert u["cache_creation"] == {"ephemeral_5m_input_tokens": five, "ephemeral_1h_input_tokens": hour}
    assert u["cache_creation_input_tokens"] == five + hour and u["cache_read_input_tokens"] == read
    assert u["input_tokens"] + read + five + hour == 500 and u["output_tokens"] == 7


def _identity(u) -> None:
    assert u.input_tokens >= 0 and u.cache_creation_input_tokens >= 0
    split = u.cache_creation.ephemeral_5m_input_tokens + u.cache_creation.ephemeral_1h_input_tokens
    assert split == u.cache_creation_input_tokens


def test_cache_control_usage_and_a_second_request_reading_what_the_first_wrote(claude, gpt) -> None:
    kw = dict(model=MODEL, max_tokens=4, system=SYSTEM, tools=[WEATHER, {**CLOCK, "cache_control": CC}],
              messages=CONVERSATION, extra_body=GREEDY)
    prompt = claude.messages.count_tokens(model=MODEL, system=SYSTEM, tools=kw["tools"], messages=CONVERSATION).input_tokens
    first, second = claude.messages.create(**kw), claude.messages.create(**kw)
    for u in (first.usage, second.usage):
        _identity(u)
        assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == prompt
        # the longest prefix a breakpoint asked (whole pages), kept for the longest ttl asked
        retained = _retained(u.model_extra["hicache_retention"], HOUR_S)
        assert 0 < retained <= u.cache_read_input_tokens + u.cache_creation_input_tokens
    u1, u2 = first.usage, second.usage
    assert u1.cache_read_input_tokens == 0 and u1.cache_creation_input_tokens > 0
    # the system prompt's breakpoint is an hour's (the tools', after it in the prompt, and the message's are 5m)
    assert u1.cache_creation.ephemeral_1h_input_tokens > 0 and u1.cache_creation.ephemeral_5m_input_tokens > 0
    assert u2.cache_read_input_tokens > 0 and u2.cache_creation_input_tokens == 0
    assert u2.cache_creation.ephemeral_5m_input_tokens == u2.cache_creation.ephemeral_1h_input_tokens == 0
    plain = claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi there"}],
                                   extra_body=GREEDY).usage
    assert plain.cache_creation_input_tokens == 0 and "hicache_retention" not in plain.model_extra


def test_a_streamed_message_reports_the_same_usage(claude) -> None:
    kw = dict(model=MODEL, max_tokens=4, system=SYSTEM, messages=CONVERSATION, extra_body=GREEDY)
    whole = claude.messages.create(**kw).usage  # (now cached: the stream reads what this wrote)
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
    start = next(e for e in events if e.type == "message_start").message.usage
    final = next(e for e in events if e.type == "message_delta").usage
    for u in (start, final):
        assert u.cache_read_input_tokens > 0 and u.cache_creation_input_tokens == 0
        assert u.input_tokens + u.cache_read_input_tokens == whole.input_tokens + whole.cache_read_input_tokens \
            + whole.cache_creation_input_tokens
    assert _retained(final.model_extra["hicache_retention"], HOUR_S) > 0


def test_a_top_level_cache_control_marks_the_last_block(server) -> None:
    """Anthropic's automatic caching: the request's own cache_control is a breakpoint on the last
    message's last block (here its whole text: the prompt up to the assistant's turn)."""
    body = {"model": MODEL, "max_tokens": 2, "cache_control": HOUR, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Cache all of me, please. " * 6}]}
    u = httpx.post(server.base_url + "/v1/messages", json=body).json()["usage"]
    assert u["cache_read_input_tokens"] == 0 and u["cache_creation"]["ephemeral_5m_input_tokens"] == 0
    assert 0 < u["cache_creation_input_tokens"] == u["cache_creation"]["ephemeral_1h_input_tokens"]
    assert u["input_tokens"] < 16  # (only the template's closing and the assistant's opening: past the breakpoint)
    assert _retained(u["hicache_retention"], HOUR_S) > 0


@pytest.mark.parametrize("system, says", [
    ([{"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": "2h"}}], "system[0].cache_control.ttl"),
    ([{"type": "text", "text": "a", "cache_control": {"type": "persistent"}}], "system[0].cache_control.type"),
    ([{"type": "text", "text": str(i), "cache_control": CC} for i in range(5)], "A maximum of 4 blocks with cache_control"),
])
def test_bad_breakpoints_are_refused_naming_the_field(server, system, says) -> None:
    r = httpx.post(server.base_url + "/v1/messages", json={"model": MODEL, "max_tokens": 2, "system": system,
                                                           "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and says in r.json()["error"]["message"], r.text


def test_prompt_cache_retention_and_key_on_chat_completions_and_completions(server, gpt) -> None:
    chat = gpt.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Keep me"}],
                                       prompt_cache_retention="24h", prompt_cache_key="agent-1", temperature=0)
    # the prompt and the reply, kept a day (whole pages of them)
    usage = chat.usage.model_extra
    assert 0 < _retained(usage["hicache_retention"], DAY_S) <= chat.usage.total_tokens
    text = gpt.completions.create(model=MODEL, prompt="Keep me too. " * 10, max_tokens=2,
                                  extra_body={"prompt_cache_retention": "24h", "prompt_cache_key": "agent-1"})
    assert _retained(text.usage.model_extra["hicache_retention"], DAY_S) > 0
    stream = gpt.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Keep me"}],
                                         prompt_cache_retention="24h", stream=True, stream_options={"include_usage": True},
                                         temperature=0)
    last = list(stream)[-1]
    assert last.usage.model_extra["hicache_retention"] == usage["hicache_retention"] | {"until": ANY}
    plain = gpt.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
                                        prompt_cache_retention="in_memory")
    assert "hicache_retention" not in plain.usage.model_extra
    keys = httpx.get(server.base_url + "/stats").json()["prompt_cache_keys"]
    assert keys["agent-1"]["requests"] == 2  # (the stream carried no key)
    assert keys["agent-1"]["prompt_tokens"] == chat.usage.prompt_tokens + text.usage.prompt_tokens


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt_cache_retention": "7d"},
     "prompt_cache_retention"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt_cache_key": "k" * 1025},
     "prompt_cache_key"),
    ("/v1/completions", {"prompt": "Hi", "prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ("/v1/responses", {"input": "Hi", "prompt_cache_retention": "1h"}, "prompt_cache_retention"),
    ("/generate", {"text": "Hi", "retention_seconds": -1.0}, "retention_seconds"),
])
def test_bad_hints_are_refused_naming_the_field(server, path, body, field) -> None:
    r = httpx.post(server.base_url + path, json={"model": MODEL, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == field and field in r.json()["error"]["message"], r.text


def _released(server) -> int:
    return httpx.get(server.base_url + "/stats").json()["retention"]["released_tokens"]


def test_responses_keep_a_stored_conversation_and_delete_releases_it(server, gpt) -> None:
    kept = gpt.responses.create(model=MODEL, input="Remember this", max_output_tokens=3, prompt_cache_key="agent-2",
                                prompt_cache_retention="24h")
    assert kept.prompt_cache_key == "agent-2" and kept.prompt_cache_retention == "24h"
    retained = _retained(kept.usage.model_extra["hicache_retention"], DAY_S)
    events = list(gpt.responses.create(model=MODEL, input="Also keep this", max_output_tokens=3, stream=True))
    streamed = events[-1].response  # (response.incomplete: cut at max_output_tokens)
    assert _retained(streamed.usage.model_extra["hicache_retention"], DAY_S) > 0  # (stored: kept a day)
    gpt.responses.delete(streamed.id)
    unstored = gpt.responses.create(model=MODEL, input="Forget this", max_output_tokens=2, store=False)
    assert "hicache_retention" not in unstored.usage.model_extra  # (no hint: not stored, in memory)
    assert httpx.get(server.base_url + "/stats").json()["prompt_cache_keys"]["agent-2"]["requests"] == 1
    before = _released(server)
    assert gpt.responses.delete(kept.id) is None
    assert _released(server) - before == retained  # the conversation's pages are plain LRU again
    assert httpx.delete(f"{server.base_url}/v1/responses/{kept.id}").status_code == 404


def test_deleting_a_turn_keeps_what_another_stored_turn_of_the_conversation_retains(server, gpt) -> None:
    # greedy: a sampled reply of the random model may not render back as the ids it was (the store's chain
    # check compares ids), which made this test fail once in a while
    first = gpt.responses.create(model=MODEL, input="A long conversation. " * 8, max_output_tokens=3, temperature=0)
    second = gpt.responses.create(model=MODEL, input="Its next turn", max_output_tokens=3, previous_response_id=first.id,
                                  temperature=0)
    third = gpt.responses.create(model=MODEL, input="And the last", max_output_tokens=3, previous_response_id=second.id,
                                 temperature=0)
    before = _released(server)
    gpt.responses.delete(second.id)  # the first and the third turns still hold its history
    gpt.responses.delete(first.id)  # the third begins with it
    assert _released(server) == before
    gpt.responses.delete(third.id)
    assert _released(server) - before == _retained(third.usage.model_extra["hicache_retention"], DAY_S)


def test_a_response_the_store_drops_releases_its_retention() -> None:
    with serving("random:tiny", name=MODEL, server={"responses_store_size": 1}) as small:
        client = openai.OpenAI(base_url=small.base_url + "/v1", api_key="none")
        dropped = client.responses.create(model=MODEL, input="Soon forgotten. " * 8, max_output_tokens=2)
        assert _released(small) == 0
        client.responses.create(model=MODEL, input="Another conversation", max_output_tokens=2)  # the store holds one
        assert _released(small) == _retained(dropped.usage.model_extra["hicache_retention"], DAY_S)


def test_generate_takes_sglangs_retention_seconds_and_priority(server) -> None:
    r = httpx.post(server.base_url + "/generate", json={"text": "Keep me. " * 10, "retention_seconds": 60, "priority": 5,
                                                        "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    assert _retained(r.json()["meta_info"]["hicache_retention"], 60) > 0
    with httpx.stream("POST", server.base_url + "/generate", json={
            "text": "Keep me. " * 10, "retention_seconds": 60, "stream": True, "sampling_params": {"max_new_tokens": 2}}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert _retained(chunks[-1]["meta_info"]["hicache_retention"], 60) > 0  # (the last chunk: the whole answer)
    plain = httpx.post(server.base_url + "/generate", json={"text": "Hi", "priority": 5,
                                                            "sampling_params": {"max_new_tokens": 2}}).json()
    assert "hicache_retention" not in plain["meta_info"]  # (a priority alone asks nothing of the cache)
