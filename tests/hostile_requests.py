"""Hostile requests for the OpenAI, Anthropic and SGLang routes: grammar bombs and seeded mutations
of valid bodies. What the HTTP fuzz campaign (tests/test_server_fuzz.py) and the grammar-bomb benchmark
(benchmarks/bench_grammar_bombs.py) send; each names what it tried, so a failure can be replayed
from its seed.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any, Callable

# A grammar bomb: its body fields (chat / completions) by name; ``n`` varies it so that each
# variant is a new grammar (a client defeating the verdict cache).
Bomb = Callable[[int], dict[str, Any]]


def ref_chain(n: int = 2500, at: str = "#") -> dict:
    """A JSON schema of ``n`` chained ``$ref``s (~88 KB at 2,500, nesting 6): a SIGSEGV in the
    grammar compiler of a process with an 8 MiB stack. ``at``: where the schema sits in the document
    its pointers resolve in."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"{at}/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": f"{at}/$defs/d0"}


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "bomb", "schema": schema}}}


def _nested(depth: int) -> dict:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


BOMBS: dict[str, Bomb] = {
    # ~1 s to the first mask, then the lexer runs out of expressions (before: 0.7 s and ~160 MB per
    # request on the scheduler thread, and output that broke the grammar)
    "counted repetition": lambda n: {"regex": f"({'abcdefgh'[n % 8]}{{1000}}){{{1000 + n}}}"},
    "ref chain": lambda n: _schema(ref_chain(2500 + n)),
    "deep nesting": lambda n: _schema(_nested(40 + n % 20)),
    "huge enum": lambda n: _schema({"enum": [f"v{n}-{i}" for i in range(5000)]}),
    "wide anyOf": lambda n: _schema({"anyOf": [{"const": f"c{n}-{i}"} for i in range(800)]}),
    "long alternation": lambda n: {"regex": "(" + "|".join(f"w{n}x{i}" for i in range(4000)) + ")+"},
    "fails later": lambda n: {"regex": f"[a-z]{{{48 + n % 16}}}(b{{1000}}){{{1000 + n}}}"},
    "forced tool chain": lambda n: {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": ref_chain(150 + n % 50, at="#/properties/arguments")}}], "tool_choice": "required"},
    "empty regex": lambda n: {"regex": ""},
    "unclosed ebnf": lambda n: {"ebnf": "root ::= (\"a\" "},
}

EXTREMES: list[Any] = [None, True, -1, 0, 1, 2**31, 2**63, 2**70, -2**70, 1e308, -1e308, 1e-320, 0.5, "", "x",
                       "\u0665", " 5_0 ", "é" * 3000, [], [None], [[]], {}, {"a": {"b": {}}}, [1] * 1000]
TOKEN_IDS: list[Any] = [-1, 0, 2**31, 2**63, 2**70, "5", 1.5, None, True]
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "n", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_tokens", "max_tokens", "stop", "stop_token_ids", "logit_bias",
                   "ignore_eos", "logprobs", "top_logprobs", "stream", "cache_salt", "user", "response_format",
                   "regex", "ebnf", "tools", "tool_choice", "parallel_tool_calls", "stream_options",
                   "max_completion_tokens", "bootstrap_room", "edit_reuse")
HELLO = [{"role": "user", "content": "hello there"}]
# Each route's valid body (less the model's name, which every route but /generate names)
VALID_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": HELLO, "max_tokens": 8},
    "/v1/completions": {"prompt": "hello there", "max_tokens": 8},
    "/v1/messages": {"max_tokens": 8, "messages": HELLO}, "/v1/messages/count_tokens": {"messages": HELLO},
    "/v1/responses": {"input": "hello there", "max_output_tokens": 8},
    "/generate": {"text": "hello there", "sampling_params": {"max_new_tokens": 8}}}
KINDS = ("grammar bomb", "field", "token ids", "drop", "sizes", "types", "native", "agent APIs")
# Fields of the Messages and Responses APIs set to extremes by the "agent APIs" kind
AGENT_FIELDS = {"/v1/messages": ("max_tokens", "temperature", "top_p", "top_k", "system", "stop_sequences", "tools",
                                 "tool_choice", "messages", "stream"),
                "/v1/messages/count_tokens": ("system", "tools", "tool_choice", "messages", "max_tokens"),
                "/v1/responses": ("max_output_tokens", "temperature", "top_p", "instructions", "input", "tools",
                                  "tool_choice", "text", "previous_response_id", "store", "stream", "metadata",
                                  "parallel_tool_calls")}
AGENT_ROUTES = tuple(AGENT_FIELDS)
# What the agent APIs' nested fields are set to: text.format, metadata, a function's schema, stop sequences
TEXT_FORMATS: list[Any] = ["json", ["json_schema"], 3, {"type": "json_schema", "schema": "{}"},
                           {"type": "json_schema", "name": "x", "schema": {"type": "wat"}}, {"type": "json_object"},
                           {"type": "grammar"}, {"type": "text", "junk": [{}] * 1000}, {"type": None}]
METADATA: list[Any] = [{"k": [{}] * 10_000}, {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513},
                       {"k": 5}, {"k": "v"}]
SCHEMAS: list[Any] = [{"type": "string"}, {"type": ["object", "null"]}, {"anyOf": [{"type": "string"}]}, {},
                      {"properties": {"a": {"type": "integer"}}}, {"type": "object", "properties": []}, "object"]
STOPS: list[Any] = [["x"] * 5000, ["x" * 300], [""], ["\u00e9" * 200], [None], "x", [["x"]]]


class RequestFuzzer:
    """Seeded hostile requests: ``next()`` gives (kind, route, body); ``tried`` counts kinds.
    ``kinds``: what it draws from (all of :data:`KINDS` by default)."""

    def __init__(self, seed: int, vocab_size: int, model: str, kinds: tuple[str, ...] = KINDS) -> None:
        self.rng = random.Random(seed)
        self.vocab, self.model, self.kinds = vocab_size, model, kinds
        self.tried: dict[str, int] = {}
        self._n = 0

    def valid(self, route: str) -> dict[str, Any]:
        """A fresh valid body for ``route`` (the mutations change it in place)."""
        body = copy.deepcopy(VALID_BODIES[route])
        return body if route == "/generate" else {"model": self.model, **body}

    def next(self) -> tuple[str, str, dict[str, Any]]:
        rng = self.rng
        self._n += 1
        kind = rng.choice(self.kinds)
        route = ("/generate" if kind == "native" else rng.choice(AGENT_ROUTES)
                 if kind == "agent APIs" else rng.choice(("/v1/chat/completions", "/v1/completions")))
        body = self.valid(route)
        if kind == "grammar bomb":
            name = rng.choice(sorted(BOMBS))
            kind = f"bomb: {name}"
            if name == "forced tool chain":
                route, body = "/v1/chat/completions", self.valid("/v1/chat/completions")
            body.update(BOMBS[name](self._n))
            if rng.random() < 0.3:
                body["n"] = rng.choice((2, 8, 32))
        elif kind == "field":
            for name in rng.sample(SAMPLING_FIELDS, rng.randint(1, 3)):
                body[name] = rng.choice(EXTREMES)
        elif kind == "token ids":
            self._token_ids(route, body)
        elif kind == "drop":
            body.pop(rng.choice(sorted(body)))
        elif kind == "sizes":
            body.update(rng.choice([{"n": 129}, {"max_tokens": 10**6}, {"n": 64, "logprobs": True, "top_logprobs": 20,
                                                                          "max_tokens": 4000},
                                    {"stop": ["x"] * 5000}, {"logit_bias": {str(i): 1 for i in range(3000)}}]))
            if route == "/v1/completions" and rng.random() < 0.5:
                body["prompt"] = ["word " * 50] * rng.choice((200, 10_000))
        elif kind == "types":
            field = rng.choice(sorted(body))
            body[field] = rng.choice([json.dumps(body[field]), [body[field]], {"v": body[field]}, 3.5])
        elif kind == "native":
            sp = body["sampling_params"]
            choice = rng.random()
            if choice < 0.3:
                sp.update({"regex": BOMBS["counted repetition"](self._n)["regex"]})
            elif choice < 0.6:
                body.pop("text")
                body["input_ids"] = [rng.choice(TOKEN_IDS + [self.vocab, self.vocab - 1, 5]) for _ in range(4)]
            else:
                sp[rng.choice(("stop_token_ids", "min_new_tokens", "top_k", "logit_bias", "json_schema", "ebnf",
                               "max_new_tokens", "sampling_seed", "n"))] = rng.choice(EXTREMES)
        elif kind == "agent APIs":
            self._agent_api(route, body)
        self.tried[kind] = self.tried.get(kind, 0) + 1
        return kind, route, body

    def _agent_api(self, route: str, body: dict[str, Any]) -> None:
        """The Messages / Responses bodies: an extreme field, nested fields of every shape (text.format,
        metadata, stop sequences, a function's schema, forced or not), malformed blocks or items, forced
        calls of a bomb schema, unknown or guessed previous responses, counts of long prompts."""
        rng, messages = self.rng, route.startswith("/v1/messages")
        choice = rng.random()
        if choice < 0.3:
            for name in rng.sample(AGENT_FIELDS[route], rng.randint(1, 3)):
                body[name] = rng.choice(EXTREMES + [[{"type": "image"}], [{"role": "tool"}], {"type": "any"}])
        elif choice < 0.5:
            self._agent_shapes(route, body)
        elif choice < 0.65:  # a forced call of a pathological schema
            schema = BOMBS["forced tool chain"](self._n)["tools"][0]["function"]["parameters"]
            self._agent_tool(route, body, schema, forced=True)
        elif choice < 0.8:  # blocks / items of every kind, some malformed
            blocks = [{"type": "tool_result", "tool_use_id": "x", "content": [{"type": "text", "text": "r"}] * 3},
                      {"type": "tool_use", "id": "t", "name": "f", "input": rng.choice(EXTREMES)},
                      {"type": "function_call_output", "call_id": "c", "output": rng.choice(EXTREMES)},
                      {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]
            key = "messages" if messages else "input"
            body[key] = [{"role": rng.choice(("user", "assistant", "system")), "content": rng.sample(blocks, 2)}] \
                if messages else rng.sample(blocks, 3)
        elif route == "/v1/responses":
            body["previous_response_id"] = rng.choice(("resp_" + "0" * 32, "", "../etc", "x" * 10_000))
        elif route == "/v1/messages":
            body["max_tokens"] = rng.choice((0, -1, 10**6))
        else:
            body["messages"] = [{"role": "user", "content": "word " * rng.choice((10, 3000, 20_000))}]

    def _agent_shapes(self, route: str, body: dict[str, Any]) -> None:
        """A nested field of the route's in one of its hostile shapes."""
        rng = self.rng
        if route == "/v1/responses":
            field = rng.choice(("text", "metadata", "tool"))
            if field == "text":
                body["text"] = {"format": rng.choice(TEXT_FORMATS)}
            elif field == "metadata":
                body["metadata"] = rng.choice(METADATA)
            else:
                self._agent_tool(route, body, rng.choice(SCHEMAS), forced=rng.random() < 0.7)
        elif route == "/v1/messages" and rng.random() < 0.5:
            body["stop_sequences"] = rng.choice(STOPS)
        else:
            self._agent_tool(route, body, rng.choice(SCHEMAS), forced=rng.random() < 0.7)

    def _agent_tool(self, route: str, body: dict[str, Any], schema: Any, forced: bool) -> None:
        """One function tool of ``schema``, its call forced or left to the model."""
        if route == "/v1/responses":
            body.update(tools=[{"type": "function", "name": "f", "parameters": schema}],
                        tool_choice="required" if forced else "auto", max_output_tokens=40)
        else:
            body.update(tools=[{"name": "f", "input_schema": schema}],
                        tool_choice={"type": "any" if forced else "auto"})
            if route == "/v1/messages":
                body["max_tokens"] = 40

    def _token_ids(self, route: str, body: dict[str, Any]) -> None:
        rng, bad = self.rng, [self.vocab, self.vocab + 1, *TOKEN_IDS]
        field = rng.choice(("stop_token_ids", "logit_bias", "prompt"))
        if field == "stop_token_ids":
            body.update(min_tokens=2, stop_token_ids=[rng.choice(bad)])
        elif field == "logit_bias":
            body["logit_bias"] = {str(rng.choice(bad)): 5}
        elif route == "/v1/completions":
            body["prompt"] = [1, 2, rng.choice(bad)]
        else:
            body.update(min_tokens=2, stop_token_ids=[self.vocab])
