"""OpenAI's Responses API (``/v1/responses``) through the official openai SDK: text, usage, stored
responses continued with ``previous_response_id`` (the history's KV from the prefix cache), a function
tool round trip, ``text.format`` json_schema, streaming (the SDK's typed events and its accumulator),
retrieve / delete, one-sentence refusals (image, file and audio parts among them) naming this API's
fields; the store's budget in the bytes it holds, and its put in constant time (issue 56, S1)."""

from __future__ import annotations

import json
import time
import tracemalloc

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


def test_a_call_of_a_tool_nested_in_a_namespace_names_its_namespace(server) -> None:
    """Codex nests tools in a ``namespace`` tool and routes a call by namespace and name: without the
    namespace on the item it answers "unsupported call"."""
    tools = [{"type": "namespace", "name": "weather_ns", "description": "Weather tools.",
              "tools": [{**WEATHER, "name": "get_forecast"}]}, WEATHER]
    for name, namespace in (("get_forecast", "weather_ns"), ("get_weather", None)):
        for stream in (False, True):
            body = {"model": MODEL, "input": "Weather?", "tools": tools, "temperature": 0, "max_output_tokens": 200,
                    "tool_choice": {"type": "function", "name": name}, "stream": stream}
            r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
            assert r.status_code == 200, r.text
            final = json.loads(r.text.rsplit("data: ", 1)[1]) if stream else r.json()
            output = (final["response"] if stream else final)["output"]
            assert [(o["type"], o["name"], o.get("namespace")) for o in output] == [("function_call", name, namespace)]


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
    for body, says in (({"input": [{"type": "reasoning", "summary": []}]}, "'reasoning'"),
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


def test_refusals_are_400s_naming_the_responses_fields(server) -> None:
    """Before: ``text.format`` as a string was a 500, and errors named the chat fields (messages, max_tokens)."""
    url = server.base_url + "/v1/responses"
    too_long = server.loop.engine.context_length
    for body, param, says in (
            ({"text": {"format": "json"}}, "text.format", "text.format must be an object"),
            ({"text": {"format": {"type": "json_schema", "name": "x", "schema": "{}"}}}, "text.format",
             "text.format.schema"),
            ({"max_output_tokens": too_long}, "input", f"max_output_tokens is {too_long}"),
            ({"input": []}, "input", "input must hold"),
            ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools", "tools[0].name must be"),
            ({"tools": [{**WEATHER, "parameters": {"type": "string"}}]}, "tools", "tools[0].parameters must describe"),
            ({"metadata": {"k": [{}] * 1000}}, "metadata", "at most 16 pairs"),
            ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 pairs")):
        r = httpx.post(url, json={"model": MODEL, "input": "hi", "max_output_tokens": 2, **body}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and says in error["message"], (body, error)
        assert not {"max_tokens", "messages", "response_format", "function"} & set(error["message"].replace(
            ".", " ").split()), error["message"]
        assert error["message"].endswith(".") and "\n" not in error["message"]


def test_the_store_counts_the_memory_it_holds() -> None:
    """Before: the budget counted JSON characters, and a response holding 200,000 empty objects in a
    stored field (0.6 MB of JSON) held 14 MB as Python objects: RSS ran ~20x past the budget."""
    from hicache.server.response_store import ResponseStore, Stored

    store = ResponseStore(size=100, max_bytes=64 << 20)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(4):
            response = {"id": f"r{i}", "text": {"format": {"type": "text"}, "k": [{} for _ in range(200_000)]}}
            store.put(f"r{i}", Stored([{"role": "user", "content": "hi é"}], list(range(1000)), response))
            del response
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    counted = store.stats()["stored_bytes"]
    assert 0.8 * counted <= held <= 1.2 * counted, (held, counted)
    stored = store.get("r3")
    assert stored is not None and len(stored.response["text"]["k"]) == 200_000 and stored.ids == list(range(1000))
    assert stored.messages == [{"role": "user", "content": "hi é"}]


def test_put_takes_constant_time() -> None:
    """Before: each put summed every entry's size (2.3 ms at 100,000 entries)."""
    from hicache.server.response_store import ResponseStore, Stored

    store = ResponseStore(size=10**6, max_bytes=1 << 40)
    item = Stored([{"role": "user", "content": "hi"}], [1, 2, 3], {"id": "r"})

    def put_s(first: int, count: int = 2000) -> float:
        t0 = time.perf_counter()
        for i in range(first, first + count):
            store.put(f"r{i}", item)
        return (time.perf_counter() - t0) / count

    small = min(put_s(0), put_s(2000))
    for i in range(4000, 100_000):
        store.put(f"r{i}", item)
    large = min(put_s(100_000), put_s(102_000))
    assert large < 3 * small + 10e-6, (small, large)
    assert store.delete("r5") and not store.delete("r5") and store.stats()["stored"] == 103_999


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
