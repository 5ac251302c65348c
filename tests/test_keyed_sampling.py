"""Keyed sampling (``--enable-deterministic-inference``, issue 31): a seeded request's token at
absolute position ``n`` is a function of (seed, n, logits) alone, distributed as the request's
distribution; a verify pass accepts by those keyed tokens, so speculation (NGRAM or a STANDALONE
draft) gives a seeded request exactly the output plain decoding gives."""

from __future__ import annotations

from collections import Counter
from typing import Iterator

import pytest
import torch

from hicache import Engine, SamplingParams
from hicache.runtime.sampling import (
    MASK64,
    GrammarSpec,
    keyed_choice,
    keyed_sample,
    probabilities,
    sample,
    sample_key,
    splitmix64,
)
from hicache.runtime.speculative import keyed_accept

pytestmark = pytest.mark.spec

# The tiny model with 32-dimensional heads: deterministic inference's native decode attention
# refuses tiny's 16 (model/loader.py). Its distributions are nearly flat, so a sampled output
# is nothing like the greedy one, and the int4 draft's keyed samples still mostly agree.
MODEL = 'random:{"head_dim": 32}'
BASE = dict(dtype="float32", max_total_tokens=4096, enable_deterministic_inference=True)
STANDALONE = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=MODEL + ":int4-g16",
                  speculative_num_steps=3)
LOGITS = torch.tensor([2.0, 1.5, 0.3, -0.5, 1.0, -3.0])
CHI2_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}  # chi-square critical values at p = 0.001, by degrees of freedom


def test_sample_key_is_the_documented_mix() -> None:
    """splitmix64(splitmix64(seed mod 2^64) XOR position): pinned, so a seeded output stays the
    same across versions; negative seeds wrap as manual_seed's do."""
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # SplitMix64's first output from state 0
    assert sample_key(0, 0) == 0xA706DD2F4D197E6F
    assert sample_key(42, 7) == splitmix64(splitmix64(42) ^ 7) == 0x16062D6C1339E500
    assert sample_key(-1, 3) == sample_key(MASK64, 3)
    assert len({sample_key(s, p) for s in range(40) for p in range(40)}) == 1600
    assert all(0 <= sample_key(s, p) <= MASK64 for s in (-(2**63), 2**64 - 1) for p in (0, 2**40))


def test_the_keyed_sample_depends_on_seed_position_and_logits_only() -> None:
    """Draws made before (other keys, the request's generator) change nothing; the same key on
    equal logits gives the same token; other keys give other tokens."""
    sp = SamplingParams(temperature=1.0, seed=11)
    first = [keyed_sample(LOGITS, sp, n) for n in range(64)]
    torch.rand(100)  # the global stream moves
    assert [keyed_sample(LOGITS.clone(), sp, n) for n in reversed(range(64))] == first[::-1]
    assert len(set(first)) > 2  # the position matters
    other = SamplingParams(temperature=1.0, seed=12)
    assert [keyed_sample(LOGITS, other, n) for n in range(64)] != first  # so does the seed
    # through the sampler: two generators in different states, one keyed answer per position
    used, fresh = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    torch.rand(50, generator=used)
    rows = torch.stack([LOGITS, LOGITS])
    for n in range(8):
        assert sample(rows, [sp, sp], [used, fresh], positions=[n, n]) == [first[n]] * 2
    # greedy requests stay argmax
    assert keyed_sample(LOGITS, SamplingParams(temperature=0.0, seed=11), 3) == 0


@pytest.mark.parametrize("options", [dict(top_k=4), dict(top_p=0.8), dict(min_p=0.2)])
def test_keyed_frequencies_match_the_distribution(options: dict) -> None:
    """Over 3000 fixed keys (60 seeds x 50 positions) the tokens pass a chi-square test against
    the request's distribution (temperature, then top-k / top-p / min-p); the tokens those cut
    never come out."""
    sp = SamplingParams(temperature=0.9, **options)
    probs = probabilities(LOGITS, sp)
    probs = probs / probs.sum()
    counts = Counter(keyed_choice(probs, s, n) for s in range(60) for n in range(50))
    total = sum(counts.values())
    assert set(counts) <= {i for i, p in enumerate(probs.tolist()) if p > 0}
    kept = [i for i, p in enumerate(probs.tolist()) if p > 0]
    chi2 = sum((counts[i] - total * float(probs[i])) ** 2 / (total * float(probs[i])) for i in kept)
    assert len(kept) >= 3 and chi2 <= CHI2_P001[len(kept) - 1], (counts, probs.tolist())


def test_keyed_accept_takes_the_drafts_equal_to_the_keyed_samples() -> None:
    """Row j of a verify pass stands for position len(all_ids) + j: the accepted tokens are the
    keyed samples there, up to and including the first that differs from its draft."""

    class Req:
        sampling = SamplingParams(temperature=1.0, seed=5)
        all_ids = [1, 2, 3, 4]

    rows = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 0.5, LOGITS.roll(2)])
    keyed = [keyed_sample(rows[j], Req.sampling, 4 + j) for j in range(4)]
    assert keyed_accept(keyed[:3], rows, Req) == keyed  # every draft, then the bonus row
    wrong = (keyed[1] + 1) % LOGITS.numel()
    assert keyed_accept([keyed[0], wrong, keyed[2]], rows, Req) == keyed[:2]
    assert keyed_accept([], rows[:1], Req) == keyed[:1]  # a row riding along without drafts


@pytest.fixture(scope="module")
def plain() -> Iterator[Engine]:
    engine = Engine(MODEL, **BASE)
    yield engine
    engine.shutdown()


def generate(options: dict, prompt, sp: SamplingParams):
    engine = Engine(MODEL, **BASE, **options)
    try:
        return engine.generate(prompt, sp)[0]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("seed,temperature", [(1, 0.8)])
def test_ngram_speculation_gives_the_plain_seeded_output(plain: Engine, seed: int, temperature: float) -> None:
    """Copyable text under a grammar: NGRAM drafts are verified and accepted, and the seeded
    output is plain decoding's, token for token."""
    prompt = "copy: " + "one two three four " * 10
    words = GrammarSpec("regex", "(one|two|three|four)( (one|two|three|four)){5,12}")
    sp = SamplingParams(max_new_tokens=60, temperature=temperature, seed=seed, grammar=words)
    ref = plain.generate(prompt, sp)[0]
    spec = generate({"speculative_algorithm": "NGRAM"}, prompt, sp)
    assert spec.output_ids == ref.output_ids
    assert spec.spec_verify_steps > 0 and spec.spec_accept_length > 1.0  # drafts were accepted
    greedy = plain.generate(prompt, SamplingParams(max_new_tokens=60, temperature=0.0, grammar=words))[0]
    assert ref.output_ids != greedy.output_ids  # the test samples, it does not decode greedily


@pytest.mark.parametrize("seed,temperature", [(6, 1.0)])
def test_standalone_speculation_gives_the_plain_seeded_output(plain: Engine, seed: int, temperature: float) -> None:
    """A draft model proposing its keyed samples: they are mostly accepted, and the seeded
    output is plain decoding's, token for token."""
    prompt = [[(i * 37 + 11) % 240 + 5 for i in range(90)]]
    sp = SamplingParams(max_new_tokens=40, temperature=temperature, seed=seed)
    ref = plain.generate(prompt, sp)[0]
    spec = generate(STANDALONE, prompt, sp)
    assert spec.output_ids == ref.output_ids
    assert spec.spec_verify_steps > 0 and spec.spec_accept_length > 1.0
    assert round(spec.spec_accept_length * spec.spec_verify_steps) == spec.completion_tokens - 1
    greedy = plain.generate(prompt, SamplingParams(max_new_tokens=40, temperature=0.0))[0]
    assert ref.output_ids != greedy.output_ids
