"""The OpenAI-compatible server on a tiny random model, in-process (uvicorn in a thread):
the `openai` client, streaming, cached-token usage, errors, disconnects, /metrics, /flush_cache."""

from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest

from hicache import HicacheError

pytestmark = pytest.mark.server

MODEL = "tiny"
SYSTEM = "You are a terse assistant who answers in one line. " * 4


def stats(server) -> dict:
    return httpx.get(server.base_url + "/stats").json()


def scrape(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        m = re.match(r"^(hicache_\w+)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def wait_idle(server, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(server)
        if s["inflight_requests"] == 0 and s["device_pool"]["request_pages"] == 0:
            return s
        assert time.monotonic() < deadline, f"server not idle: {s}"
        time.sleep(0.05)


def test_chat_usage_reports_cached_tokens(client) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a cache?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert first.object == "chat.completion" and first.choices[0].message.role == "assistant"
    assert second.choices[0].message.content == first.choices[0].message.content  # greedy, hit or not
    u = second.usage
    assert u.prompt_tokens == first.usage.prompt_tokens and u.total_tokens == u.prompt_tokens + u.completion_tokens
    cached = u.prompt_tokens_details.cached_tokens
    assert 0 < cached < u.prompt_tokens
    details = u.prompt_tokens_details.model_extra["cached_tokens_details"]
    assert set(details) >= {"device", "host", "storage"} and sum(details.values()) == cached
    assert u.model_extra["hicache_cached_tokens"] == details  # the name proxies (litellm) keep


def test_streaming_matches_non_streaming(client) -> None:
    kw = dict(model=MODEL, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    messages = [{"role": "user", "content": "Count to five."}]
    full = client.chat.completions.create(messages=messages, **kw)
    chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0

    comp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert comp.object == "text_completion" and comp.usage.completion_tokens == 10
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == comp.choices[0].text
    assert client.models.list().data[0].id == MODEL


def test_errors_are_openai_shaped_and_server_keeps_serving(server, client) -> None:
    url = server.base_url

    def post(path: str, **kw) -> tuple[int, dict]:
        r = httpx.post(url + path, **kw)
        return r.status_code, r.json()["error"]

    status, err = post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [')
    assert status == 400 and err["message"].startswith("the request body is not valid JSON") and err["code"] == "invalid_json"
    status, err = post("/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
    assert status == 404 and err["code"] == "model_not_found" and "gpt-9" in err["message"] and err["param"] == "model"
    status, err = post("/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": -1})
    assert status == 400 and err["param"] == "temperature" and err["type"] == "invalid_request_error"
    status, err = post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0})
    assert status == 400 and err["message"] == "n must be at least 1, got 0." and err["param"] == "n"
    status, err = post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert status == 400 and err["param"] == "max_tokens"
    status, err = post("/v1/completions", json={"model": MODEL, "prompt": "y" * 5000})
    assert status == 400 and err["code"] == "context_length_exceeded" and "context length is 4096" in err["message"]
    status, err = post("/v1/chat/completions", json={"model": MODEL})
    assert status == 400 and err["message"] == "messages: Field required." and err["param"] == "messages"
    status, err = post("/v1/nothing", json={})
    assert status == 404 and err["message"] == "no such endpoint."

    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])

    state = server.app.state.hicache
    saved, state.max_inflight = state.max_inflight, 0
    try:
        status, err = post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert status == 503 and err["code"] == "server_overloaded" and "overloaded" in err["message"]
    finally:
        state.max_inflight = saved

    ok = client.completions.create(model=MODEL, prompt="still here?", max_tokens=3, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3
    wait_idle(server)


def test_generate_refused_while_loop_drives_engine(server) -> None:
    with pytest.raises(HicacheError, match="EngineLoop"):
        server.loop.engine.generate("hello")


def _start_long_stream(url: str, got_first: threading.Event, stop: threading.Event) -> threading.Thread:
    """A streaming request for 3000 tokens; closes its connection once ``stop`` is set."""
    def run() -> None:
        body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 3000, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    got_first.set()
                if stop.is_set():
                    break  # leaving the block closes the connection mid-stream
    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert got_first.wait(10)
    return t


def test_disconnect_mid_stream_frees_the_request(server) -> None:
    base = wait_idle(server)
    before = scrape(server)
    got_first, stop = threading.Event(), threading.Event()
    t = _start_long_stream(server.base_url, got_first, stop)
    busy = stats(server)
    assert busy["running_requests"] == 1 and busy["device_pool"]["request_pages"] > 0
    stop.set()
    t.join(10)
    idle = wait_idle(server, timeout=5)  # long before 3000 tokens could have been generated
    assert idle["running_requests"] == 0
    assert idle["device_pool"]["free_pages"] + idle["device_pool"]["cached_pages"] == base["device_pool"]["capacity_pages"]
    after = scrape(server)
    assert after['hicache_requests_total{finish_reason="abort"}'] == before.get('hicache_requests_total{finish_reason="abort"}', 0) + 1
    assert after["hicache_generation_tokens_total"] - before["hicache_generation_tokens_total"] < 3000

    # Non-streaming: the client gives up (timeout closes the connection); the server notices and aborts.
    body = {"model": MODEL, "prompt": "another long story", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=0.5)
    wait_idle(server, timeout=5)
    final = scrape(server)
    assert final['hicache_requests_total{finish_reason="abort"}'] == after['hicache_requests_total{finish_reason="abort"}'] + 1


def test_metrics_after_multi_turn_session(server, client) -> None:
    wait_idle(server)
    before = scrape(server)
    messages = [{"role": "system", "content": SYSTEM + " metrics"}]
    usages = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question number {turn}: why is the sky blue?"})
        res = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True})
        messages.append({"role": "assistant", "content": res.choices[0].message.content})
        usages.append(res.usage)
    after = scrape(server)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("hicache_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("hicache_generation_tokens_total") == 18
    assert delta('hicache_cached_tokens_total{tier="device"}') == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert usages[1].prompt_tokens_details.cached_tokens > 0 and usages[2].prompt_tokens_details.cached_tokens > 0
    assert delta('hicache_requests_total{finish_reason="length"}') == 3
    assert delta("hicache_time_to_first_token_seconds_count") == 3
    assert delta("hicache_e2e_request_latency_seconds_count") == 3
    assert after['hicache_pool_usage_ratio{pool="device"}'] > 0
    assert after["hicache_num_running_requests"] == 0 and after["hicache_cache_hit_rate"] > 0


def test_flush_cache_refused_while_busy_then_empties(server) -> None:
    url = server.base_url
    wait_idle(server)
    got_first, stop = threading.Event(), threading.Event()
    t = _start_long_stream(url, got_first, stop)
    r = httpx.post(url + "/flush_cache")
    assert r.status_code == 400 and r.json()["error"]["code"] == "server_busy"
    assert "cannot flush the cache while 1 request(s) are running" in r.json()["error"]["message"]
    stop.set()
    t.join(10)
    r = httpx.post(url + "/flush_cache", params={"timeout": 5})  # waits for the abort to land
    assert r.status_code == 200 and r.json()["flushed"] is True
    pool = stats(server)["device_pool"]
    assert pool["cached_pages"] == 0 and pool["free_pages"] == pool["capacity_pages"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
