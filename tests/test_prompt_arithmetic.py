"""Prompt tokens always take the prefill's arithmetic (issue 57): a cache hit that leaves a few
prompt tokens to compute gives the cold reply, although a pass that short is the size of a decode
step, whose projections read GGUF blocks with 8-bit inputs (lossy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache import Engine, SamplingParams
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
