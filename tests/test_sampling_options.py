"""What users expect of sampling beyond temperature: penalties, logit_bias, min_tokens, min_p,
logprobs, n > 1 sharing the prompt's pages, several prompts per completion, per-choice seeds --
through the `openai` SDK and SGLang's /generate on the tiny model (a byte tokenizer: token id
= byte), and exactly the same under NGRAM speculation."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from hicache import Engine
from hicache.runtime.penalties import PenaltyState, adjust_row
from hicache.runtime.sampling import GrammarSpec, SamplingParams

pytestmark = pytest.mark.server

MODEL = "tiny"
EOS = 257  # the tiny model's end of sequence
X = ord("x")


def test_adjusted_logits_follow_the_stated_rules() -> None:
    """OpenAI's penalties over the output, the repetition penalty over prompt and output, the
    bias, and EOS held back until min_tokens."""
    row = torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0])
    state = PenaltyState(torch.tensor([0.0, 1.0, 3.0, 0.0, 0.0]), torch.tensor([True, False, False, False, False]))
    sp = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                        logit_bias={3: 10.0}, min_tokens=5)
    adjust_row(row, sp, state, outputs=4, stop_ids=torch.tensor([4]))
    # token 0: in the prompt (2/2); 1: once in the output (-2*2 - 0.5 - 0.25); 2: three times
    # (1/2 - 1.5 - 0.25); 3: biased; 4: the stop token before min_tokens
    assert row.tolist() == [1.0, -4.75, -1.25, 10.5, float("-inf")]
    row = torch.tensor([0.0, 0.0, 0.0, 0.0, 3.0])
    adjust_row(row, sp, state, outputs=5, stop_ids=torch.tensor([4]))
    assert row[4] == 3.0  # min_tokens reached


def test_logprobs_chat_completions_and_streamed(client) -> None:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(**kw)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    for item in content:  # greedy: the sampled token is the most likely one
        assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == item.logprob
        assert len(item.top_logprobs) == 3 and item.logprob <= 0.0
    streamed = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs]
    assert [i.logprob for c in streamed for i in c.choices[0].logprobs.content] == \
        pytest.approx([i.logprob for i in content], abs=1e-4)

    comp = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.text_offset) == 5 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(len(top) == 2 and max(top.values()) == t for top, t in zip(lp.top_logprobs, lp.token_logprobs))


def test_n_choices_share_one_prefill_and_seed_each_choice(server, client) -> None:
    prompt = "The same long prompt for every choice. " * 8  # 312 bytes: 19 full pages + 8 tokens
    kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    before = httpx.get(server.base_url + "/stats").json()["prefill_computed_tokens"]
    many = client.completions.create(**kw, n=4, seed=11)
    computed = httpx.get(server.base_url + "/stats").json()["prefill_computed_tokens"] - before
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.usage.prompt_tokens == len(prompt) and many.usage.completion_tokens == 32  # the prompt counted once
    assert computed == len(prompt) + 3 * 8, computed  # one prefill; each sibling computes the last partial page
    for i in (0, 3):  # choice i is the request seeded seed + i
        alone = client.completions.create(**kw, seed=11 + i)
        assert alone.choices[0].text == many.choices[i].text
    assert len({c.text for c in many.choices}) > 1

    streamed = client.completions.create(**kw, n=2, seed=11, stream=True, stream_options={"include_usage": True})
    texts, usage = ["", ""], None
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert texts == [c.text for c in many.choices[:2]] and usage.completion_tokens == 16

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          n=2, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8


def test_several_prompts_per_completion_in_order(client) -> None:
    greedy = dict(model=MODEL, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    both = client.completions.create(prompt=["first prompt", "bcd"], n=2, **greedy)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    one = client.completions.create(prompt="first prompt", **greedy).choices[0].text
    other = client.completions.create(prompt=[98, 99, 100], **greedy).choices[0].text  # "bcd" as token ids
    assert [c.text for c in both.choices] == [one, one, other, other]
    assert both.usage.prompt_tokens == len("first prompt") + 3
    ids = client.completions.create(prompt=[[98, 99, 100], [98, 99, 100]], **greedy)
    assert [c.text for c in ids.choices] == [other, other]


def test_logit_bias_penalties_and_min_tokens(client) -> None:
    kw = dict(model=MODEL, prompt="abc", temperature=0, extra_body={"ignore_eos": True})
    forced = client.completions.create(**kw, max_tokens=60, logit_bias={str(X): 100})
    assert forced.choices[0].text == "x" * 60
    # each "x" costs it 2 more: it stops being the argmax after about 50 (its bias over the rest / 2)
    tired = client.completions.create(**kw, max_tokens=60, logit_bias={str(X): 100}, frequency_penalty=2.0)
    assert 40 <= tired.choices[0].text.count("x") < 55, tired.choices[0].text
    once = client.completions.create(**kw, max_tokens=10, logit_bias={str(X): 100}, presence_penalty=2.0)
    assert once.choices[0].text == "x" * 10  # presence costs 2 once: still far ahead
    eos_first = dict(model=MODEL, prompt="abc", temperature=0, logit_bias={str(EOS): 100})
    assert client.completions.create(**eos_first, max_tokens=20).usage.completion_tokens == 1
    held = client.completions.create(**eos_first, max_tokens=20, extra_body={"min_tokens": 7})
    assert held.usage.completion_tokens == 8 and held.choices[0].finish_reason == "stop"  # 7 + the EOS


def test_generate_with_logprobs_schema_and_penalties(server) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = httpx.post(server.base_url + "/generate", json={
        "text": "number:", "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 24, "temperature": 0, "json_schema": json.dumps(schema),
                            "frequency_penalty": 0.5, "min_p": 0.1}}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["meta_info"]
    tokens = meta["output_token_logprobs"]
    assert [t[1] for t in tokens] == body["output_ids"] and len(meta["output_top_logprobs"]) == len(tokens)
    assert all(math.isfinite(t[0]) and t[0] <= 0 for t in tokens)
    if meta["finish_reason"]["type"] == "stop":
        assert isinstance(json.loads(body["text"])["n"], int)


@pytest.mark.parametrize("extra,param", [({"n": 2}, "n"), ({"logprobs": 1}, "logprobs")])
def test_pd_requests_refuse_n_and_logprobs(server, extra, param) -> None:
    r = httpx.post(server.base_url + "/v1/completions", json={
        "model": MODEL, "prompt": "x", "bootstrap_host": "127.0.0.1", "bootstrap_port": 9, "bootstrap_room": 1,
        **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_ngram_speculation_keeps_penalties_and_logprobs() -> None:
    """A verify pass's row j counts drafts 1..j: greedy with penalties, and the logprobs, equal
    plain decoding's."""
    prompt = "copy: " + "one two three four " * 10
    words = GrammarSpec("regex", "(one|two|three|four)( (one|two|three|four)){5,12}")  # copyable text
    sp = SamplingParams(max_new_tokens=80, temperature=0.0, frequency_penalty=0.3, repetition_penalty=1.1,
                        logprobs=1, grammar=words)
    got = []
    for options in ({}, {"speculative_algorithm": "NGRAM"}):
        engine = Engine("random:tiny", dtype="float32", max_total_tokens=4096, **options)
        try:
            got.append(engine.generate(prompt, sp)[0])
        finally:
            engine.shutdown()
    plain, spec = got
    assert spec.output_ids == plain.output_ids and spec.spec_verify_steps > 0
    assert [e.logprob for e in spec.logprobs] == pytest.approx([e.logprob for e in plain.logprobs], abs=1e-4)
