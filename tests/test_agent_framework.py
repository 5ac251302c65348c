"""Agent frameworks as a user runs them against ``hicache serve``: LangChain's ``ChatOpenAI``
(langchain-openai, test extra) binds a local Python function as a tool, forces a call of it,
runs it and sends the result back (one tool loop end to end), and asks for a Pydantic model
through ``with_structured_output(method="json_schema")``; the OpenAI Agents SDK runs a tool agent
on its default model path (the Responses API). Loopback only: a fixture refuses
any other address, so nothing in the framework (tiktoken's encodings, LangSmith) goes online."""

from __future__ import annotations

import json
import socket
from typing import Literal

import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.engine]

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


@tool
def get_weather(city: Literal["Paris", "Tokyo", "Lima"], unit: Literal["celsius", "fahrenheit"]) -> str:
    """The weather in a city."""
    return json.dumps({"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit})


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)


@pytest.fixture
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any name lookup or connection to an address off this machine raises (the test fails)."""
    getaddrinfo, connect = socket.getaddrinfo, socket.socket.connect

    def local_getaddrinfo(host, *args, **kw):
        host = host.decode() if isinstance(host, bytes) else host
        assert host in LOOPBACK, f"name lookup of {host!r}: the test must stay on loopback"
        return getaddrinfo(host, *args, **kw)

    def local_connect(self, address):
        assert not isinstance(address, tuple) or address[0] in LOOPBACK, f"connect to {address}: not loopback"
        return connect(self, address)

    monkeypatch.setattr(socket, "getaddrinfo", local_getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", local_connect)
    for var in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGCHAIN_TRACING"):  # no trace uploads
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def llm(server, loopback_only):
    """``ChatOpenAI`` on the ``server`` fixture's tiny model: greedy, a dummy key, no retries,
    Chat Completions (the Responses path is the openai-agents test's, below)."""
    return langchain_openai.ChatOpenAI(model="tiny", base_url=server.base_url + "/v1", api_key="unused",
                                       temperature=0, max_tokens=150, max_retries=0, timeout=60,
                                       use_responses_api=False)


def test_a_forced_tool_call_runs_locally_and_its_result_goes_back(llm) -> None:
    # strict: the schema gets additionalProperties false (a random model would add keys otherwise)
    forced = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True, parallel_tool_calls=False)
    history = [HumanMessage("What is the weather in Paris? Answer in celsius.")]
    ai = forced.invoke(history)
    assert isinstance(ai, AIMessage) and ai.response_metadata["finish_reason"] == "tool_calls"
    assert not ai.invalid_tool_calls, ai.invalid_tool_calls
    [call] = ai.tool_calls  # parsed by LangChain from the server's tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(call["args"]) == {"city", "unit"}  # the schema's required keys, nothing else
    get_weather.args_schema.model_validate(call["args"])  # the Literal values: the schema's enums

    result = get_weather.invoke(call)  # a ToolCall in -> a ToolMessage out, as agents do
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    assert json.loads(result.content)["city"] == call["args"]["city"]
    history += [ai, result]
    reply = llm.bind_tools([get_weather]).invoke(history, max_tokens=8)  # tool_choice auto: may answer
    assert isinstance(reply, AIMessage) and reply.response_metadata["finish_reason"] in ("stop", "length",
                                                                                        "tool_calls")
    # the second request resent the first one's prompt and call: the server had them cached
    assert reply.usage_metadata["input_tokens"] > ai.usage_metadata["input_tokens"]
    assert reply.usage_metadata["input_token_details"]["cache_read"] > 0


def test_structured_output_returns_a_valid_pydantic_instance(llm) -> None:
    structured = llm.with_structured_output(Person, method="json_schema", include_raw=True)
    out = structured.invoke("Make up a person.", max_tokens=64)
    assert out["parsing_error"] is None, out["raw"].content
    person = out["parsed"]
    assert isinstance(person, Person)
    assert len(person.name) <= 12 and 0 <= person.age <= 150
    assert json.loads(out["raw"].content) == person.model_dump()  # the reply is exactly that object


def test_the_openai_agents_sdk_runs_a_tool_agent_on_its_default_responses_path(loopback_only) -> None:
    """openai-agents (test extra) with its default model path, the Responses API: the agent calls a
    local function, gets its result back, and finishes with a message (SmolLM2, greedy)."""
    agents = pytest.importorskip("agents")
    import asyncio

    from openai import AsyncOpenAI

    from live_server import serving

    calls: list[str] = []

    @agents.function_tool
    def city_weather(city: Literal["Paris", "Tokyo", "Lima"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"18 C and sunny in {city}"

    agents.set_tracing_disabled(True)
    with serving("smollm2", name="smollm2") as srv:
        client = AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        model = agents.OpenAIResponsesModel(model="smollm2", openai_client=client)
        agent = agents.Agent(name="weather", instructions="Answer with the weather.", model=model,
                             tools=[city_weather],
                             model_settings=agents.ModelSettings(tool_choice="required", max_tokens=80, temperature=0))
        result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    kinds = [type(item).__name__ for item in result.new_items]
    assert "Paris" in calls and "ToolCallOutputItem" in kinds  # (it may ask for other cities too)
    assert kinds[-1] == "MessageOutputItem" and isinstance(result.final_output, str)


def test_bind_tools_at_max_tokens_32_returns_the_call_finished_before_the_cut(loopback_only) -> None:
    """Before: LangChain's bind_tools at max_tokens=32 got no call at all (SmolLM2 starts a second call after the
    first and max_tokens cuts it). Now the finished call comes back, with finish_reason "length"."""
    from live_server import serving

    @tool
    def city_weather(city: str) -> str:
        """The weather in a city."""
        return "18 C"

    with serving("smollm2", name="smollm2") as srv:
        llm = langchain_openai.ChatOpenAI(model="smollm2", base_url=srv.base_url + "/v1", api_key="unused",
                                          temperature=0, max_tokens=32, max_retries=0, use_responses_api=False)
        ai = llm.bind_tools([city_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert ai.response_metadata["finish_reason"] == "length" and ai.usage_metadata["output_tokens"] == 32
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("city_weather", {"city": "Paris"})]
