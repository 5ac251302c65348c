"""Prompt tokens always take the prefill's arithmetic (issue 57): a cache hit that leaves a few
prompt tokens to compute gives the cold reply, although a pass that short is the size of a decode
step, whose projections read GGUF blocks with 8-bit inputs (lossy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache import Engine, SamplingParams
from hicache.config import EngineConfig
from hicache.kernels import unavailable_reason

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(unavailable_reason() is not None, reason=f"no native kernels: {unavailable_reason()}")]

# A tiny random llama quantized by llama.cpp (tests/data/gguf/README.md): its decode passes read the
# file's Q4_1 blocks
MODEL = str(Path(__file__).parent / "data" / "gguf" / "tiny-llama-Q4_1.gguf")
PAGE = 16
REPLY = SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=0)


@pytest.fixture(scope="module")
def engine():
    # float32 everywhere but the decode passes: the file's 4-bit blocks multiplied with 8-bit inputs
    engine = Engine(MODEL, dtype="float32", decode_activations="int8", page_size=PAGE,
                    max_total_tokens=1024)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("left", [1, 5, 7])
def test_a_hit_leaving_fewer_than_8_prompt_tokens_keeps_the_cold_reply(engine, left):
    formats = engine.runner.model.decode_formats()
    assert all(f.endswith("@int8") for f in formats), f"decode passes must differ in arithmetic: {formats}"
    ids = [(11 * i + 5 * left) % 250 + 3 for i in range(2 * PAGE + left)]
    engine.flush_cache()
    cold = engine.generate([ids], REPLY)[0]
    engine.flush_cache()
    engine.generate([ids[:2 * PAGE]], SamplingParams(max_new_tokens=1, temperature=0.0))  # caches 2 pages
    hit = engine.generate([ids], REPLY)[0]
    assert (cold.cached_tokens, hit.cached_tokens) == (0, 2 * PAGE)
    assert hit.output_ids == cold.output_ids
    # The first token's logits (the prompt pass's) differ only as a split prompt's attention sums do
    # (~1e-6; 8-bit inputs: ~1e-2). Later ones come from decode steps, whose 8-bit rounding of
    # their inputs can turn such a difference into ~1e-3: their tokens are what must agree.
    assert abs(hit.logprobs[0].logprob - cold.logprobs[0].logprob) < 1e-4


def next_turn(first_prompt: list[int], reply: list[int], left: int) -> list[int]:
    """An agent's next prompt: the last one, the model's reply as it came, a short new user turn."""
    return first_prompt + reply + [(7 * i + left) % 250 + 3 for i in range(left)]


def test_an_agents_next_turn_computes_the_last_reply_as_prompt_and_keeps_the_cold_reply(engine):
    """The default (``--cache-generated-kv auto``): a finished request caches its prompt's pages
    only, so the next turn, which resends the reply, computes the reply's tokens with the prefill's
    arithmetic -- what its cold run does -- not the 8-bit decode steps' KV."""
    ids = [(13 * i + 1) % 250 + 3 for i in range(2 * PAGE + 3)]
    engine.flush_cache()
    first = engine.generate([ids], SamplingParams(max_new_tokens=2 * PAGE, temperature=0.0))[0]
    assert len(first.output_ids) == 2 * PAGE  # (no stop token: the reply spans two more pages)
    prompt = next_turn(ids, first.output_ids, 5)
    hit = engine.generate([prompt], REPLY)[0]
    assert hit.cached_tokens == 2 * PAGE  # the first prompt's whole pages; its reply is computed again
    engine.flush_cache()
    cold = engine.generate([prompt], REPLY)[0]
    assert hit.output_ids == cold.output_ids
    assert abs(hit.logprobs[0].logprob - cold.logprobs[0].logprob) < 1e-4


def test_cache_generated_kv_on_keeps_the_replys_pages_for_the_next_turn():
    """``--cache-generated-kv on``: the reply's whole pages join the cache too (a longer hit, with
    the decode steps' KV); ``auto`` does so only under deterministic inference, where decode steps
    compute the prefill's bits."""
    engine = Engine(MODEL, dtype="float32", decode_activations="int8", page_size=PAGE, max_total_tokens=1024,
                    cache_generated_kv="on")
    try:
        ids = [(13 * i + 1) % 250 + 3 for i in range(2 * PAGE + 3)]
        first = engine.generate([ids], SamplingParams(max_new_tokens=2 * PAGE, temperature=0.0))[0]
        hit = engine.generate([next_turn(ids, first.output_ids, 5)], REPLY)[0]
        # the prompt and the reply's computed tokens (the last sampled one has no KV): 4 whole pages
        assert hit.cached_tokens == (len(ids) + 2 * PAGE - 1) // PAGE * PAGE == 4 * PAGE
    finally:
        engine.shutdown()
    assert EngineConfig(enable_deterministic_inference=True).caches_generated_kv
    assert not EngineConfig().caches_generated_kv and EngineConfig(cache_generated_kv="on").caches_generated_kv
    assert not EngineConfig(cache_generated_kv="off", enable_deterministic_inference=True).caches_generated_kv
    assert EngineConfig(speculative_algorithm="NGRAM").caches_generated_kv  # NGRAM drafts from cached replies
