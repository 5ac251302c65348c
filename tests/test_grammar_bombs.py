"""Untrusted grammars (issue 46, items 2 and 3): a grammar that crashes, stalls or bloats the
compiler is refused with a one-sentence 400 from the contained grammar checker and the server
stays healthy; what the engine admits stays within its grammar budgets (requests wait, never
over-commit); a grammar that fails mid-request ends it with an error the client sees, never a
200 whose output breaks it."""

from __future__ import annotations

import json
import re

import httpx
import psutil
import pytest
from live_server import serving

from hicache import Engine, SamplingParams
from hicache.errors import InvalidRequestError
from hicache.runtime.sampling import GrammarSpec
from hicache.server.tool_formats import HERMES

pytestmark = [pytest.mark.server, pytest.mark.serial]  # (serial: it times the server)

MODEL = "tiny"
SLOW_TO_COMPILE = "(a{1000}){1000}"  # ~1 s to its first mask, then its lexer runs out of expressions
BIG = "(a{300}){300}"  # ~40 MB of matcher, masks of ~30 ms (measured by the checker)
# passes the checker's 16-token walk; its lexer runs out of expressions at output character 65
FAILS_LATER = "[a-z]{64}(b{1000}){1000}"


def ref_chain(n: int = 2500, at: str = "#") -> dict:
    """A JSON schema of ``n`` chained ``$ref``s (~88 KB, nesting 6): before, SIGSEGV in the compiler.
    ``at``: where the schema sits in the document its pointers resolve in."""
    defs = {f"d{i}": {"$ref": f"{at}/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": f"{at}/$defs/d0"}


@pytest.fixture(scope="module")
def server():
    with serving(max_total_tokens=8192, grammar_compile_timeout=3.0) as srv:
        yield srv


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0, **kw}


def refused(r: httpx.Response, param: str, says: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    assert err["message"].endswith(".") and "\n" not in err["message"] and len(err["message"]) < 600


def assert_healthy(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/chat/completions", json=chat(regex="[a-z]{3}"))  # grammars still work
    assert r.status_code == 200 and re.fullmatch("[a-z]{3}", r.json()["choices"][0]["message"]["content"]), r.text


def test_a_schema_that_crashes_the_compiler_is_a_400(server, http) -> None:
    schema = ref_chain()
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    refused(http.post("/v1/chat/completions", json=body), "response_format", "crashed the grammar compiler")
    r = http.post("/generate", json={"text": "hi", "sampling_params": {"json_schema": json.dumps(schema)}})
    refused(r, "sampling_params.json_schema", "crashed the grammar compiler")
    # A forced call of a tool with these parameters (over HTTP its description alone outgrows the
    # context, which is refused first): its Lark grammar embeds the schema.
    tool = ref_chain(at="#/properties/arguments")  # (the Hermes grammar puts the parameters there)
    forced = GrammarSpec("lark", HERMES.grammar({"f": tool}, ["f"], parallel=False, special_id=lambda _: None))
    with pytest.raises(InvalidRequestError, match="crashed the grammar compiler"):
        server.loop.engine.vet_grammar(forced).result()
    assert server.loop.engine._vetter.counts["crashed"] >= 2
    assert_healthy(http)


def test_a_runaway_compile_is_stopped_at_the_timeout(monkeypatch) -> None:
    # The wall-clock backstop (4x the CPU limit) is for a worker that cannot run at all; on a loaded 2-core
    # machine a check of 0.3 CPU-s can take longer than 1.2 s of wall time and be answered 503 instead.
    monkeypatch.setattr("hicache.runtime.grammar_process.WALL_FACTOR", 40.0)
    engine = Engine("random:tiny", dtype="float32", max_total_tokens=4096, grammar_compile_timeout=0.3)
    try:
        for _ in range(2):  # a refusal by time is never cached (issue 56): the second one is measured again
            with pytest.raises(InvalidRequestError, match=r"takes longer than 0.3 s to compile \(--grammar-compile-timeout\)"):
                engine.generate("hi", SamplingParams(max_new_tokens=4, grammar=GrammarSpec("regex", SLOW_TO_COMPILE)))
        assert engine._vetter.counts["timed_out"] == 2
        ok = engine.generate("hi", SamplingParams(max_new_tokens=4, temperature=0, grammar=GrammarSpec("regex", "x+")))
        assert ok[0].text == "xxxx"  # a new worker took over
    finally:
        engine.shutdown()


@pytest.mark.parametrize("budgets, says", [
    (dict(grammar_memory_budget_mb=16), r"needs \d+ MiB of matcher memory; this server allows 16 MiB"),
    (dict(grammar_mask_budget_ms=5), r"takes [\d.]+ ms a token to enforce; this server allows 5 ms"),
])
def test_grammar_budgets_refuse_what_cannot_fit_alone(budgets, says) -> None:
    engine = Engine("random:tiny", dtype="float32", max_total_tokens=4096, **budgets)
    try:
        with pytest.raises(InvalidRequestError, match=says):
            engine.check_grammar(SamplingParams(grammar=GrammarSpec("regex", BIG)))
    finally:
        engine.shutdown()


def test_a_bomb_with_n_32_is_one_400_and_costs_the_server_nothing(server, http) -> None:
    """Before: each of the 32 choices built its own matcher on the scheduler thread (~0.7 s and
    ~160 MB each): every client stalled 27 s, RSS 3.0 -> 7.2 GB."""
    rss = psutil.Process().memory_info().rss
    r = http.post("/v1/chat/completions", json=chat(regex=SLOW_TO_COMPILE, n=32, max_tokens=16))
    refused(r, "regex", "cannot be enforced")
    assert psutil.Process().memory_info().rss - rss < 64 << 20  # the compile's memory stayed in the checker
    assert_healthy(http)


def test_requests_wait_for_grammar_memory_and_never_over_commit() -> None:
    """Four grammars of ~5 MB of matcher each under a 12 MB budget: at most two templates are held
    at once (idle ones evicted), every request completes with output that matches its grammar."""
    engine = Engine("random:tiny", dtype="float32", max_total_tokens=8192, grammar_memory_budget_mb=12)
    try:
        regexes = [f"({c}{{100}}){{100}}" for c in "abcd"]
        sampling = [SamplingParams(max_new_tokens=6, temperature=0, grammar=GrammarSpec("regex", rx)) for rx in regexes]
        costs = [engine.check_grammar(sp).grammar.cost for sp in sampling]
        assert all(4 << 20 < c.template_bytes + c.request_bytes < 6 << 20 for c in costs), costs
        results = engine.generate(["hi"] * 4, sampling)
        for rx, res in zip(regexes, results):
            assert res.finish_reason == "length" and res.text == rx[1] * 6
        stats = engine.stats()["grammar"]
        assert 0 < stats["peak_held_bytes"] <= stats["budget_bytes"] == 12 << 20 and stats["evicted_templates"] >= 2
    finally:
        engine.shutdown()


def test_a_grammar_that_fails_mid_request_ends_it_with_an_error(server, http) -> None:
    """Before: the matcher failed mid-generation, the server logged "no longer constrains the
    request" and answered 200 with output that broke the grammar."""
    body = chat(regex=FAILS_LATER, max_tokens=120)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "grammar_failed" and "could not be enforced after 65 output tokens" in err["message"], err
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert events[-1]["error"]["code"] == "grammar_failed" and re.fullmatch("[a-z]{64}b?", text), (text, events[-1])
    r = http.post("/generate", json={"text": "hi", "sampling_params": {"regex": FAILS_LATER, "max_new_tokens": 120,
                                                                      "temperature": 0}})
    assert r.status_code == 422 and r.json()["error"]["code"] == "grammar_failed"
    assert http.get("/stats").json()["grammar"]["failed_requests"] >= 3
    assert_healthy(http)
