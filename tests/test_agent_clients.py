"""Coding agents' own requests, replayed: the first two turns Codex CLI (``/v1/responses``) and
Claude Code (``/v1/messages``) sent to a capture server (``tests/data/agents/``, README there),
through plain HTTP against ``random:tiny``. What they need: built-in tools dropped and named in
``X-Hicache-Dropped-Tools``, a namespace's tools flattened in, system messages mid-conversation,
``HEAD /`` without a key, the fields they send accepted, Anthropic usage split into computed and
cached input from ``message_start`` on; replies that default to the rest of the context;
keep-alives on every stream while a prompt prefills."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import pytest

from hicache import Engine, SamplingParams
from hicache.frontend.loop import EngineLoop, Update
from hicache.server import keepalive
from hicache.server.builtin_tools import dropped_header, note_dropped, split_responses_tools
from hicache.server.system_turns import place_system_messages, takes_system_turns
from live_server import serving

pytestmark = pytest.mark.server

AGENTS = Path(__file__).parent / "data" / "agents"
KEY = "x"  # what the captures authenticate with (Bearer for Codex, x-api-key for Claude Code)
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}  # a call's arguments (a random model's strings are short under maxLength)
CONTEXT = 16384  # a random model's context that holds the captured prompts, shortened (:func:`captured`)


def captured(name: str, text_chars: int = 16) -> dict[str, Any]:
    """The captured request ``name``, its texts (system prompts, messages, tool outputs) cut to
    ``text_chars`` characters and the tools' descriptions left out: the same fields, tools and
    turns, in a prompt a random model's byte tokenizer prefills in seconds."""
    def shorten(x: Any, key: str = "") -> Any:
        if isinstance(x, str):
            return x[:text_chars] if key in ("text", "content", "output", "input", "instructions") else x
        if isinstance(x, list):
            return [shorten(v, key) for v in x]
        if isinstance(x, dict):
            return {k: shorten(v, k) for k, v in x.items() if not (k == "description" and isinstance(v, str))}
        return x
    record = json.loads((AGENTS / f"{name}.json").read_text())
    return {**record, "body": shorten(record["body"])}


def sse_events(response: httpx.Response) -> Iterator[tuple[str, Any]]:
    """``(kind, data)`` per server-sent event: ``("comment", text)`` for a comment line, the
    ``event:`` name (or "message") with its JSON data otherwise."""
    kind = "message"
    for line in response.iter_lines():
        if line.startswith(":"):
            yield "comment", line[1:].strip()
        elif line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            yield kind, (data if data == "[DONE]" else json.loads(data))
            kind = "message"


@pytest.fixture(scope="module")
def server():
    # Codex never sends a max: --default-max-tokens keeps these replies short (the default itself: below)
    with serving(f'random:{{"max_position_embeddings": {CONTEXT}}}', name="tiny",
                 server={"api_key": KEY, "default_max_tokens": 8}) as srv:
        yield srv


def replay(server, name: str, **changes: Any) -> tuple[httpx.Response, list[tuple[str, Any]]]:
    """POST capture ``name`` (its path and headers, the body with ``changes``); the response and its events."""
    record = captured(name)
    body = {**record["body"], "model": "tiny", **changes}
    with httpx.stream("POST", server.base_url + record["path"], json=body, timeout=120,
                      headers={**record["headers"], "authorization": f"Bearer {KEY}"}
                      if "codex" in name else {**record["headers"], "x-api-key": KEY}) as r:
        r.read() if r.status_code != 200 else None
        return r, (list(sse_events(r)) if r.status_code == 200 and body.get("stream") else [])


def test_codex_turns_are_served_without_its_builtin_tools(server, caplog) -> None:
    for name in ("codex_turn1", "codex_turn2"):  # turn 2 carries a function_call and its output
        with caplog.at_level(logging.INFO, "hicache.server"):
            r, events = replay(server, name)
        assert r.status_code == 200, r.text
        assert r.headers["x-hicache-dropped-tools"] == "web_search"  # the namespace's tools are flattened in
        kinds = [k for k, _ in events if k != "comment"]
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
        final = events[-1][1]["response"]
        assert final["usage"]["output_tokens"] <= 8 and final["store"] is False
    # a tool of the namespace is a tool the model may call: forcing it is not "not in tools"
    r, events = replay(server, "codex_turn1", tool_choice={"type": "function", "name": "spawn_agent"},
                       max_output_tokens=3)
    assert r.status_code == 200 and events[-1][0] == "response.incomplete", r.text


def test_claude_codes_attribution_line_leaves_the_prefix_cache_alone(server) -> None:
    """Claude Code's first system block carries values derived from each request (``cc_version=<v>.<3 hex>``,
    ``cch=``): two subagents' requests, alike but for it and their question, share their whole system prompt."""
    system = "You are an agent for a coding tool. Read files, run commands, report back. " * 6

    def ask(suffix: str, question: str) -> dict[str, Any]:
        body = {"model": "tiny", "max_tokens": 2, "temperature": 0.0, "messages": [{"role": "user", "content": question}],
                "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{suffix}; "
                                                    "cc_entrypoint=sdk-cli; cch=0a1b2;"},
                           {"type": "text", "text": system}]}
        r = httpx.post(server.base_url + "/v1/messages", json=body, headers={"x-api-key": KEY})
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    first, second = ask("322", "List the files."), ask("9b1", "Which tests fail?")
    assert first["cache_read_input_tokens"] < 64  # (at most a page of the template's opening, shared with others)
    assert second["cache_read_input_tokens"] >= len(system) - 32  # (a byte per token; up to the page it ends in)


def test_dropped_tools_are_logged_once(server, caplog) -> None:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2,
            "tools": [{"type": "hicache_test_builtin"}, {"type": "hicache_test_builtin"}, {"type": "file_search"}]}
    with caplog.at_level(logging.INFO, "hicache.server.builtin_tools"):
        for _ in range(2):
            r = httpx.post(server.base_url + "/v1/responses", json=body, headers={"authorization": f"Bearer {KEY}"})
            assert r.status_code == 200 and r.headers["x-hicache-dropped-tools"] == "hicache_test_builtin, file_search"
    assert sum("hicache_test_builtin" in m for m in caplog.messages) == 1
    chat = httpx.post(server.base_url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                            "tools": [{"type": "custom", "custom": {"name": "apply_patch"}}]})
    assert chat.status_code == 200 and chat.headers["x-hicache-dropped-tools"] == "custom"


def test_claude_code_turns_are_served_and_report_cache_reads_from_the_start(server) -> None:
    starts = []
    for name in ("claude_code_turn1", "claude_code_turn2"):  # a system message after the first user turn
        r, events = replay(server, name, max_tokens=8, temperature=0.0)
        assert r.status_code == 200, r.text
        kinds = [k for k, _ in events if k != "ping"]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        usage = events[[k for k, _ in events].index("message_start")][1]["message"]["usage"]
        final = [d for k, d in events if k == "message_delta"][0]["usage"]
        counts = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        assert {k: usage[k] for k in counts} == {k: final[k] for k in counts}
        starts.append(usage)
    first, second = starts
    # Claude Code's cache_control breakpoints (system, last messages): turn 1 writes its prompt there
    assert first["cache_read_input_tokens"] == 0 and first["cache_creation_input_tokens"] > 0
    # turn 2 resends turn 1's system prompt, tools and first messages: read from the cache, not computed
    assert second["cache_read_input_tokens"] >= first["input_tokens"] + first["cache_creation_input_tokens"] - 64
    assert second["hicache_cached_tokens"]["device"] == second["cache_read_input_tokens"]
    # (Claude Code's max_tokens 64000, more than a context holds, is served: test_replies_default_...)


def test_the_agents_tools_make_the_grammar_of_a_call_the_model_begins(server, caplog) -> None:
    """Claude Code's 24 tools and Codex's (its namespace flattened in) compile into the lazy grammar
    of a call under tool_choice auto: schema keywords the grammar engine lacks (Claude Code's
    ``propertyNames``) go unenforced rather than the grammar refused (it then would be dropped)."""
    with caplog.at_level(logging.WARNING, "hicache.server"):
        for name, cap in (("claude_code_turn1", "max_tokens"), ("codex_turn1", "max_output_tokens")):
            r, _ = replay(server, name, **{cap: 2})
            assert r.status_code == 200, r.text
    assert not [m for m in caplog.messages if "without their grammar" in m], caplog.messages
    stats = httpx.get(server.base_url + "/stats", headers={"authorization": f"Bearer {KEY}"}).json()
    assert stats["grammar"]["templates"] >= 2 and stats["grammar"]["failed_requests"] == 0, stats["grammar"]


def test_head_root_answers_without_a_key(server) -> None:
    assert httpx.head(server.base_url + "/").status_code == 200
    assert httpx.get(server.base_url + "/v1/models").status_code == 401  # the rest still wants the key


@pytest.fixture(scope="module")
def small():
    """A context of 192 tokens: a reply that runs to its end is quick."""
    with serving('random:{"max_position_embeddings": 192}', name="tiny") as srv:
        yield srv


def test_replies_default_to_the_rest_of_the_context(small) -> None:
    url, opts = small.base_url, small.app.state.hicache.opts
    ask = [{"role": "user", "content": "Write as much as you can."}]
    chat = httpx.post(url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": ask, "ignore_eos": True}).json()
    assert chat["choices"][0]["finish_reason"] == "length"
    assert chat["usage"]["prompt_tokens"] + chat["usage"]["completion_tokens"] == 192  # was 128 at most
    resp = httpx.post(url + "/v1/responses", timeout=60, json={"model": "tiny", "input": ask[0]["content"]}).json()
    assert resp["status"] in ("completed", "incomplete")
    assert resp["status"] == "completed" or resp["usage"]["total_tokens"] == 192
    opts.default_max_tokens = 5  # --default-max-tokens
    try:
        capped = httpx.post(url + "/v1/chat/completions", timeout=60,
                            json={"model": "tiny", "messages": ask, "ignore_eos": True}).json()
        assert capped["usage"]["completion_tokens"] == 5
        asked = httpx.post(url + "/v1/chat/completions", timeout=60,  # an explicit max is the client's
                           json={"model": "tiny", "messages": ask, "ignore_eos": True, "max_tokens": 7}).json()
        assert asked["usage"]["completion_tokens"] == 7
    finally:
        opts.default_max_tokens = None
    completion = httpx.post(url + "/v1/completions", timeout=60,
                            json={"model": "tiny", "prompt": "Once", "ignore_eos": True}).json()
    assert completion["usage"]["completion_tokens"] == 16  # OpenAI's legacy default
    generate = httpx.post(url + "/generate", timeout=60,
                          json={"text": "Once", "sampling_params": {"ignore_eos": True}}).json()
    assert generate["meta_info"]["completion_tokens"] == 128  # SGLang's
    long_prompt = "word " * 30
    messages = httpx.post(url + "/v1/messages", timeout=60, json={
        "model": "tiny", "max_tokens": 64000, "messages": [{"role": "user", "content": long_prompt}]}).json()
    assert messages["stop_reason"] in ("max_tokens", "end_turn"), messages
    assert messages["usage"]["input_tokens"] + messages["usage"]["output_tokens"] <= 192


def test_system_messages_mid_conversation(small) -> None:
    url = small.base_url + "/v1/messages/count_tokens"
    turns = [{"role": "user", "content": "Fix the bug."}, {"role": "assistant", "content": "Which one?"},
             {"role": "user", "content": "The one in calc.py."}]
    mid = [*turns[:2], {"role": "system", "content": "The user's repository is calc."}, turns[2]]
    plain = httpx.post(url, json={"model": "tiny", "system": "Be brief.", "messages": turns})
    with_system = httpx.post(url, json={"model": "tiny", "system": "Be brief.", "messages": mid})
    assert plain.status_code == 200 and with_system.status_code == 200, with_system.text  # was 400 (messages.2.role)
    assert with_system.json()["input_tokens"] > plain.json()["input_tokens"] + len("The user's repository is calc.")
    tok = small.loop.engine.tokenizer  # ChatML: a system turn where it was sent
    chat = [{"role": m["role"], "content": m["content"]} for m in mid]
    assert takes_system_turns(tok) and place_system_messages(chat, tok) == chat


def test_a_template_without_mid_conversation_system_turns_gets_them_folded() -> None:
    with serving("random:tiny", name="tiny", chat_template="gemma") as srv:
        tok = srv.loop.engine.tokenizer
        assert not takes_system_turns(tok)  # the built-in gemma template keeps one system message of two
        chat = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
                {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
                {"role": "system", "content": "C"}, {"role": "user", "content": "u2"},
                {"role": "system", "content": "D"}]
        assert place_system_messages(chat, tok) == [
            {"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "C\n\nu2\n\nD"}]
        r = httpx.post(srv.base_url + "/v1/messages", json={"model": "tiny", "max_tokens": 2, "system": "S",
                                                             "messages": [{"role": "user", "content": "hi"},
                                                                          {"role": "system", "content": "mid"},
                                                                          {"role": "user", "content": "go"}]})
        assert r.status_code == 200, r.text


def _slowed(server, seconds: float):
    """Every engine step of ``server`` takes ``seconds`` more (a slow prefill, as a CPU gives a long prompt)."""
    sched = server.loop.engine.scheduler
    step = sched.step

    def slow_step():
        time.sleep(seconds)
        return step()
    return sched, slow_step


@pytest.mark.parametrize("path, body, ping", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True},
     "comment"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}, "comment"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": True}, "response.in_progress"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}, "ping"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "stream": True}, "comment"),
])
def test_streams_keep_alive_while_a_prompt_prefills(small, monkeypatch, path, body, ping) -> None:
    monkeypatch.setattr(keepalive, "KEEPALIVE_INTERVAL_S", 0.05)
    sched, slow_step = _slowed(small, 0.4)
    monkeypatch.setattr(sched, "step", slow_step)
    with httpx.stream("POST", small.base_url + path, json={"model": "tiny", **body}, timeout=60) as r:
        events = list(sse_events(r))
    assert r.status_code == 200
    kinds = [k for k, _ in events]
    # the wait before the first token was kept alive: several keep-alives before it (Responses: after
    # response.created and its first in_progress), each the API's own
    first = next(i for i, k in enumerate(kinds) if k not in (ping, "response.created"))
    assert kinds[:first].count(ping) >= 2 + (ping == "response.in_progress"), kinds
    if ping == "comment":
        assert {d for k, d in events if k == "comment"} == {"keep-alive"}
    if path == "/v1/messages":
        assert kinds[first] == "message_start"  # which waits for the cache hits it reports
        assert [d for k, d in events if k == "ping"][0] == {"type": "ping"}
    if path == "/v1/responses":
        seq = [d["sequence_number"] for k, d in events if isinstance(d, dict) and "sequence_number" in d]
        assert seq == list(range(len(seq)))


@pytest.mark.parametrize("path, body, ping", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather?"}], "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]},
     "comment"),
    ("/v1/responses", {"input": "Weather?", "tool_choice": "required",
                       "tools": [{"type": "function", "name": "get_weather", "parameters": CITY}]},
     "response.in_progress"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Weather?"}], "tool_choice": {"type": "any"},
                      "tools": [{"name": "get_weather", "input_schema": CITY}]}, "content_block_delta"),
])
def test_streams_keep_alive_while_a_tool_call_is_written(server, monkeypatch, path, body, ping) -> None:
    """A tool call's tokens are held back until the call is whole: a long one (a 0.5B model once wrote
    3,499 tokens of arguments) wrote nothing for minutes, and Codex dropped the stream at 300 s. Each
    step here is quicker than the keep-alive interval, the whole call slower."""
    monkeypatch.setattr(keepalive, "KEEPALIVE_INTERVAL_S", 0.3)
    driver = server.loop.engine.scheduler.driver
    forward = driver.forward

    def slow_decode(*args, **kwargs):
        if kwargs["generated"]:
            time.sleep(0.06)
        return forward(*args, **kwargs)
    monkeypatch.setattr(driver, "forward", slow_decode)
    body = {"model": "tiny", "stream": True, "temperature": 0.0, **body,
            ("max_output_tokens" if path == "/v1/responses" else "max_tokens"): 200}
    with httpx.stream("POST", server.base_url + path, json=body, timeout=60, headers={"x-api-key": KEY,
                      "authorization": f"Bearer {KEY}"}) as r:
        events = list(sse_events(r)) if r.status_code == 200 else r.read()
    assert r.status_code == 200, events
    kinds = [k for k, _ in events]
    start = kinds.index("message_start") + 1 if path == "/v1/messages" else 2 if path == "/v1/responses" else 0
    call = next(i for i in range(start, len(events))  # the call's first event: written once the call is whole
                if '"arguments"' in json.dumps(events[i][1]) or '"tool_use"' in json.dumps(events[i][1]))
    keepalives = [d for k, d in events[start:call] if k == ping]
    if path == "/v1/messages":  # an empty text_delta (the SDK yields it: Claude Code's watchdog sees it)
        assert {json.dumps(d["delta"]) for d in keepalives} == {json.dumps({"type": "text_delta", "text": ""})}
    assert len(keepalives) >= 2, kinds


def test_messages_stream_starts_at_admission_and_keeps_alive_with_events_the_sdk_yields(small, monkeypatch) -> None:
    """Claude Code's watchdog counts the events the Anthropic SDK yields (it skips ``ping``): while a
    prompt prefills, ``message_start`` is out already and empty ``text_delta`` events follow; folded
    by the SDK, the message equals the one streamed without keep-alives."""
    client = anthropic.Anthropic(base_url=small.base_url, api_key="x")
    ask = {"model": "tiny", "max_tokens": 6, "extra_body": {"temperature": 0.0},  # (stream() takes no temperature)
           "messages": [{"role": "user", "content": "Tell me about caches."}]}
    with client.messages.stream(**ask) as stream:  # quick: no keep-alive
        plain = stream.get_final_message()
    assert httpx.post(small.base_url + "/flush_cache").status_code == 200  # the prompt computed again
    monkeypatch.setattr(keepalive, "KEEPALIVE_INTERVAL_S", 0.05)
    driver = small.loop.engine.scheduler.driver
    forward = driver.forward

    def slow_prefill(*args, **kwargs):
        if not kwargs["generated"]:  # a prompt chunk: minutes on a CPU for an agent's prompt
            time.sleep(0.5)
        return forward(*args, **kwargs)
    monkeypatch.setattr(driver, "forward", slow_prefill)
    with client.messages.stream(**ask) as stream:
        events = list(stream)
        kept = stream.get_final_message()
    kinds = [e.type if e.type != "text" else ("keep-alive" if e.text == "" else "text") for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start", kinds
    assert events[0].message.usage.input_tokens == plain.usage.input_tokens  # the split, before any token
    # several events the SDK yields between message_start and the first token (the keep-alives)
    first_text = kinds.index("text")
    assert kinds[2:first_text].count("keep-alive") >= 3, kinds
    assert plain.content[0].text  # (a reply with text: its block is the one the keep-alives opened)
    assert kept.model_dump(exclude={"id"}) == plain.model_dump(exclude={"id"})


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=[pytest.mark.multirank, pytest.mark.parallel])])
def test_a_request_reports_its_admission_before_its_first_token(tp) -> None:
    """The update a stream starts from (Anthropic's message_start): cache hits known, no token yet; on one
    rank and through a rank group's leader. The other APIs skip it (no empty chunk)."""
    engine = Engine("random:tiny", dtype="float32", tp_size=tp, max_total_tokens=512)
    loop = EngineLoop(engine).start()
    greedy = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)

    async def updates() -> list[list[Update]]:
        return [[u async for u in loop.submit(list(range(3, 60)), greedy)] for _ in range(2)]
    try:
        cold, warm = asyncio.run(updates())
    finally:
        loop.stop()
        engine.shutdown()
    for ups, hit in ((cold, 0), (warm, 48)):
        assert [u.admission for u in ups] == [True, False, False, False]
        assert ups[0].cached == {"device": hit, "host": 0, "storage": 0} and ups[0].num_output_tokens == 0
        assert [len(u.token_ids) for u in ups] == [0, 1, 1, 1] and ups[-1].finished
    assert [u.token_ids for u in cold] == [u.token_ids for u in warm]


def test_a_hostile_tool_type_is_named_cut_and_a_namespace_flattened() -> None:
    """A client may send any string as a tool's type: the header names it cut to 64 characters."""
    tools = [{"type": "namespace", "tools": [{"type": "function", "name": "shell"}, {"type": "web_search"}]},
             {"type": "x" * 10_000}]
    kept, dropped = split_responses_tools(tools)
    assert [t["name"] for t in kept] == ["shell"]
    header = dropped_header(note_dropped(dropped))
    assert header == {"X-Hicache-Dropped-Tools": "web_search, " + "x" * 64}
