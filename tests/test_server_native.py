"""SGLang's native API on a tiny random model, in-process: ``POST /generate`` (text and
input_ids, streamed with cumulative text and not, meta_info, cached tokens, refusals) and
``GET /v1/models/{id}``."""

from __future__ import annotations

import json
import re

import httpx
import pytest

pytestmark = pytest.mark.server

MODEL = "tiny"
PROMPT = "Native generate: the prefix cache keeps pages of earlier prompts. " * 3


def generate(server, **body) -> httpx.Response:
    return httpx.post(server.base_url + "/generate", json=body, timeout=60)


def stream(server, **body) -> list[dict]:
    """The chunks of a streamed /generate; asserts it ends with [DONE]."""
    lines = []
    with httpx.stream("POST", server.base_url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def test_generate_text_answers_sglang_shape(server) -> None:
    r = generate(server, text=PROMPT, sampling_params=GREEDY, rid="req-1")
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"} and isinstance(out["text"], str)
    meta = out["meta_info"]
    assert meta["id"] == "req-1" and meta["completion_tokens"] == 12 == len(out["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0
    assert set(meta["cached_tokens_details"]) >= {"device", "host", "storage"}
    assert meta["timing"]["ttft_s"] > 0  # hicache's extension


def test_input_ids_give_the_same_answer_as_text(server) -> None:
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT, "return_ids": True}).json()["tokens"][0]
    by_text = generate(server, text=PROMPT, sampling_params=GREEDY).json()
    by_ids = generate(server, input_ids=ids, sampling_params=GREEDY).json()
    assert by_ids["output_ids"] == by_text["output_ids"] and by_ids["text"] == by_text["text"]
    assert by_ids["meta_info"]["prompt_tokens"] == len(ids)


def test_repeated_prompt_reports_cached_tokens(server) -> None:
    prompt = "A prompt sent twice so that its pages are cached the second time. " * 4
    generate(server, text=prompt, sampling_params=GREEDY)
    meta = generate(server, text=prompt, sampling_params=GREEDY).json()["meta_info"]
    assert 0 < meta["cached_tokens"] < meta["prompt_tokens"]
    assert sum(meta["cached_tokens_details"].values()) == meta["cached_tokens"]


@pytest.mark.parametrize("prompt", ["text", "input_ids"])
def test_stream_carries_cumulative_text(server, prompt) -> None:
    body = {"text": PROMPT} if prompt == "text" else {"input_ids": list(range(5, 60))}
    full = generate(server, sampling_params=GREEDY, **body).json()
    chunks = stream(server, sampling_params=GREEDY, **body)
    texts = [c["text"] for c in chunks]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))  # cumulative
    assert texts[-1] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert "cached_tokens" in chunks[-1]["meta_info"]


def test_stop_token_is_the_matched_finish_reason(server) -> None:
    first = generate(server, text=PROMPT, sampling_params=GREEDY).json()["output_ids"]
    stop_at = first[3]
    out = generate(server, text=PROMPT, sampling_params={**GREEDY, "stop_token_ids": [stop_at]}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert out["output_ids"][-1] == stop_at and len(out["output_ids"]) <= 4


def test_nulls_and_sglang_extras_take_defaults(server) -> None:
    # What bench_serving sends: nulls and SGLang extras hicache does not need.
    r = generate(server, text="hi", sampling_params={"max_new_tokens": 3, "temperature": None, "top_p": None,
                                                      "ignore_eos": True, "n": 1, "min_new_tokens": 0},
                 stream=False, lora_path=None, return_logprob=False, logprob_start_len=-1)
    assert r.status_code == 200, r.text
    r = generate(server, text="hi", sampling_params={"max_new_tokens": 3, "ignore_eos": True},
                 lora_path="", return_logprob=False)  # what bench_multiturn.py sends
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 3
    assert generate(server, text="hi").json()["meta_info"]["completion_tokens"] <= 128  # SGLang's default


@pytest.mark.parametrize("body,param", [
    ({"text": "x", "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
    ({"text": "x", "sampling_params": {"regex": "a+", "ebnf": "root ::= \"a\""}}, "sampling_params"),
    ({"text": "x", "sampling_params": {"n": 2}}, "sampling_params.n"),
    ({"text": "x", "sampling_params": {"beam_width": 2}}, "sampling_params.beam_width"),
    ({"text": "x", "sampling_params": {"frequency_penalty": 2.5}}, "sampling_params.frequency_penalty"),
    ({"text": "x", "sampling_params": {"stop_token_ids": [49152], "min_new_tokens": 2}},
     "sampling_params.stop_token_ids"),
    ({"text": "x", "sampling_params": {"logit_bias": {"-1": 1}}}, "sampling_params.logit_bias"),
    ({"input_ids": [1, -1]}, "input_ids"),
    ({"input_ids": [1, 2**70]}, "input_ids"),
    ({"text": "x", "sampling_params": {"logit_bias": {"a": 1}}}, "sampling_params.logit_bias"),
    ({"text": ["a", "b"]}, "text"),
    ({"input_ids": [[1, 2], [3]]}, "input_ids"),
    ({"text": "x", "sampling_params": [{}, {}]}, "sampling_params"),
    ({"text": "x", "input_ids": [1]}, "text"),
    ({}, "text"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({"text": "x", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"text": "x", "bootstrap_host": "127.0.0.1"}, "bootstrap_room"),
])
def test_refusals_are_one_sentence_400s(server, body, param) -> None:
    r = generate(server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].endswith(".") and "\n" not in err["message"]
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_model_by_id(server) -> None:
    card = httpx.get(server.base_url + f"/v1/models/{MODEL}").json()
    listed = httpx.get(server.base_url + "/v1/models").json()["data"][0]
    assert card == listed and card["id"] == MODEL and card["object"] == "model"
    r = httpx.get(server.base_url + "/v1/models/other-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_model_and_server_info_have_what_bench_serving_reads(server) -> None:
    info = httpx.get(server.base_url + "/get_model_info").json()
    assert info["is_generation"] is True and info["tokenizer_path"] is None  # no HF directory to load
    server_info = httpx.get(server.base_url + "/get_server_info").json()
    assert isinstance(server_info["internal_states"], list) and server_info["internal_states"]


@pytest.mark.pd
@pytest.mark.slow
def test_sglang_router_serves_generate_through_a_pd_pair() -> None:
    """sglang-router's /generate route in PD mode adds the bootstrap fields and sends the body to
    both servers; the answer is the decode server's, as one engine would give it."""
    from hicache import Engine
    from hicache.launch.servers import pd_servers
    from hicache.runtime.sampling import GrammarSpec, SamplingParams

    model = "random:small"
    engine = Engine(model, dtype="float32", page_size=16)
    sampling = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    want = engine.generate("Trips: Lisbon, Porto and Faro. " * 6, sampling)[0].output_ids
    # a grammar and a penalty act on both servers: the first token is sampled on the prefill one
    cities = "(Lisbon|Porto|Faro)(, (Lisbon|Porto|Faro)){2,6}"
    constrained = SamplingParams(max_new_tokens=48, temperature=0, grammar=GrammarSpec("regex", cities),
                                 frequency_penalty=0.5)
    want_constrained = engine.generate("Trips: Lisbon, Porto and Faro. " * 6, constrained)[0]
    engine.shutdown()
    common = f"--model {model} --dtype float32 --page-size 16 --max-total-tokens 2048"
    with pd_servers(common) as pd:
        body = {"text": "Trips: Lisbon, Porto and Faro. " * 6, "sampling_params": GREEDY | {"max_new_tokens": 8}}
        out = httpx.post(f"{pd.url}/generate", json=body, timeout=60).json()
        assert out["output_ids"] == want, out
        meta = out["meta_info"]
        assert meta["kv_transferred_tokens"] + meta["decode_prefix_len"] == meta["prompt_tokens"]
        streamed = [json.loads(ln[6:]) for ln in httpx.post(f"{pd.url}/generate", json={**body, "stream": True},
                                                              timeout=60).text.splitlines()
                    if ln.startswith("data: {")]
        assert streamed[-1]["text"] == out["text"]
        body["sampling_params"] = {"max_new_tokens": 48, "temperature": 0, "regex": cities, "frequency_penalty": 0.5}
        out = httpx.post(f"{pd.url}/generate", json=body, timeout=60).json()
        assert out["output_ids"] == want_constrained.output_ids and re.fullmatch(cities, out["text"]), out
