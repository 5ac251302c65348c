"""Structured output and tools: grammars (JSON schema, regex, EBNF, Lark) mask every sampled token,
forced tool calls always parse and satisfy their schema, the reply's calls come back as
``tool_calls`` (streamed too), and what cannot compile is one clear 400 with the server healthy.
Through the `openai` SDK against a live server; the grammar engine also under speculative
decoding, the prefix cache and TP2."""

from __future__ import annotations

import dataclasses
import json
import re

import httpx
import pytest

from hicache import Engine
from hicache.runtime.grammar_vet import tokenizer_config
from hicache.runtime.sampling import GrammarSpec, SamplingParams

pytestmark = [pytest.mark.server, pytest.mark.engine]

MODEL = "tiny"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}


def check_person(text: str) -> dict:
    obj = json.loads(text)
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 150
    return obj


def test_json_schema_output_parses_and_follows_the_schema_even_sampled(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person?"}],
                                           response_format=fmt, temperature=1.0, seed=seed, max_tokens=64)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        check_person(r.choices[0].message.content)


def test_json_object_regex_and_ebnf(client, server) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                       response_format={"type": "json_object"}, temperature=0.8, seed=1,
                                       max_tokens=200)
    if r.choices[0].finish_reason == "stop":  # a random model may write a long object: cut by max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    regex = r"(yes|no), [0-9]{3}"
    text = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=20, temperature=1.0, seed=5,
                                     extra_body={"regex": regex}).choices[0].text
    assert re.fullmatch(regex, text), text
    ebnf = 'root ::= "The answer is " digit digit "."\ndigit ::= [0-9]'
    text = client.completions.create(model=MODEL, prompt="Q:", max_tokens=20, temperature=1.0, seed=2,
                                     extra_body={"ebnf": ebnf}).choices[0].text
    assert re.fullmatch(r"The answer is [0-9]{2}\.", text), text


@pytest.mark.parametrize("body, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "cannot be compiled"),
    ({"extra": {"regex": "a[b"}}, "regex", "cannot be compiled"),
    ({"extra": {"regex": "[^\\x00-\\x{10FFFF}]"}}, "regex", "matches nothing"),
    ({"extra": {"ebnf": 'root ::= "x" | ('}}, "ebnf", "cannot be compiled"),
    ({"extra": {"regex": "x", "ebnf": 'root ::= "x"'}}, "ebnf", "one of response_format, regex and ebnf"),
    ({"extra": {"regex": "x", "ignore_eos": True}}, "ignore_eos", "ignore_eos cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "letters, digits"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "wat"}}}}}], "tool_choice": "required"}, "tools", "cannot be compiled"),
    # before: a forced call of a string schema was returned as raw <tool_call> text (issue 56)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools", "must describe an object"),
])
def test_what_cannot_compile_is_one_clear_400_and_the_server_stays_healthy(server, body, param, says) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
               **{k: v for k, v in body.items() if k != "extra"}, **body.get("extra", {})}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=payload, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    assert err["message"].count(". ") == 0 and err["message"].endswith("."), err["message"]  # one sentence
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_forced_tool_calls_parse_and_satisfy_their_schema(client) -> None:
    messages = [{"role": "user", "content": "Weather in Paris, and 2 + 3?"}]
    for seed in range(3):
        # one call a reply: a random model given "\n<tool_call>" or EOS after each call may go on for long
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, ADD], temperature=1.0,
                                           tool_choice="required", parallel_tool_calls=seed == 0, seed=seed,
                                           max_tokens=150 if seed else 1000)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert call.type == "function" and call.id.startswith("call_")
            if call.function.name == "get_weather":
                assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
            else:
                assert call.function.name == "add" and isinstance(args["a"], int) and isinstance(args["b"], int)
    named = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, ADD], temperature=1.0,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           parallel_tool_calls=False, seed=9, max_tokens=120)
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add"]
    cut = client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD], max_tokens=6,
                                         tool_choice={"type": "function", "function": {"name": "add"}})
    choice = cut.choices[0]  # max_tokens ends it inside the call: "length", and the open call is no content
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert "<tool_call>" not in (choice.message.content or "")


def test_a_forced_call_of_a_schema_without_a_type_has_object_arguments(client) -> None:
    """A schema that names no type could take a string, which no call parses: the grammar holds it to an object."""
    either = {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "object", "properties": {},
                                                             "additionalProperties": False}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": either}}
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}], tools=[tool],
                                           tool_choice="required", parallel_tool_calls=False, seed=seed,
                                           max_tokens=60)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and "<tool_call>" not in (choice.message.content or "")
        assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{}]


def test_calls_finished_before_max_tokens_are_returned_and_a_named_function_is_called_once(client) -> None:
    """Before: a named tool_choice produced the same call twice unless parallel_tool_calls=false, and a cut
    reply could lose its finished calls or return the start of the next tag as content."""
    messages = [{"role": "user", "content": "Weather in Paris, and 2 + 3?"}]
    kw = dict(model=MODEL, messages=messages, tools=[WEATHER, ADD], temperature=0.0)
    named = client.chat.completions.create(**kw, tool_choice={"type": "function", "function": {"name": "add"}},
                                           max_tokens=400)  # parallel_tool_calls defaults to true
    assert named.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["add"]
    full = client.chat.completions.create(**kw, tool_choice="required", max_tokens=400)
    want = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    cut_with_calls = 0
    for max_tokens in range(8, full.usage.completion_tokens, 7):
        for stream in (False, True):
            if stream:
                chunks = list(client.chat.completions.create(**kw, tool_choice="required", max_tokens=max_tokens,
                                                             stream=True))
                deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
                content = "".join(d.content or "" for d in deltas) or None
                calls = [(c.function.name, c.function.arguments) for d in deltas for c in (d.tool_calls or [])]
                finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
            else:
                r = client.chat.completions.create(**kw, tool_choice="required", max_tokens=max_tokens)
                content, finish = r.choices[0].message.content, r.choices[0].finish_reason
                calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]
            assert finish == "length" and calls == want[:len(calls)], (max_tokens, stream, calls)
            assert content is None or "<" not in content, (max_tokens, stream, content)  # no tag start as text
            cut_with_calls += bool(calls)
    assert cut_with_calls >= 2  # cuts after the first call was finished, streamed and not


def test_a_tool_round_trip_with_a_local_function_streamed_and_not(client) -> None:
    """Call forced, run the function here, send the result back as a `tool` message; the same
    calls arrive whole through a stream (the SDK's accumulation of deltas)."""
    messages = [{"role": "user", "content": "What is 2 + 3? Use the tool."}]
    kw = dict(model=MODEL, tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}},
              parallel_tool_calls=False, temperature=0, max_tokens=100)
    r = client.chat.completions.create(messages=messages, **kw)
    call = r.choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [("add", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    args = json.loads(call.function.arguments)
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD], max_tokens=8, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.usage.prompt_tokens_details.cached_tokens > 0  # the history before the tool result hits
    # "none": no call is parsed, and the tools stay in the prompt, so the same prefix hits
    nocall = client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD], tool_choice="none",
                                            max_tokens=8, temperature=0)
    assert not nocall.choices[0].message.tool_calls and nocall.usage.prompt_tokens == final.usage.prompt_tokens
    assert nocall.usage.prompt_tokens_details.cached_tokens >= final.usage.prompt_tokens - 16  # all but a part page


def test_nulls_mean_defaults(server) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": None,
               "top_p": None, "n": None, "stream": None, "presence_penalty": None, "tools": None,
               "response_format": None, "return_token_ids": True}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=payload, timeout=30)
    assert r.status_code == 200, r.text


def test_grammar_under_speculation_and_with_a_cached_prompt() -> None:
    """NGRAM drafts that the grammar refuses are rejected; greedy output equals plain decoding
    under the same grammar, and a second request hits its prompt in the cache. A lazy grammar
    whose trigger the accepted drafts contain (the random model's reply loops, NGRAM copies the
    loop) masks the rows after it as plain decoding does: the same output."""
    prompt = "List: " + "alpha beta gamma delta " * 8
    spec = GrammarSpec("regex", "(alpha|beta|gamma|delta)( (alpha|beta|gamma|delta)){5,12}")
    greedy = SamplingParams(max_new_tokens=120, temperature=0.0, grammar=spec)
    plain = Engine("random:tiny", dtype="float32", max_total_tokens=4096)
    ngram = Engine("random:tiny", dtype="float32", max_total_tokens=4096, speculative_algorithm="NGRAM")
    try:
        want = plain.generate([prompt], greedy)[0]
        again = plain.generate([prompt], greedy)[0]
        got = ngram.generate([prompt], greedy)[0]
        free = plain.generate([prompt], SamplingParams(max_new_tokens=40, temperature=0.0))[0].output_ids
        table = tokenizer_config(plain.tokenizer, plain.vocab_size)["tokens"]
        lazy = [SamplingParams(max_new_tokens=40, temperature=0.0, grammar=GrammarSpec(
            "regex", "x[0-9]{6}", triggers=((re.escape(table[free[k - 2]] + table[free[k - 1]]), "x"),)))
            for k in (20, 26, 29, 32)]  # (inside the reply's loop: 26-32 are reached within accepted drafts)
        lazy_plain = [plain.generate([prompt], sp)[0] for sp in lazy]  # (one at a time: each its own trajectory)
        lazy_ngram = [ngram.generate([prompt], sp)[0] for sp in lazy]
    finally:
        plain.shutdown()
        ngram.shutdown()
    assert re.fullmatch(spec.source, want.text) and want.finish_reason == "stop", want.text
    assert again.output_ids == want.output_ids and again.cached_tokens > 0
    assert got.output_ids == want.output_ids and got.spec_verify_steps > 0
    assert [r.output_ids for r in lazy_ngram] == [r.output_ids for r in lazy_plain]
    assert all(r.finish_reason == "stop" and r.output_ids != free for r in lazy_plain)


def test_a_lazy_grammar_is_free_until_its_trigger_then_holds() -> None:
    """A lazy grammar (how a call the model begins under tool_choice auto is constrained) masks
    nothing until its trigger matches the output, then takes the trigger's prefix and holds from
    there; one whose prefix it refuses lets go (the reply is what free decoding writes); one that never
    matches changes nothing."""
    prompt = "Count: one two three four five"
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    engine = Engine("random:tiny", dtype="float32", max_total_tokens=4096)
    try:
        table = tokenizer_config(engine.tokenizer, engine.vocab_size)["tokens"]  # each id's bytes, as Latin-1
        head = "".join(table[t] for t in engine.generate([prompt], greedy)[0].output_ids[:3])

        def lazy(prefix: str, pattern: str = re.escape(head)) -> SamplingParams:
            return dataclasses.replace(greedy, grammar=GrammarSpec("regex", "x[0-9]{6}", triggers=((pattern, prefix),)))

        free, held, released, never = engine.generate(
            [prompt] * 4, [greedy, lazy("x"), lazy("y"), lazy("x", "never seen")])
        stats = engine.stats()["grammar"]
    finally:
        engine.shutdown()
    assert held.output_ids[:3] == free.output_ids[:3] != held.output_ids[3:6]
    assert held.finish_reason == "stop" and re.fullmatch("[0-9]{6}", "".join(table[t] for t in held.output_ids[3:-1]))
    assert released.output_ids == free.output_ids and never.output_ids == free.output_ids
    assert (stats["lazy_triggered"], stats["lazy_released"], stats["failed_requests"]) == (2, 1, 0)


def test_a_tool_schema_the_grammar_engine_refuses_is_a_400_when_forced_and_free_under_auto(server) -> None:
    """Under tool_choice auto the call grammar is the server's own doing: where it cannot be compiled
    the request runs without it; a forced call of the same tool is a 400."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "wat"}}}}}
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": [tool]}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=payload, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text
    r = httpx.post(server.base_url + "/v1/chat/completions", json={**payload, "tool_choice": "required"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


@pytest.mark.multirank
@pytest.mark.parallel
def test_tp2_and_pp2_ranks_apply_the_same_masks(checker) -> None:
    """Every sampling rank keeps its own matcher: greedy and seeded outputs equal one rank's at TP2
    and at PP2 (where stage 0 holds no matcher, agrees the template builds, and the last stage's
    failures come back with the tokens), the consensus checker on; a grammar that fails
    mid-request ends it with grammar_failed on every layout."""
    spec = GrammarSpec("regex", "(alpha|beta|gamma|delta)( (alpha|beta|gamma|delta)){5,12}")
    prompt = "List: " + "alpha beta gamma delta " * 8
    sampling = [SamplingParams(max_new_tokens=120, temperature=0.0, grammar=spec),
                SamplingParams(max_new_tokens=120, temperature=1.0, seed=4, grammar=spec),
                SamplingParams(max_new_tokens=100, temperature=0.0,  # its lexer runs out at output token 65
                               grammar=GrammarSpec("regex", "[a-z]{64}(b{1000}){1000}"))]
    # and penalties, logprobs and n = 2 sharing the prompt (the sibling waits across ranks)
    penalized = SamplingParams(max_new_tokens=30, temperature=0.7, seed=9, frequency_penalty=1.0,
                               presence_penalty=0.5, logprobs=2)
    outputs, logprobs = [], []
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        engine = Engine("random:tiny", dtype="float32", max_total_tokens=4096, tp_size=tp, pp_size=pp)
        try:
            results = engine.generate([prompt, prompt, prompt], sampling)
            assert [(r.finish_reason, r.error_code) for r in results][2] == ("error", "grammar_failed")
            outputs.append([r.output_ids for r in results])
            choices = engine.generate([prompt], penalized, n=2)
            outputs[-1] += [r.output_ids for r in choices]
            logprobs.append([e.logprob for r in choices for e in r.logprobs])
            assert [len(r.logprobs) for r in choices] == [len(r.output_ids) for r in choices]
            if tp * pp > 1:
                assert engine.group.monitor.divergence is None
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1] == outputs[2]
    assert logprobs[0] == pytest.approx(logprobs[1], abs=1e-4) == logprobs[2]
