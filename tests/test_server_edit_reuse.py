"""Reuse after an edit in the HTTP APIs (issue 61, docs/edit_reuse.md "In the APIs"): a live server on
random:small with --enable-edit-reuse; a prompt is sent, then the same prompt with a few characters
inserted after its first block. The usage of every API says how many prompt tokens were reused (never
counted as cached), the per-request switch turns it off, /metrics and /stats count it, and a server
without the flag refuses a request that asks for it, naming the field."""

from __future__ import annotations

import json
import random
import re

import httpx
import openai
import pytest
from live_server import serving

pytestmark = pytest.mark.server

NAME = "small"
HEAD = "You are a careful assistant. Rules follow.\n"  # (the tokenizer is bytes: 1 character, 1 token)
INSERTED = "Untracked: notes.txt\n"
# The most an exact prefix hit of an edited prompt can be: the template's head, HEAD and the insertion (a
# request that reused caches its exact part), a page at most past them -- none of the body's tokens.
EXACT_AT_MOST = 32 + len(HEAD + INSERTED) + 16


def body_text(seed: int) -> str:
    """~600 characters of words: the part of the prompt after the edit (one per test: no test reads
    another's pages)."""
    rng = random.Random(seed)
    words = ["cache", "page", "token", "prefix", "layer", "key", "value", "rotate", "span", "gate", "tier"]
    return " ".join(rng.choice(words) for _ in range(110))[:600] + "\n"


def prompts(seed: int) -> tuple[str, str]:
    """(original, edited): the edit inserts :data:`INSERTED` after :data:`HEAD`."""
    body = body_text(seed)
    return HEAD + body, HEAD + INSERTED + body


@pytest.fixture(scope="module")
def server():
    with serving("random:small", NAME, max_total_tokens=8192, enable_edit_reuse=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def chat(client: openai.OpenAI, text: str, **extra) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=NAME, messages=[{"role": "system", "content": text},
                                                                {"role": "user", "content": "Go."}],
                                          max_tokens=4, temperature=0, extra_body=extra or None)


def scrape(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        m = re.match(r"^(hicache_edit_reuse_\w+)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def test_chat_usage_reports_reused_tokens_apart_from_cached_ones(client) -> None:
    original, edited = prompts(1)
    warm = chat(client, original)
    assert warm.usage.prompt_tokens_details.model_extra["reused_tokens"] == 0  # (present: the server has it on)
    u = chat(client, edited).usage
    reused = u.prompt_tokens_details.model_extra["reused_tokens"]
    outcome = u.model_extra["hicache_edit_reuse"]
    assert reused >= 0.7 * len(original) and reused == outcome["reused_tokens"] and not outcome["gated"]
    assert outcome["recomputed_tokens"] > 0 and 0 < outcome["deviation"]
    cached = u.prompt_tokens_details.cached_tokens  # the exact prefix only: the template's head and HEAD
    assert 0 < cached <= EXACT_AT_MOST and cached + reused < u.prompt_tokens

    streamed = list(client.chat.completions.create(
        model=NAME, messages=[{"role": "system", "content": edited}, {"role": "user", "content": "Go."}],
        max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}))
    # the same edited prompt again, streamed: the body's KV comes back either reused again or as a hit on the
    # approximate KV the first edited turn left (counted in cached_tokens, and said apart)
    usage = streamed[-1].usage
    again = usage.model_extra["hicache_edit_reuse"]
    assert usage.prompt_tokens_details.model_extra["reused_tokens"] == again["reused_tokens"]
    assert usage.prompt_tokens_details.cached_tokens >= again["approximate_hit_tokens"]
    assert again["reused_tokens"] + again["approximate_hit_tokens"] >= 0.7 * len(original)


def test_edit_reuse_false_turns_it_off_for_one_request(server, client) -> None:
    original, edited = prompts(2)
    chat(client, original)
    off = chat(client, edited, edit_reuse=False).usage
    assert off.prompt_tokens_details.model_extra["reused_tokens"] == 0 and "hicache_edit_reuse" not in off.model_extra
    assert off.prompt_tokens_details.cached_tokens <= EXACT_AT_MOST  # computed, not served from the original
    # /generate: sampling_params.edit_reuse (the request that reused cached only its exact prefix)
    original, edited = prompts(3)
    post(server, "/generate", {"text": original, "sampling_params": {"max_new_tokens": 1}})
    meta = post(server, "/generate", {"text": edited, "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
    assert meta["reused_tokens"] == meta["hicache_edit_reuse"]["reused_tokens"] > 0
    meta = post(server, "/generate", {"text": edited, "sampling_params": {"max_new_tokens": 1,
                                                                          "edit_reuse": False}}).json()["meta_info"]
    assert meta["reused_tokens"] == 0 and "hicache_edit_reuse" not in meta


def test_metrics_and_stats_count_what_usage_reports(server, client) -> None:
    original, edited = prompts(4)
    client.completions.create(model=NAME, prompt=original, max_tokens=1)
    before, stats_before = scrape(server), httpx.get(server.base_url + "/stats").json()["edit_reuse"]
    kept = client.completions.create(model=NAME, prompt=edited, max_tokens=1).usage.model_extra["hicache_edit_reuse"]
    # the same text inside a chat template: its spans are found in the bare prompt's pages, but their first
    # tokens, computed after the template's head rather than at the prompt's start, deviate past the gate
    # (0.48 > 0.35 on this model): exact prefix reuse
    gated = chat(client, edited).usage
    client.completions.create(model=NAME, prompt=edited + "More.", max_tokens=1, extra_body={"edit_reuse": False})
    after, stats_after = scrape(server), httpx.get(server.base_url + "/stats").json()["edit_reuse"]

    def delta(name: str) -> float:
        return after[name] - before[name]  # (every series shows on a server with the flag, 0 until it moves)

    assert gated.model_extra["hicache_edit_reuse"]["gated"] and gated.prompt_tokens_details.model_extra["reused_tokens"] == 0
    assert delta('hicache_edit_reuse_tokens_total{kind="reused"}') == kept["reused_tokens"] > 0
    assert delta('hicache_edit_reuse_tokens_total{kind="recomputed"}') == kept["recomputed_tokens"] > 0
    assert delta('hicache_edit_reuse_requests_total{outcome="kept"}') == 1
    assert delta('hicache_edit_reuse_requests_total{outcome="gated"}') == 1
    assert delta('hicache_edit_reuse_requests_total{outcome="none"}') == 0  # (the request with it off: nowhere)
    assert stats_after["reused_tokens"] - stats_before["reused_tokens"] == kept["reused_tokens"]
    assert stats_after["requests"] - stats_before["requests"] == 2 and stats_after["gated_off"] - stats_before["gated_off"] == 1


def test_messages_and_responses_usage_carry_the_figures(server, client) -> None:
    original, edited = prompts(5)
    message = {"model": NAME, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Go."}]}
    post(server, "/v1/messages", {**message, "system": original})
    usage = post(server, "/v1/messages", {**message, "system": edited}).json()["usage"]
    reused = usage["hicache_edit_reuse"]["reused_tokens"]
    assert reused > 0 and usage["cache_read_input_tokens"] <= EXACT_AT_MOST  # reused tokens are input, not reads
    assert usage["input_tokens"] >= reused
    events = post(server, "/v1/messages", {**message, "system": edited, "stream": True}).text  # (the same, streamed)
    final = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: ")][-2]
    again = final["usage"]["hicache_edit_reuse"]  # (message_delta's: the edited turn's KV hit, or reused again)
    assert final["type"] == "message_delta"
    assert again["reused_tokens"] + again["approximate_hit_tokens"] > 0.7 * len(edited)

    original, edited = prompts(6)  # (the edited Messages turn left its KV for its conversation's next turn)
    turn = dict(model=NAME, input="Go.", max_output_tokens=4, temperature=0, store=False)
    client.responses.create(instructions=original, **turn)
    response = client.responses.create(instructions=edited, **turn)
    details = response.usage.input_tokens_details
    assert details.model_extra["reused_tokens"] == response.usage.model_extra["hicache_edit_reuse"]["reused_tokens"]
    assert details.model_extra["reused_tokens"] > 0 and details.cached_tokens <= EXACT_AT_MOST


def test_a_server_without_the_flag_refuses_edit_reuse_true_naming_the_field() -> None:
    with serving("random:tiny", "tiny") as srv:
        chat_body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi."}]}
        plain = post(srv, "/v1/chat/completions", chat_body).json()["usage"]
        assert "reused_tokens" not in plain["prompt_tokens_details"] and "hicache_edit_reuse" not in plain
        refused = post(srv, "/v1/chat/completions", {**chat_body, "edit_reuse": True})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "edit_reuse"
        assert "--enable-edit-reuse" in refused.json()["error"]["message"]
        native = post(srv, "/generate", {"text": "Hi.", "sampling_params": {"edit_reuse": True}})
        assert native.status_code == 400 and native.json()["error"]["param"] == "sampling_params.edit_reuse"
        top_level = post(srv, "/generate", {"text": "Hi.", "edit_reuse": True})  # (/generate takes it there too)
        assert top_level.status_code == 400 and top_level.json()["error"]["param"] == "edit_reuse"
        messages = post(srv, "/v1/messages", {**chat_body, "edit_reuse": True})
        assert messages.status_code == 400 and "edit_reuse" in messages.json()["error"]["message"]
        responses = post(srv, "/v1/responses", {"model": "tiny", "input": "Hi.", "edit_reuse": True})
        assert responses.status_code == 400 and responses.json()["error"]["param"] == "edit_reuse"
        wrong = post(srv, "/v1/chat/completions", {**chat_body, "edit_reuse": "yes"})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "edit_reuse"
        # false is always accepted: it asks for what the server does anyway
        assert post(srv, "/v1/chat/completions", {**chat_body, "edit_reuse": False}).status_code == 200
        assert scrape(srv) == {} and "edit_reuse" not in httpx.get(srv.base_url + "/stats").json()


def test_several_prompts_and_choices_count_each_prompt_once(client) -> None:
    original, edited = prompts(7)
    client.completions.create(model=NAME, prompt=original, max_tokens=1)
    one = client.completions.create(model=NAME, prompt=edited, max_tokens=1).usage.prompt_tokens_details
    pairs = [prompts(8), prompts(9)]  # (the same lengths: each reuses as many tokens as the one above)
    client.completions.create(model=NAME, prompt=[o for o, _ in pairs], max_tokens=1)
    both = client.completions.create(model=NAME, prompt=[e for _, e in pairs], max_tokens=2, n=2,
                                     temperature=1, seed=5).usage
    outcome = both.model_extra["hicache_edit_reuse"]
    assert both.prompt_tokens_details.model_extra["reused_tokens"] == outcome["reused_tokens"]
    assert outcome["reused_tokens"] == 2 * one.model_extra["reused_tokens"] > 0 and not outcome["gated"]
