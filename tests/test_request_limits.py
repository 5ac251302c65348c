"""What a client may ask, checked at the door (issue 46, items 1 and 5): every token id a request
names is within the vocabulary (one check, a 400 naming the field on every endpoint), answers
with logprobs are bounded, counts are checked before anything is tokenized, ``logit_bias`` keys
are decimal token ids, empty grammars are 400s, and an empty API key refuses to start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from live_server import serving

from hicache.runtime.sampling import MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS


pytestmark = pytest.mark.server

SRC = str(Path(__file__).resolve().parents[1] / "src")
MODEL = "tiny"
MAX_LOGPROBS = 5
MAX_LOGPROB_TOKENS = 64


@pytest.fixture(scope="module")
def server():
    with serving(max_total_tokens=8192, max_logprobs=MAX_LOGPROBS, server={"max_logprob_tokens": MAX_LOGPROB_TOKENS}) as srv:
        yield srv


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        yield c


@pytest.fixture()
def vocab(server) -> int:
    return server.loop.engine.vocab_size


def chat(**kw) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 3, **kw}


def completion(**kw) -> tuple[str, dict]:
    return "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3, **kw}


def generate(sampling: dict | None = None, **kw) -> tuple[str, dict]:
    return "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 3, **(sampling or {})}, **kw}


def refused(http: httpx.Client, route: tuple[str, dict], param: str) -> str:
    """The request is a one-sentence 400 naming ``param``, and the engine still serves."""
    r = http.post(route[0], json=route[1])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_value", err
    assert err["message"].endswith(".") and "\n" not in err["message"]
    ok = http.post("/v1/completions", json=completion(temperature=0, ignore_eos=True)[1])
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    return err["message"]


def test_a_min_tokens_past_the_room_a_default_max_leaves_is_a_400(server, http) -> None:
    """Without max_tokens a chat reply may take the rest of the context after its prompt: a min_tokens
    beyond that room (but within the context) is refused as it is beyond an explicit max_tokens, not
    run to the room's end."""
    route = chat(min_tokens=server.loop.engine.context_length - 1)  # the templated prompt is longer than 1
    del route[1]["max_tokens"]
    assert "min_tokens" in refused(http, route, "min_tokens")
    assert "min_tokens" in refused(http, chat(min_tokens=4), "min_tokens")  # past an explicit max_tokens 3


@pytest.mark.parametrize("bad", ["vocab", 2**70, -1])
def test_stop_token_ids_out_of_the_vocabulary_are_400s_on_every_endpoint(http, vocab, bad) -> None:
    """Before: min_tokens + stop_token_ids [1000000] raised IndexError on the scheduler thread (engine
    dead, server exited); a negative id silently banned the last vocabulary id."""
    tok = vocab if bad == "vocab" else bad
    assert f"got {tok}" in refused(http, chat(min_tokens=2, stop_token_ids=[5, tok]), "stop_token_ids")
    refused(http, completion(min_tokens=2, stop_token_ids=[tok]), "stop_token_ids")
    refused(http, generate({"min_new_tokens": 2, "stop_token_ids": [tok]}), "sampling_params.stop_token_ids")


def test_stop_strings_are_bounded_in_count_and_bytes_on_every_endpoint(http) -> None:
    """Before: unbounded, and each token searched the text once per stop string (500,000 of them: 1.7 s
    of scheduler time a token, and six such requests slowed every client 5x). Issue 56, S2."""
    many, long = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], "é" * (MAX_STOP_STRING_BYTES // 2 + 1)
    assert f"at most {MAX_STOP_STRINGS} stop strings" in refused(http, chat(stop=many), "stop")
    assert f"at most {MAX_STOP_STRING_BYTES} bytes" in refused(http, completion(stop=long), "stop")
    refused(http, generate({"stop": many}), "sampling_params.stop")
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 3, "stop_sequences": many,
                                        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("at most"), r.text
    at_limit = ["é" * (MAX_STOP_STRING_BYTES // 2 - 1) + f"{i:02x}" for i in range(MAX_STOP_STRINGS)]
    assert http.post("/v1/chat/completions", json=chat(stop=at_limit)[1]).status_code == 200


def test_prompt_and_logit_bias_ids_use_the_same_check(http, vocab) -> None:
    for ids in ([1, vocab], [-1, 2], [2**70]):
        refused(http, completion(prompt=ids), "prompt")
        refused(http, generate(text=None, input_ids=ids), "input_ids")
    refused(http, completion(logit_bias={str(vocab): 1}), "logit_bias")
    refused(http, generate({"logit_bias": {str(vocab): 1}}), "sampling_params.logit_bias")
    assert http.post("/v1/completions", json=completion(prompt=[1, vocab - 1])[1]).status_code == 200


@pytest.mark.parametrize("key", [" 5_0 ", "5_0", "+5", "-1", "0x10", "\u0665", "5.0", ""])
def test_logit_bias_keys_must_be_decimal_token_ids(http, key) -> None:
    """``int()`` took " 5_0 " as 50 and the Arabic-Indic digit as 5."""
    assert repr(key) in refused(http, chat(logit_bias={key: 1}), "logit_bias")
    refused(http, generate({"logit_bias": {key: 1}}), "sampling_params.logit_bias")


def test_logit_bias_with_decimal_keys_applies(http) -> None:
    body = completion(temperature=0, ignore_eos=True, logit_bias={"65": 100})[1]
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and set(r.json()["choices"][0]["text"]) == {"A"}  # byte-level: id 65 is "A"


@pytest.mark.parametrize("field", ["regex", "ebnf"])
def test_empty_grammars_are_400s(http, field) -> None:
    """Before: 500 internal_error (AttributeError)."""
    assert "non-empty" in refused(http, chat(**{field: ""}), field)
    refused(http, completion(**{field: ""}), field)
    refused(http, generate({field: ""}), f"sampling_params.{field}")


def test_top_logprobs_bounded_by_max_logprobs(http) -> None:
    msg = refused(http, chat(logprobs=True, top_logprobs=MAX_LOGPROBS + 1), "top_logprobs")
    assert "--max-logprobs" in msg
    refused(http, completion(logprobs=MAX_LOGPROBS + 1), "logprobs")
    refused(http, generate(return_logprob=True, top_logprobs_num=MAX_LOGPROBS + 1), "top_logprobs_num")
    r = http.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=MAX_LOGPROBS)[1])
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == MAX_LOGPROBS


def test_a_non_streamed_answer_with_logprobs_is_bounded(http) -> None:
    """n x max_tokens of a non-streamed answer with logprobs is capped (--max-logprob-tokens);
    streamed, or without logprobs, the same request is served."""
    n, max_tokens = 4, MAX_LOGPROB_TOKENS // 4 + 1
    msg = refused(http, chat(n=n, max_tokens=max_tokens, logprobs=True, top_logprobs=2), "max_tokens")
    assert "--max-logprob-tokens" in msg and str(n * max_tokens) in msg
    refused(http, completion(prompt=["a", "b"], n=2, max_tokens=max_tokens, logprobs=1), "max_tokens")
    refused(http, generate({"max_new_tokens": MAX_LOGPROB_TOKENS + 1}, return_logprob=True),
            "sampling_params.max_new_tokens")
    for body in (chat(n=n, max_tokens=max_tokens, ignore_eos=True)[1],
                 chat(n=n, max_tokens=max_tokens, logprobs=True, top_logprobs=2, stream=True, ignore_eos=True)[1]):
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text


def test_counts_are_checked_before_the_prompts_are_tokenized(server, http, monkeypatch) -> None:
    """10,000 prompts: the choice count refuses them (400 naming n) before any is tokenized."""
    tokenizer = server.loop.engine.tokenizer
    encoded: list[str] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **kw: encoded.append(text) or encode(text, *a, **kw))
    r = http.post("/v1/completions", json=completion(prompt=["some words to tokenize " * 20] * 10_000)[1])
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "n" and "10000" in err["message"], err
    assert encoded == []


@pytest.mark.parametrize("argv, env", [(["--api-key", ""], {}), (["--api-key", "  "], {}),
                                       ([], {"HICACHE_API_KEY": ""})])
def test_an_empty_api_key_refuses_to_start(argv, env) -> None:
    """Before: an unset variable (``--api-key "$KEY"``) served without authentication, silently."""
    proc = subprocess.run([sys.executable, "-m", "hicache.cli", "serve", "--model", "random:tiny", *argv],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": SRC, **env})
    assert proc.returncode == 2 and "is empty" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
