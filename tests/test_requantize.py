"""The requantized model copies (issue 14's embedded speculative draft, ``smollm2:int4-g64``):
their own weights, grouped low-bit rounding, and how often they agree with the target."""

from __future__ import annotations

import pytest
import torch
from dense_forward import greedy_paged, prefill_logits

from hicache.config import ConfigError, PassPrecision
from hicache.model import load_model
from hicache.model.requantize import parse_variant, requantize_matrix

pytestmark = pytest.mark.model


def test_each_group_takes_at_most_2_pow_bits_levels_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 150, generator=gen)  # 150 = 2 groups of 64 + a short group of 22
    w[0, :64] = 0.25  # a constant group stays exact
    q = requantize_matrix(w, bits=4, group=64)
    assert q.shape == w.shape and torch.equal(q[0, :64], w[0, :64])
    for start in (0, 64, 128):
        cols = slice(start, start + 64)
        for row in range(6):
            g, r = w[row, cols], q[row, cols]
            assert len(torch.unique(r)) <= 16
            step = (g.max() - g.min()) / 15
            assert (r - g).abs().max() <= step / 2 + 1e-6
    assert not torch.equal(q, w)


def test_variant_names():
    assert parse_variant("int4-g64") == (4, 64)
    for bad in ("int4", "int9-g64", "int4-g1", "fp8-g64"):
        with pytest.raises(ValueError, match="expected int<bits>-g<group>"):
            parse_variant(bad)
    with pytest.raises(ConfigError, match="unknown model 'smollm2:q4'"):
        load_model("smollm2:q4", weights=False)


@pytest.mark.slow
def test_int4_g64_copy_is_another_model_that_mostly_agrees_with_the_target(smollm2_reference):
    """Teacher-forced next-token agreement over greedy continuations of the target: the 4-bit
    copy is a different model (its own cache identity, not always the same token) that agrees
    often enough to draft for it."""
    target = smollm2_reference.loaded  # load_model("smollm2", dtype=torch.float32), loaded once a session
    conts = []
    for question in ("What is the capital of France?", "Write a haiku about caches."):
        ids = target.tokenizer.encode(target.tokenizer.apply_chat_template([{"role": "user", "content": question}]))
        conts.append((ids, greedy_paged(target.model, ids, 48)))
    agreement = {}
    for variant in ("int4-g64",):
        # Only all-position prefills read the draft (passes of > 24 rows read the loaded weights), so
        # it skips packing 4-bit decode blocks (most of a draft's load); the weights are the same.
        draft = load_model(f"smollm2:{variant}", dtype=torch.float32, precision=PassPrecision(decode_weights="same"))
        assert draft.identity != target.identity and draft.identity.endswith(variant)
        same = total = 0
        for ids, out in conts:
            seq = ids + out
            want = prefill_logits(target.model, seq)[len(ids) - 1:-1].argmax(-1)
            got = prefill_logits(draft.model, seq)[len(ids) - 1:-1].argmax(-1)
            same, total = same + int((want == got).sum()), total + len(out)
        agreement[variant] = same / total
    assert 0.55 <= agreement["int4-g64"] < 0.95, agreement  # (int8-g64 measured 0.98: docs/speculative.md)
