"""Sampling defaults for the fields a request leaves unset (SGLang's ``--sampling-defaults`` and
``--preferred-sampling-params``): the model's recommended values (a GGUF file's
``general.sampling.*`` keys, an HF folder's ``generation_config.json``) unless the server is told
``openai``; the preferred ones over the model's; a request's own value over both, in every API."""

from __future__ import annotations

import json

import httpx
import pytest

from gguf_edit import rewrite_gguf
from hicache.errors import ConfigError
from hicache.model.sampling_defaults import from_generation_config
from hicache.server.options import ServerOptions
from live_server import serving

pytestmark = pytest.mark.server

ASK = [{"role": "user", "content": "Say something."}]
# the model's authors recommend greedy decoding (temperature 0): an unset temperature gives one text
GREEDY_MODEL = {"general.sampling.temp": 0.0, "general.sampling.top_p": 0.8, "general.sampling.top_k": 20,
                "general.sampling.penalty_repeat": 1.1}


@pytest.fixture(scope="module")
def greedy_model(tmp_path_factory) -> str:
    return str(rewrite_gguf(tmp_path_factory.mktemp("gguf") / "greedy.gguf", kv=GREEDY_MODEL))


def _completions(srv, seeds, **fields) -> list[str]:
    out = []
    for seed in seeds:
        r = httpx.post(f"{srv.base_url}/v1/completions", json={"model": "tiny", "prompt": "Once upon a time",
                                                             "max_tokens": 12, "seed": seed, **fields}, timeout=60)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def test_the_model_recommended_values_fill_the_unset_fields(greedy_model) -> None:
    with serving(greedy_model) as srv:
        assert srv.loop.engine.tokenizer.sampling_defaults == {"temperature": 0.0, "top_p": 0.8, "top_k": 20,
                                                          "repetition_penalty": 1.1}
        unset = _completions(srv, (1, 2, 3))
        assert len(set(unset)) == 1 and unset == _completions(srv, (4,), temperature=0.0, top_p=0.8, top_k=20,
                                                              repetition_penalty=1.1) * 3
        sampled = _completions(srv, (1, 2, 3), temperature=1.0, top_p=1.0, top_k=-1)  # the request's own values
        assert len(set(sampled)) > 1
        base = srv.base_url
        native = [httpx.post(f"{base}/generate", json={"text": "Once upon a time", "sampling_params": {
            "max_new_tokens": 12, "sampling_seed": seed}}, timeout=60).json()["text"] for seed in (1, 2)]
        assert native[0] == native[1]
        # Messages and Responses carry no temperature of their own unless the client sends one
        messages = [httpx.post(f"{base}/v1/messages", json={"model": "tiny", "max_tokens": 12, "messages": ASK},
                               timeout=60).json()["content"][0]["text"] for _ in range(2)]
        assert messages[0] == messages[1]
        response = httpx.post(f"{srv.base_url}/v1/responses", json={"model": "tiny", "input": "Say something.",
                                                                  "max_output_tokens": 12}, timeout=60).json()
        assert response["temperature"] == 0.0 and response["top_p"] == pytest.approx(0.8)
        info = httpx.get(f"{base}/get_server_info", timeout=60).json()
        assert info["sampling_defaults"] == "model" and info["preferred_sampling_params"] is None
        assert info["default_sampling_params"] == {"temperature": 0.0, "top_p": 0.8, "top_k": 20,
                                                   "repetition_penalty": 1.1}


def test_openai_defaults_ignore_the_model_and_preferred_values_win(greedy_model) -> None:
    with serving(greedy_model, server={"sampling_defaults": "openai"}) as srv:
        assert len(set(_completions(srv, (1, 2, 3)))) > 1  # temperature 1: the seeds differ
        assert httpx.get(f"{srv.base_url}/get_server_info", timeout=60).json()["default_sampling_params"] == {}
    preferred = json.dumps({"temperature": 1.0, "top_k": -1})
    with serving(greedy_model, server={"preferred_sampling_params": preferred}) as srv:
        assert len(set(_completions(srv, (1, 2, 3)))) > 1
        base = srv.base_url
        assert httpx.get(f"{base}/get_model_info", timeout=60).json()["preferred_sampling_params"] == preferred
        info = httpx.get(f"{base}/get_server_info", timeout=60).json()
        assert info["default_sampling_params"] == {"temperature": 1.0, "top_p": 0.8, "top_k": -1,
                                                   "repetition_penalty": 1.1}


def test_generation_config_values_and_bad_flags() -> None:
    gen = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 0, "repetition_penalty": 1.05,
           "max_new_tokens": 512, "min_p": "none"}
    assert from_generation_config(gen) == {"temperature": 0.7, "top_p": 0.8, "top_k": -1, "repetition_penalty": 1.05}
    # what json reads of a file transformers wrote with an infinity, or an integer past float's range: not used
    assert from_generation_config({"top_k": float("inf"), "temperature": 10**400, "top_p": 0.9}) == {"top_p": 0.9}
    # refused with the flags, before a model loads, by the rules a request's own values meet
    for bad, said in (("{temperature: 0}", "not valid JSON"), ("[0.7]", "JSON object"), ('{"seed": 1}', "'seed' is not one"),
                      ('{"top_k": "20"}', "top_k must be -1"), ('{"top_p": 0}', r"top_p must be in \(0, 1\]"),
                      ('{"temperature": NaN}', "temperature must be a finite number")):
        with pytest.raises(ConfigError, match=said):
            ServerOptions(preferred_sampling_params=bad)
