"""One tool-using turn through each API a live server speaks (Chat Completions, Responses, Anthropic
Messages), streamed or not, read back as ``(text, [(name, arguments dict)])`` the way each API's
client assembles it (streamed calls from their deltas). Shared by the real-model tool-call tests."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx

TIMEOUT = 600.0  # a cold prompt on a loaded 2-core machine


def _sse(base: str, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    with httpx.stream("POST", base + path, json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def _post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(base + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def chat_turn(base: str, model: str, prompt: str, tools: list[dict], tool_choice: Any, stream: bool,
              max_tokens: int = 64) -> tuple[str, list[tuple[str, dict]]]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "tools": tools,
            "tool_choice": tool_choice, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        msg = _post(base, "/v1/chat/completions", body)["choices"][0]["message"]
        return msg.get("content") or "", [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                          for c in msg.get("tool_calls") or []]
    text, calls = "", {}
    for chunk in _sse(base, "/v1/chat/completions", body):
        delta = chunk["choices"][0]["delta"]
        text += delta.get("content") or ""
        for c in delta.get("tool_calls") or []:  # the SDK's accumulator: by index, arguments appended
            name, args = calls.get(c["index"], ("", ""))
            calls[c["index"]] = (name + (c["function"].get("name") or ""), args + (c["function"].get("arguments") or ""))
    return text, [(name, json.loads(args)) for name, args in calls.values()]


def responses_turn(base: str, model: str, prompt: str, tools: list[dict], tool_choice: Any, stream: bool,
                   max_tokens: int = 64) -> tuple[str, list[tuple[str, dict]]]:
    flat = [{"type": "function", **t["function"]} for t in tools]
    body = {"model": model, "input": prompt, "tools": flat, "tool_choice": tool_choice,
            "max_output_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        output = _post(base, "/v1/responses", body)["output"]
    else:
        output = next(e["response"]["output"] for e in _sse(base, "/v1/responses", body)
                      if e["type"] in ("response.completed", "response.incomplete"))
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    return text, [(i["name"], json.loads(i["arguments"])) for i in output if i["type"] == "function_call"]


def messages_turn(base: str, model: str, prompt: str, tools: list[dict], tool_choice: Any, stream: bool,
                  max_tokens: int = 64) -> tuple[str, list[tuple[str, dict]]]:
    anthropic_tools = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                        "input_schema": t["function"]["parameters"]} for t in tools]
    choice = {"auto": {"type": "auto"}, "required": {"type": "any"}}[tool_choice]
    body = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}],
            "tools": anthropic_tools, "tool_choice": choice, "temperature": 0, "stream": stream}
    if not stream:
        blocks = _post(base, "/v1/messages", body)["content"]
        return ("".join(b["text"] for b in blocks if b["type"] == "text"),
                [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"])
    text, calls = "", {}
    for event in _sse(base, "/v1/messages", body):
        if event["type"] == "content_block_start" and event["content_block"]["type"] == "tool_use":
            calls[event["index"]] = [event["content_block"]["name"], ""]
        elif event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
            calls[event["index"]][1] += event["delta"]["partial_json"]
        elif event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
            text += event["delta"]["text"]
    return text, [(name, json.loads(args or "{}")) for name, args in calls.values()]


TURNS = {"chat": chat_turn, "responses": responses_turn, "messages": messages_turn}
