"""--enable-deterministic-inference: every greedy output, and the log-probability of every output
token (which exposes any difference in the logits' bits), equals the cold one-at-a-time run --
batched, in random mixes, chunked, from L1, L2 and L3, under speculation, on TP2 x PP2."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hicache import Engine
from hicache.config import ConfigError
from hicache.model.spec import ModelSpecError
from hicache.runtime.sampling import GrammarSpec, SamplingParams

pytestmark = pytest.mark.engine

SRC = str(Path(__file__).resolve().parents[1] / "src")
MODEL = "random:small"  # head size 32: the native decode attention takes it (random:tiny's 16 it does not)
BASE = dict(dtype="float32", page_size=16, max_total_tokens=8192, enable_deterministic_inference=True)
PROMPTS = [("System: answer briefly. " * (i % 4 + 1)) + f"Question {i}: " + "abc " * (3 + 7 * i % 40)
           for i in range(20)]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)


def outputs(results) -> list[tuple]:
    """What must not change: the tokens and each one's log-probability (the logits' bits)."""
    return [(tuple(r.output_ids), tuple(e.logprob for e in r.logprobs)) for r in results]


def one_at_a_time(engine: Engine, prompts=PROMPTS, sampling=GREEDY) -> list[tuple]:
    return outputs([engine.generate(p, sampling)[0] for p in prompts])


@pytest.fixture(scope="module")
def cold() -> list[tuple]:
    """The reference: each prompt alone, nothing cached."""
    engine = Engine(MODEL, disable_radix_cache=True, **BASE)
    try:
        return one_at_a_time(engine)
    finally:
        engine.shutdown()


def test_batched_mixed_cached_and_chunked_runs_equal_the_cold_one(cold) -> None:
    engine = Engine(MODEL, **BASE)
    try:
        assert outputs(engine.generate(PROMPTS, GREEDY)) == cold  # all at once, cold
        rng = random.Random(3)
        order = list(range(len(PROMPTS)))
        rng.shuffle(order)
        got: dict[int, tuple] = {}
        while order:  # random mixes of sizes, every prefix now cached (L1)
            k = rng.randint(1, 6)
            mix, order = order[:k], order[k:]
            got.update(zip(mix, outputs(engine.generate([PROMPTS[i] for i in mix], GREEDY))))
        assert [got[i] for i in range(len(PROMPTS))] == cold
        assert engine.stats()["hit_tokens"]["device"] > 0
    finally:
        engine.shutdown()
    chunked = Engine(MODEL, chunked_prefill_size=64, **BASE)
    try:
        assert outputs(chunked.generate(PROMPTS, GREEDY)) == cold
    finally:
        chunked.shutdown()


@pytest.mark.slow
def test_prefixes_from_host_and_storage_equal_the_cold_run(cold, tmp_path) -> None:
    tiers = dict(BASE, max_total_tokens=1024, enable_hierarchical_cache=True, hicache_storage_backend="file",
                 hicache_storage_backend_extra_config=f'{{"path": "{tmp_path}"}}',
                 hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=16)
    writer = Engine(MODEL, **tiers)
    try:
        assert one_at_a_time(writer) == cold
        assert one_at_a_time(writer) == cold  # the small device pool evicted them: back from L2
        assert writer.stats()["hit_tokens"]["host"] > 0
        writer.drain_idle()
    finally:
        writer.shutdown()
    # a new process: its prefixes come back from L3 only
    code = f"""
import json
from hicache import Engine, SamplingParams
e = Engine({MODEL!r}, **{tiers!r})
rs = [e.generate(p, {GREEDY!r})[0] for p in {PROMPTS!r}]
print(json.dumps({{"out": [[r.output_ids, [x.logprob for x in r.logprobs]] for r in rs],
                  "storage": e.stats()["hit_tokens"]["storage"]}}))
e.shutdown()
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=SRC))
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert [(tuple(ids), tuple(lps)) for ids, lps in got["out"]] == cold and got["storage"] > 0


# NGRAM drafts only where the text repeats: the grammar makes the random model copy "abc "
COPY = SamplingParams(max_new_tokens=24, temperature=0.0, logprobs=0, grammar=GrammarSpec("regex", "(abc ){3,40}abc"))


@pytest.mark.parametrize("spec", [
    dict(speculative_algorithm="NGRAM"),
    dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=f"{MODEL}:int4-g32", speculative_num_steps=3),
])
def test_speculative_decoding_changes_nothing(cold, spec) -> None:
    plain = Engine(MODEL, disable_radix_cache=True, **BASE)
    try:
        copy_cold = one_at_a_time(plain, PROMPTS[:6], COPY)
    finally:
        plain.shutdown()
    engine = Engine(MODEL, **BASE, **spec)
    try:
        results = engine.generate(PROMPTS, GREEDY) + engine.generate(PROMPTS[:6], COPY)
        assert outputs(results) == cold + copy_cold
        assert sum(r.spec_verify_steps for r in results) > 0 and max(r.spec_accept_length for r in results) > 1
    finally:
        engine.shutdown()


def test_seeded_sampling_is_the_same_alone_or_batched() -> None:
    sampled = [SamplingParams(max_new_tokens=6, temperature=0.9, seed=i, ignore_eos=True, logprobs=0)
               for i in range(200)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(200)]
    engine = Engine(MODEL, **BASE)
    try:
        alone = outputs([engine.generate(p, s)[0] for p, s in zip(prompts[:40], sampled[:40])])
        engine.flush_cache()
        together = outputs(engine.generate(prompts, sampled))
    finally:
        engine.shutdown()
    assert together[:40] == alone
    assert len({o[0] for o in together}) > 100  # seeds give different samples


def test_what_is_not_covered_is_refused_in_one_sentence() -> None:
    for options, says in ((dict(attn_cp_size=2, tp_size=2), "context parallelism"),
                          (dict(tp_size=4, nnodes=2, dist_init_addr="127.0.0.1:29500"), "across machines"),
                          (dict(disaggregation_mode="prefill"), "disaggregation")):
        with pytest.raises(ConfigError, match=says):
            Engine(MODEL, **BASE, **options)
    with pytest.raises(ModelSpecError, match="GQA heads of"):
        Engine("random:tiny", **BASE)
    with pytest.raises(ModelSpecError, match="one copy of the weights"):
        Engine(MODEL, **dict(BASE, prefill_weight_dtype="bfloat16"))


@pytest.mark.multirank
@pytest.mark.parallel
@pytest.mark.parametrize("layout", [dict(tp_size=2, pp_size=2), dict(tp_size=4)], ids=["tp2xpp2", "tp4"])
def test_ranks_with_the_consensus_checker(cold, checker, layout) -> None:
    """TP2 sums two partials (the same in any order), TP4 four through the shared-memory
    all-reduce in rank order; PP passes rows on."""
    engine = Engine(MODEL, **layout, **BASE)
    try:
        batched = outputs(engine.generate(PROMPTS, GREEDY))
        alone = one_at_a_time(engine, PROMPTS[:4])
        assert engine.group.monitor.divergence is None
    finally:
        engine.shutdown()
    assert alone == batched[:4]
