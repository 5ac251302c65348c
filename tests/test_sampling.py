"""The sampler's one tie rule: the most likely token is the lowest id among the maximal logits,
for greedy decoding, top-k 1, top-p's always-kept token and the argmax fallback alike (bf16
logits tie at the top often enough that two rules give two texts)."""

from __future__ import annotations

import random

import pytest
import torch

from hicache import Engine, SamplingParams
from hicache.runtime.sampling import probabilities, sample, top_token

pytestmark = pytest.mark.engine

VOCAB = 49152  # SmolLM2's


def tied_rows(n: int, ties: int, seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """``n`` rows of bf16-representable logits, each with ``ties`` equal maxima at random ids;
    and each row's lowest tied id."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, VOCAB, generator=gen) * 4).to(torch.bfloat16).float()
    lowest = []
    for row in logits:
        ids = torch.randperm(VOCAB, generator=gen)[:ties]
        row[ids] = float(torch.tensor(float(row.max()) + 0.5).to(torch.bfloat16))
        lowest.append(int(ids.min()))
    return logits, lowest


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-46),
    SamplingParams(temperature=0.7, top_p=1e-9, top_k=8),
    SamplingParams(temperature=1e30, top_p=1e-46),  # flattens the probabilities: the logits still order
], ids=["greedy", "top_k=1", "top_p=1e-46", "top_p+top_k", "huge temperature"])
@pytest.mark.parametrize("ties", [2, 3])
def test_every_path_breaks_a_top_tie_to_the_lowest_id(params: SamplingParams, ties: int) -> None:
    logits, lowest = tied_rows(4, ties)
    assert top_token(logits).tolist() == lowest
    gens = [torch.Generator().manual_seed(i) for i in range(len(lowest))]
    assert sample(logits, [params] * len(lowest), gens) == lowest
    if not params.greedy:
        for row, tok in zip(logits, lowest):
            probs = probabilities(row, params)
            assert probs.nonzero().flatten().tolist() == [tok]


def test_fallback_argmax_takes_the_lowest_tied_id() -> None:
    """A row without a distribution (two +inf logits: inf - inf) falls back to the same rule."""
    logits = torch.zeros(1, 320)
    logits[0, [201, 17, 90]] = float("inf")
    assert probabilities(logits[0], SamplingParams(temperature=1.0, top_p=1e-46)) is None
    assert sample(logits, [SamplingParams(temperature=1.0, top_p=1e-46)], [torch.Generator()]) == [17]


def test_greedy_and_tiny_top_p_say_the_same_in_bfloat16() -> None:
    """The engine in bfloat16 (what ``--dtype auto`` picks on a CPU with native bf16): the
    same batch decoded greedily and with temperature 1, top_p 1e-46 gives the same tokens.
    No radix cache: a hit would change the prefix split, and with it the rounding."""
    engine = Engine("random:tiny", dtype="bfloat16", page_size=4, max_total_tokens=8192, disable_radix_cache=True)
    rng = random.Random(0)
    ps = [[rng.randrange(5, 250) for _ in range(rng.randrange(4, 30))] for _ in range(16)]
    greedy = engine.generate(ps, SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
    tiny_p = engine.generate(ps, SamplingParams(max_new_tokens=32, temperature=1.0, top_p=1e-46, seed=3,
                                                ignore_eos=True))
    assert [r.output_ids for r in tiny_p] == [r.output_ids for r in greedy]


def test_a_cpu_generator_draws_on_another_devices_probabilities_by_inverse_cdf() -> None:
    """A seeded request keeps its CPU generator; with probabilities on a GPU, whose multinomial
    refuses a CPU generator, the draw is one CPU uniform and the cumulative distribution inverted
    (run here on CPU probabilities): the right frequencies, never a zero-probability index, one
    seed one stream."""
    from hicache.runtime.sampling import inverse_cdf

    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    gen = torch.Generator().manual_seed(3)
    draws = [inverse_cdf(probs * 7.0, gen) for _ in range(20000)]  # any sum
    freq = torch.bincount(torch.tensor(draws), minlength=5).float() / len(draws)
    assert freq[1] == 0 and freq[4] == 0
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)
    again = torch.Generator().manual_seed(3)
    assert [inverse_cdf(probs, again) for _ in range(50)] == draws[:50]
