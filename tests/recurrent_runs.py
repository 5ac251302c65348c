"""What the recurrent engine tests share (issue 59: test_recurrent_cache, _tiers, _parallel): the tiny
models, greedy sampling with log-probabilities, token ids, a cold run and the check that a run which hit
has a cold run's tokens and log-probabilities."""

from __future__ import annotations

import random

from hicache import Engine, SamplingParams

MODELS = ["random:lfm2-tiny", "random:gdn-tiny", "random:mamba2-tiny"]  # grid: the page (4); lcm(page, 64) = 64
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, logprobs=0)
LOGPROB_ATOL = 1e-4  # float32: a hit's last chunk is a shorter GEMM than the cold run's


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 250) for _ in range(n)]


def cold_run(engine: Engine, prompt: list[int]):
    out = engine.generate([prompt], GREEDY, cache_salt=f"cold-{random.random()}")[0]
    assert out.cached_tokens == 0
    return out


def assert_as_cold(engine: Engine, prompt: list[int], out) -> None:
    """``out`` (a run that hit) has the tokens of a cold run of ``prompt`` and their log-probabilities."""
    ref = cold_run(engine, prompt)
    assert out.output_ids == ref.output_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(out.logprobs, ref.logprobs)) < LOGPROB_ATOL
