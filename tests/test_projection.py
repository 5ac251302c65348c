"""Fused projections stay the model's parameters; a lossy decode-weight copy is opt-in, used only
by decode-sized passes, and keeps its KV apart from the exact weights' in the cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hicache import Engine, SamplingParams
from hicache.config import PassPrecision
from hicache.model import load_model
from hicache.model.projection import DECODE_ROWS, VERIFY_ROWS, Projection

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


def _linears(*rows: int, bias: bool = True) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(16, n, bias=bias).requires_grad_(False) for n in rows]


def test_fused_output_equals_each_part_and_parts_become_views():
    parts = _linears(8, 4, 4)
    x = torch.randn(5, 16)
    want = [p(x) for p in parts]
    got = Projection(*parts)(x, generated=False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    fused = Projection(*parts)
    fused(x, generated=False)
    with torch.no_grad():  # an in-place load into a part reaches the fused matrix
        parts[1].weight.fill_(0.5)
        parts[1].bias.zero_()
    torch.testing.assert_close(fused(x, generated=False)[1], x.sum(1, keepdim=True).expand(5, 4) * 0.5)


def test_replaced_weight_is_fused_again():
    """A TP shard replaces a part's weight with a slice; the next call sees the new shape."""
    parts = _linears(8, 4, bias=False)
    proj = Projection(*parts)
    x = torch.randn(2, 16)
    proj(x, generated=False)
    parts[0].weight = nn.Parameter(parts[0].weight[:3].clone(), requires_grad=False)
    a, b = proj(x, generated=False)
    assert a.shape == (2, 3) and b.shape == (2, 4)
    torch.testing.assert_close(a, x @ parts[0].weight.T)


def test_decode_copy_serves_only_decode_sized_passes_of_generated_tokens():
    (part,) = _linears(32, bias=False)
    proj = Projection(part)
    proj.decode_weights = "bfloat16"
    decode_x, prefill_x = torch.randn(proj.decode_rows, 16), torch.randn(proj.decode_rows + 1, 16)
    exact = lambda x: x @ part.weight.T  # noqa: E731
    rounded = lambda x: (x.bfloat16() @ part.weight.bfloat16().T).float()  # noqa: E731
    torch.testing.assert_close(proj(prefill_x, generated=True), exact(prefill_x))
    torch.testing.assert_close(proj(decode_x, generated=True), rounded(decode_x))
    assert proj(decode_x, generated=True).dtype == torch.float32
    assert not torch.equal(proj(decode_x, generated=True), exact(decode_x))  # lossy: the flag must say so
    # Prompt tokens never read it, however few (a hit leaving one token to compute: issue 57), and
    # a few of them get the bits a longer prompt pass gives them.
    prompt = torch.randn(40, 16)
    torch.testing.assert_close(proj(prompt[-1:], generated=False), exact(prompt[-1:]))
    assert torch.equal(proj(prompt[-1:], generated=False), proj(prompt, generated=False)[-1:])
    assert proj.decode_rows == VERIFY_ROWS  # no prefill copy: a verify batch reads the decode weights


def test_decode_weight_dtype_is_part_of_the_identity():
    same = load_model("random:tiny", dtype=torch.float32, weights=False)
    bf16 = load_model("random:tiny", dtype=torch.float32, weights=False, precision=PassPrecision(decode_weights="bfloat16"))
    exact = load_model("random:tiny", dtype=torch.float32, weights=False, precision=PassPrecision(decode_weights="same"))
    noop = load_model("random:tiny", dtype=torch.bfloat16, weights=False, precision=PassPrecision(decode_weights="bfloat16"))
    assert same.identity == exact.identity != bf16.identity
    assert noop.identity.endswith(":bfloat16")  # a bf16 model's bf16 decode copy is no copy


def test_engine_with_bf16_decode_weights_generates_and_keeps_a_separate_namespace():
    ids = list(range(3, 40))
    exact = Engine("random:small", dtype="float32", max_total_tokens=512)
    fast = Engine("random:small", dtype="float32", max_total_tokens=512, decode_weight_dtype="bfloat16")
    try:
        assert exact.model_namespace != fast.model_namespace
        a = exact.generate([ids], GREEDY)[0]
        b = fast.generate([ids], GREEDY)[0]
        # Prefill uses the exact weights in both: the first token (from the prompt pass) agrees.
        assert len(b.output_ids) == 12 and a.output_ids[0] == b.output_ids[0]
    finally:
        exact.shutdown()
        fast.shutdown()


def test_weights_are_fused_and_decode_copies_made_before_the_kv_pool_is_sized():
    """The decode copy is real memory: it exists when loading (or sharding) returns, so the
    pool budget, taken after the weights are in memory, sees it (DESIGN invariant 6)."""
    from hicache.model.parallel import model_shard, shard_model

    loaded = load_model("random:small", dtype=torch.float32, precision=PassPrecision(decode_weights="bfloat16"))
    projections = list(loaded.model.projections())
    assert projections and all(p.prepared for p in projections)
    shard_model(loaded.model, model_shard(loaded.spec, 0, 2, 0, 2), None)  # TP half, first of 2 stages
    assert loaded.model.head is None  # a first stage holds no LM head
    assert all(p.prepared for p in loaded.model.projections())
    # A rank loading to shard skips the whole model's copies: shard_model makes its slices' own.
    rank = load_model("random:small", dtype=torch.float32, precision=PassPrecision(decode_weights="bfloat16"), to_be_sharded=True)
    assert not any(p.prepared for p in rank.model.projections())
    shard_model(rank.model, model_shard(rank.spec, 1, 2, 1, 2), None)
    assert all(p.prepared and p.decode_format == "bfloat16" for p in rank.model.projections())


def test_prefill_copy_serves_only_prefill_sized_passes():
    """Precision per phase: prompt passes and passes of more than DECODE_ROWS rows read the bf16
    copy (inputs cast to bf16, outputs back to float32); decode-sized passes of generated tokens
    keep the exact float32 path."""
    (part,) = _linears(32, bias=True)
    proj = Projection(part)
    proj.prefill_weights = "bfloat16"
    decode_x, prefill_x = torch.randn(proj.decode_rows, 16), torch.randn(proj.decode_rows + 1, 16)
    exact = lambda x: x @ part.weight.T + part.bias  # noqa: E731
    rounded = lambda x: F.linear(x.bfloat16(), part.weight.bfloat16(), part.bias.bfloat16()).float()  # noqa: E731
    torch.testing.assert_close(proj(decode_x, generated=True), exact(decode_x))
    torch.testing.assert_close(proj(prefill_x, generated=False), rounded(prefill_x))
    assert proj(prefill_x, generated=False).dtype == torch.float32 and proj.prefill_format == "bfloat16"
    # A prompt pass of a few rows (a short suffix after a hit) reads the prefill's copy too.
    torch.testing.assert_close(proj(decode_x[:1], generated=False), rounded(decode_x[:1]))
    assert proj.decode_rows == DECODE_ROWS  # the bf16 GEMM beats the decode path beyond a decode batch
    assert proj.copies_nbytes() == part.weight.numel() * 2  # counted against the memory budget


def test_prefill_weight_dtype_is_part_of_the_identity_and_the_resident_size():
    same = load_model("random:small", dtype=torch.float32)
    bf16 = load_model("random:small", dtype=torch.float32, precision=PassPrecision(prefill_weights="bfloat16"))
    noop = load_model("random:small", dtype=torch.bfloat16, precision=PassPrecision(prefill_weights="bfloat16"), weights=False)
    assert ":prefill-bfloat16" in bf16.identity and ":prefill" not in same.identity
    assert noop.identity.endswith(":bfloat16")  # a bf16 model's bf16 prefill copy is no copy
    params = sum(p.numel() for p in same.model.parameters())  # (tied embedding and head: one storage)
    assert same.model.weight_bytes() == 4 * params
    assert bf16.model.weight_bytes() == 4 * params + 2 * sum(p._weight.numel() for p in bf16.model.projections())


def test_engine_prefilling_from_bf16_keeps_a_separate_namespace_and_close_logits():
    """The KV of a prompt computed from bf16 weights differs from float32's by bf16 rounding:
    its own cache namespace; the first token's logits stay within bf16's tolerance."""
    ids = list(range(3, 40))
    exact = Engine("random:small", dtype="float32", max_total_tokens=512)
    mixed = Engine("random:small", dtype="float32", max_total_tokens=512, prefill_weight_dtype="bfloat16")
    try:
        assert exact.model_namespace != mixed.model_namespace
        assert all(p.prefill_format == "bfloat16" for p in mixed.loaded.model.projections())
        a, b = (e.generate([ids], GREEDY)[0] for e in (exact, mixed))
        assert len(b.output_ids) == 12 and a.output_ids[0] == b.output_ids[0]
    finally:
        exact.shutdown()
        mixed.shutdown()
