"""OpenAI's Responses API (``/v1/responses``) through the official openai SDK: text, usage, stored
responses continued with ``previous_response_id`` (the history's KV from the prefix cache), a function
tool round trip, ``text.format`` json_schema, streaming (the SDK's typed events and its accumulator),
retrieve / delete, one-sentence refusals (image, file and audio parts among them)."""

from __future__ import annotations

import json

import httpx
import pytest

from live_server import serving

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.server

MODEL = "tiny"
PAGE = 16
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}  # (a random model is short)


@pytest.fixture(scope="module")
def server():
    with serving("random:tiny", name=MODEL, page_size=PAGE) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")


def test_text_store_continue_retrieve_delete(client, server) -> None:
    first = client.responses.create(model=MODEL, input="Tell me about caches. " * 8, max_output_tokens=12,
                                    temperature=0)
    assert first.object == "response" and first.status == "incomplete"  # max_output_tokens reached
    assert first.incomplete_details.reason == "max_output_tokens" and first.usage.output_tokens == 12
    assert isinstance(first.output_text, str) and first.output[0].type == "message"
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="And more?",
                                      max_output_tokens=4, temperature=0)
    # the continued prompt is the stored ids (prompt + reply, as the model saw and wrote them) plus the new
    # turn: the whole history's KV comes from the cache, up to its last partial page
    history = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > history
    assert second.usage.input_tokens_details.cached_tokens > history - PAGE
    assert second.previous_response_id == first.id
    held = httpx.get(server.base_url + "/stats").json()["responses"]  # what continued turns computed
    assert held["continued"] >= 1 and held["continued_computed_tokens"] < held["continued_prompt_tokens"]
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id=first.id, input="again?")


def test_a_function_tool_round_trip(client) -> None:
    called = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                     tool_choice="required", parallel_tool_calls=False, temperature=0,
                                     max_output_tokens=200)
    assert called.status == "completed" and [o.type for o in called.output] == ["function_call"]
    call = called.output[0]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    assert call.call_id.startswith("call_")
    answered = client.responses.create(model=MODEL, previous_response_id=called.id, tools=[WEATHER], temperature=0,
                                       max_output_tokens=6, input=[{"type": "function_call_output",
                                                                    "call_id": call.call_id, "output": "18 C"}])
    assert answered.usage.input_tokens_details.cached_tokens > 0 and answered.output[0].type == "message"
    named = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200)
    assert [o.type for o in named.output] == ["function_call"]  # a named function: exactly one call


def test_json_schema_output(client) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Yes or no?", temperature=1.0, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "verdict", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed" and json.loads(r.output_text)["answer"] in ("yes", "no")


def test_streams_give_the_typed_events_and_the_same_response(client) -> None:
    kw = dict(model=MODEL, input="Stream this, please.", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    with client.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER], max_output_tokens=200,
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0) as stream:
        final = stream.get_final_response()
    assert [o.type for o in final.output] == ["function_call"] and set(json.loads(final.output[0].arguments)) == {"city"}


def test_what_is_not_served_is_one_sentence(server) -> None:
    url = server.base_url + "/v1/responses"
    for body, says in (({"tools": [{"type": "web_search"}]}, "built-in tools"),
                       ({"input": [{"type": "reasoning", "summary": []}]}, "'reasoning'"),
                       ({"text": {"format": {"type": "grammar"}}}, "text.format type 'grammar'")):
        r = httpx.post(url, json={"model": MODEL, "input": "hi", **body})
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    # fields SDKs send at neutral values are accepted
    ok = httpx.post(url, json={"model": MODEL, "input": "hi", "max_output_tokens": 2, "include": [],
                               "truncation": "disabled", "metadata": {"k": "v"}, "reasoning": {}, "user": "u"})
    assert ok.status_code == 200 and ok.json()["metadata"] == {"k": "v"}


def test_the_store_is_bounded_by_count_and_bytes() -> None:
    from hicache.server.response_store import ResponseStore, Stored

    def stored(n: int) -> Stored:
        return Stored([{"role": "user", "content": "x" * n}], list(range(n)), {"id": "r"})

    by_count = ResponseStore(size=2)
    for rid in "abc":
        by_count.put(rid, stored(10))
    assert by_count.get("a") is None and by_count.get("b") is not None and by_count.stats()["stored"] == 2
    by_bytes = ResponseStore(size=100, max_bytes=stored(1000).nbytes() * 2)
    for rid in "abc":
        by_bytes.put(rid, stored(1000))
    assert by_bytes.get("a") is None and by_bytes.stats()["stored_bytes"] <= by_bytes.max_bytes
    by_bytes.put("huge", stored(100_000))  # larger than the bound alone: not kept, and the others stay
    assert by_bytes.get("huge") is None and by_bytes.get("b") is not None and by_bytes.get("c") is not None


PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


@pytest.mark.parametrize("part, says", [
    ({"type": "input_image", "image_url": PNG, "detail": "auto"}, "image input is not supported"),
    ({"type": "input_file", "filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0="},
     "file input is not supported"),
    ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "audio input is not supported"),
])
def test_image_file_and_audio_parts_are_refused_in_a_sentence(client, part, says) -> None:
    inputs = ([{"role": "user", "content": [{"type": "input_text", "text": "What is this?"}, part]}],
              [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "call_1", "output": [part]}])  # a tool's output too
    for input in inputs:
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input=input, max_output_tokens=4)
        error = refused.value.body  # the SDK's body: OpenAI's error object
        assert refused.value.status_code == 400 and error["type"] == "invalid_request_error"
        assert error["message"].startswith(says + ": this server runs text-only models")
        assert error["message"].count(".") == 1 and error["message"].endswith(".")  # one sentence
