"""Anthropic's Messages API (``/v1/messages``) through the official anthropic SDK: text, the system
prompt, usage with the prefix cache's reads, forced and named tool calls as ``tool_use`` blocks, a
tool round trip with ``tool_result``, stop sequences, ``max_tokens``, streaming (the SDK's event
accumulator), ``count_tokens``, the key as ``x-api-key``, image and document blocks refused in a
sentence of their own."""

from __future__ import annotations

import httpx
import pytest

from live_server import serving

anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.server

MODEL = "tiny"
GREEDY = {"temperature": 0.0}  # (the SDK no longer sends temperature itself)
WEATHER = {"name": "get_weather", "description": "The weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}  # (a random model is short)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    with serving("random:tiny", name=MODEL, server={"api_key": "secret"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="secret")


def test_text_usage_and_the_cache(client) -> None:
    kw = dict(model=MODEL, max_tokens=12, system="Answer briefly. " * 20, messages=ASK, extra_body=GREEDY)
    first, second = client.messages.create(**kw), client.messages.create(**kw)
    assert first.type == "message" and first.role == "assistant" and first.content[0].type == "text"
    assert second.content[0].text == first.content[0].text and first.stop_reason in ("end_turn", "max_tokens")
    u1, u2 = first.usage, second.usage
    assert u1.cache_read_input_tokens == 0 and u2.cache_read_input_tokens > 0 and u2.cache_creation_input_tokens == 0
    assert u2.input_tokens + u2.cache_read_input_tokens == u1.input_tokens  # the same prompt, partly from the cache
    assert u2.model_extra["hicache_cached_tokens"]["device"] == u2.cache_read_input_tokens
    assert client.messages.count_tokens(model=MODEL, system=kw["system"], messages=ASK).input_tokens == u1.input_tokens


def test_forced_and_named_tool_calls_and_a_round_trip(client) -> None:
    forced = client.messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER],
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert forced.stop_reason == "tool_use" and [b.type for b in forced.content] == ["tool_use"]
    call = forced.content[0]
    assert call.name == "get_weather" and set(call.input) == {"city"} and call.id.startswith("toolu_")
    named = client.messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert [b.type for b in named.content] == ["tool_use"]  # a named tool: exactly one call
    after = client.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], extra_body=GREEDY, messages=[
        *ASK, {"role": "assistant", "content": forced.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}]}])
    assert after.usage.cache_read_input_tokens > 0  # the conversation so far, from the cache
    cut = client.messages.create(model=MODEL, max_tokens=3, messages=ASK, tools=[WEATHER],
                                 tool_choice={"type": "any"}, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.content == []  # the unfinished call is dropped, not text


def test_stop_sequences_and_max_tokens(client) -> None:
    plain = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY)
    assert plain.stop_reason == "max_tokens" and plain.usage.output_tokens == 16
    text = plain.content[0].text
    stop = text[len(text) // 2:][:3]
    cut = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, stop_sequences=[stop], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_streams_accumulate_to_the_same_message(client) -> None:
    kw = dict(model=MODEL, max_tokens=20, messages=ASK, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    with client.messages.stream(model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER], extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert set(final.content[0].input) == {"city"}


def test_the_key_and_bad_requests(server) -> None:
    url = server.base_url + "/v1/messages"
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK}
    assert httpx.post(url, json=body).status_code == 401
    assert httpx.post(url, json=body, headers={"x-api-key": "wrong"}).status_code == 401
    ok = httpx.post(url, json=body, headers={"x-api-key": "secret", "anthropic-version": "2023-06-01"})
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    bad = httpx.post(url, json={**body, "tool_choice": {"type": "sometimes"}}, headers={"x-api-key": "secret"})
    assert bad.status_code == 400 and "tool_choice" in bad.json()["error"]["message"]
    assert bad.json()["type"] == "error" and bad.json()["error"]["type"] == "invalid_request_error"  # Anthropic's shape
    assert ok.json()["usage"]["output_tokens"] <= 4


def test_count_tokens_counts_a_prompt_that_leaves_no_room_for_the_default_max_tokens(server) -> None:
    """Before: count_tokens added the default max_tokens (1024) and refused a prompt of 7,431 tokens."""
    headers = {"x-api-key": "secret"}
    length = server.loop.engine.context_length
    counted = httpx.post(server.base_url + "/v1/messages/count_tokens", headers=headers, timeout=60,
                         json={"model": MODEL, "messages": [{"role": "user", "content": "a" * (length - 600)}]})
    assert counted.status_code == 200, counted.text
    assert length - 1024 < counted.json()["input_tokens"] < length
    schema = {"name": "f", "input_schema": {"type": "string"}}  # a forced call could only be raw text
    refused = httpx.post(server.base_url + "/v1/messages", headers=headers, timeout=60,
                         json={"model": MODEL, "max_tokens": 40, "messages": ASK, "tools": [schema],
                               "tool_choice": {"type": "any"}})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["message"].startswith("tools[0].input_schema must describe an object")


PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
DOCUMENT = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "An invoice."}}


@pytest.mark.parametrize("content, says", [
    ([{"type": "text", "text": "What is in this picture?"}, IMAGE], "image input is not supported"),
    ([DOCUMENT, {"type": "text", "text": "Summarise it."}], "document input is not supported"),
    ([{"type": "tool_result", "tool_use_id": "toolu_1", "content": [IMAGE]}], "image input is not supported"),
])
def test_images_and_documents_are_refused_in_a_sentence(client, content, says) -> None:
    messages = [{"role": "user", "content": content}]
    for call in (lambda: client.messages.create(model=MODEL, max_tokens=4, messages=messages),
                 lambda: client.messages.count_tokens(model=MODEL, messages=messages)):
        with pytest.raises(anthropic.BadRequestError) as refused:
            call()
        assert refused.value.status_code == 400
        error = refused.value.body["error"]  # Anthropic's shape: {"type": "error", "error": {"type", "message"}}
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith(says + ": this server runs text-only models")
        assert error["message"].count(".") == 1 and error["message"].endswith(".")  # one sentence


def test_refusals_are_counted_in_the_metrics(server, client) -> None:
    def rejected() -> float:
        lines = httpx.get(f"{server.base_url}/metrics", timeout=30).text.splitlines()
        return sum(float(line.split()[-1]) for line in lines if line.startswith("hicache_rejected_requests_total{"))

    before = rejected()
    for call in (lambda: client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [IMAGE]}]),
                 lambda: client.messages.count_tokens(model="no-such-model", messages=ASK)):
        with pytest.raises(anthropic.APIStatusError):
            call()
    assert rejected() == before + 2  # as on the OpenAI routes (tests/test_server_hostile.py)
