"""The HTTP fuzz campaign (issue 46, item 6; issue 56): for a stated number of seconds, from a
stated seed, and on until each grammar bomb was sent and each agent API route tried (at most
60 s), hostile clients send grammar bombs and mutations of every request field of chat,
completions and ``/generate`` (schemas, regexes, tools, sampling fields, token ids, sizes, types)
while a probe client sends a plain 8-token chat every 0.2 s. The agent APIs take part: the
Messages API (and its ``count_tokens``) and the Responses API get extreme fields, nested fields of
every shape (``text.format``, ``metadata``, stop sequences, function schemas forced or not),
malformed blocks and items, forced calls of a bomb schema and guessed previous responses. Every
answer is an answer (no 500, no dead engine), the probe is never stalled, and afterwards the
server is healthy, holds no request, page or grammar, and its RSS grew by less than a stated
bound. Prints what it tried, by kind and by route.

``HICACHE_HTTP_FUZZ_SECONDS`` (default 8, at most 60) and ``HICACHE_HTTP_FUZZ_SEED`` replay it.
Later API routes join it (their own bodies in tests/hostile_requests.py)."""

from __future__ import annotations

import os
import statistics
import threading
import time

import httpx
import psutil
import pytest

from hicache import Engine
from hicache.server.serve import ServerThread
from hostile_requests import AGENT_ROUTES, BOMBS, RequestFuzzer

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.serial]  # (serial: it times replies)

FUZZ_SECONDS = min(float(os.environ.get("HICACHE_HTTP_FUZZ_SECONDS", "8")), 60.0)
FUZZ_SEED = int(os.environ.get("HICACHE_HTTP_FUZZ_SEED", "46"))
MODEL = "tiny"
CLIENTS = 3
ANSWERS = {200, 400, 404, 413, 422, 503}  # 503: only server_overloaded (never engine_dead)
RSS_GROWTH_BOUND = 512 << 20  # the server's process; the grammar checker's memory is its own
AGENT_REQUESTS = 100  # per client, in the agent APIs' campaign of their own
PROBE_STALL_BOUND_S = 10.0  # a stall detector (the bombs stalled every client 27 s), not a benchmark


def send(c: httpx.Client, kind: str, route: str, body: dict, outcomes: dict[str, int], routes: dict[str, int],
         unexpected: list[str]) -> None:
    """Send one hostile request; count its route and its answer (status and error code), and note
    any answer that is not one (:data:`ANSWERS`; a 503 only for being overloaded)."""
    routes[route] = routes.get(route, 0) + 1
    try:
        r = c.post(route, json=body)
    except httpx.HTTPError as e:
        unexpected.append(f"{kind} {route}: {type(e).__name__} {e}")
        return
    error = r.json().get("error", {}) if r.status_code != 200 else {}
    code = error.get("code") or error.get("type", "")  # (the Messages API's errors: Anthropic's shape)
    answer = f"{r.status_code}{' ' + code if code else ''}"
    outcomes[answer] = outcomes.get(answer, 0) + 1
    if r.status_code not in ANSWERS or (r.status_code == 503 and code not in ("server_overloaded", "overloaded_error")):
        unexpected.append(f"{kind} {route} -> {r.status_code} {r.text[:300]}")


def test_the_server_survives_a_seeded_http_fuzz_campaign() -> None:
    engine = Engine("random:tiny", dtype="float32", max_total_tokens=16384)
    # (a reply whose max a mutation dropped would run to the context end: 4K decode steps holding a client)
    srv = ServerThread(engine, served_model_name=MODEL, default_max_tokens=64)
    url = srv.start()
    proc = psutil.Process()
    rss_before = proc.memory_info().rss
    stop = threading.Event()
    fuzzers = [RequestFuzzer(FUZZ_SEED + i, engine.vocab_size, MODEL) for i in range(CLIENTS)]
    outcomes: dict[str, int] = {}
    routes: dict[str, int] = {}
    unexpected: list[str] = []
    probe_s: list[float] = []

    def hostile(fuzzer: RequestFuzzer) -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            while not stop.is_set():
                send(c, *fuzzer.next(), outcomes, routes, unexpected)

    def probe() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8,
                "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=120) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                r = c.post("/v1/chat/completions", json=body)
                probe_s.append(time.monotonic() - t0)
                if r.status_code != 200:
                    unexpected.append(f"probe -> {r.status_code} {r.text[:300]}")
                stop.wait(max(0.0, 0.2 - probe_s[-1]))

    threads = [threading.Thread(target=hostile, args=(f,)) for f in fuzzers] + [threading.Thread(target=probe)]
    t_start = time.monotonic()
    try:
        for t in threads:
            t.start()
        def every_bomb_sent() -> bool:  # (and every agent API route)
            return all(any(f.tried.get(f"bomb: {name}") for f in fuzzers) for name in BOMBS) and \
                all(routes.get(r) for r in AGENT_ROUTES)

        while (time.monotonic() < t_start + FUZZ_SECONDS or not every_bomb_sent()) and time.monotonic() < t_start + 60:
            stop.wait(0.2)
        stop.set()
        for t in threads:
            t.join(180)
        tried: dict[str, int] = {}
        for f in fuzzers:
            for k, v in f.tried.items():
                tried[k] = tried.get(k, 0) + v
        print(f"\nHTTP fuzz: {time.monotonic() - t_start:.0f} s, seed {FUZZ_SEED}, {CLIENTS} clients: tried "
              f"{dict(sorted(tried.items()))}; routes {dict(sorted(routes.items()))}; answers "
              f"{dict(sorted(outcomes.items()))}; probe {len(probe_s)} requests, "
              f"median {statistics.median(probe_s):.3f} s, worst {max(probe_s):.3f} s; grammar checker "
              f"{engine._vetter.counts if engine._vetter else {}}; RSS {rss_before >> 20} -> "
              f"{proc.memory_info().rss >> 20} MiB")
        assert not unexpected, unexpected[:5]
        assert sum(tried.values()) > 20 and every_bomb_sent(), (tried, routes)
        assert max(probe_s) < PROBE_STALL_BOUND_S
        # Nothing is left behind: no request, no page held for one, no grammar request admitted.
        deadline = time.monotonic() + 30
        while srv.loop.num_inflight and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        stats = httpx.get(url + "/stats", timeout=10).json()
        assert stats["running_requests"] == stats["waiting_requests"] == 0
        assert stats["device_pool"]["locked_pages"] == stats["device_pool"]["request_pages"] == 0, stats["device_pool"]
        grammar = stats.get("grammar", {})
        assert grammar.get("admitted", 0) == 0 and grammar.get("admitted_mask_us", 0) == 0, grammar
        assert grammar.get("held_bytes", 0) <= grammar.get("budget_bytes", 0)
        assert proc.memory_info().rss - rss_before < RSS_GROWTH_BOUND
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 4, "regex": "[a-z]{4}"}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["message"]["content"]) == 4
    finally:
        stop.set()
        srv.stop()
        engine.shutdown()


def test_the_agent_apis_survive_a_campaign_of_their_own() -> None:
    """The Messages (and count_tokens) and Responses surfaces alone (issue 56): AGENT_REQUESTS hostile
    bodies per client, each answered 200 or a 4xx, never a 5xx; then the server is healthy, holds no
    request, and its Responses store keeps within its budget."""
    engine = Engine("random:tiny", dtype="float32", max_total_tokens=16384)
    srv = ServerThread(engine, served_model_name=MODEL)
    url = srv.start()
    fuzzers = [RequestFuzzer(FUZZ_SEED + i, engine.vocab_size, MODEL, kinds=("agent APIs",)) for i in range(CLIENTS)]
    outcomes: dict[str, int] = {}
    routes: dict[str, int] = {}
    unexpected: list[str] = []

    def hostile(fuzzer: RequestFuzzer) -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            for _ in range(AGENT_REQUESTS):
                send(c, *fuzzer.next(), outcomes, routes, unexpected)

    threads = [threading.Thread(target=hostile, args=(f,)) for f in fuzzers]
    t_start = time.monotonic()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        store = httpx.get(url + "/stats", timeout=10).json()["responses"]
        print(f"\nagent API fuzz: {time.monotonic() - t_start:.0f} s, seed {FUZZ_SEED}, {CLIENTS} clients x "
              f"{AGENT_REQUESTS}: routes {dict(sorted(routes.items()))}; answers {dict(sorted(outcomes.items()))}; "
              f"store {store['stored']} responses, {store['stored_bytes']} bytes")
        assert not unexpected, unexpected[:5]
        assert all(routes.get(r) for r in AGENT_ROUTES), routes
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        stats = httpx.get(url + "/stats", timeout=10).json()
        assert stats["running_requests"] == stats["waiting_requests"] == 0
        assert store["stored_bytes"] <= store["store_max_bytes"]
    finally:
        srv.stop()
        engine.shutdown()


def test_every_bomb_is_a_one_sentence_answer() -> None:
    """Each bomb of the catalogue once, alone: refused with a 400 naming its field, or served (a
    bomb the engine can run), or ended with 422 grammar_failed; never anything else."""
    engine = Engine("random:tiny", dtype="float32", max_total_tokens=16384)
    srv = ServerThread(engine, served_model_name=MODEL)
    url = srv.start()
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            answers = {}
            for name, bomb in BOMBS.items():
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 80,
                        "temperature": 0, **bomb(0)}
                r = c.post("/v1/chat/completions", json=body)
                answers[name] = r.status_code
                assert r.status_code in (200, 400, 422), (name, r.text[:300])
                if r.status_code != 200:
                    err = r.json()["error"]
                    assert err["message"].endswith(".") and "\n" not in err["message"], (name, err)
                    assert err["param"] in ("regex", "ebnf", "response_format", "tools", "messages", None), (name, err)
            print(f"\nbombs: {answers}")
    finally:
        srv.stop()
        engine.shutdown()
