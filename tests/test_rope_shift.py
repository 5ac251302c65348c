"""A cached key re-rotated by a shift is the key of its new position (issue 61), for every RoPE the
registry supports: the plain one, its scalings (linear, Llama 3, YaRN with its attention factor)
and partial rotary; values and a model without RoPE are left as they are."""

from __future__ import annotations

import json

import pytest
import torch

from hicache.model.layers import RotaryEmbedding, rotate_half
from hicache.model.random_model import parse_random_spec
from hicache.model.rope_shift import RopeShift

pytestmark = pytest.mark.model

VARIANTS = {
    "plain": {},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "llama3": {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64}},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    "partial": {"rotary_dim": 8},
}


def rotated(spec, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``k`` turned to ``positions`` the way the model's attention turns its keys."""
    cos, sin = RotaryEmbedding(spec, torch.device("cpu"))(positions, torch.float64)
    dim = spec.rope_dim
    turned = k[..., :dim] * cos + rotate_half(k[..., :dim]) * sin
    return torch.cat((turned, k[..., dim:]), dim=-1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_shifted_key_is_the_key_of_its_new_position(variant) -> None:
    spec = parse_random_spec(json.dumps(VARIANTS[variant]))
    k = torch.randn(6, spec.num_kv_heads, spec.head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    old = torch.tensor([0, 5, 17, 300, 1000, 2047])
    for shift in (3, -5, 1701):
        moved = RopeShift(spec).keys(rotated(spec, k, old).float(), shift)
        expected = rotated(spec, k, old + shift).float()
        assert moved.dtype == torch.float32
        # (the model turns its keys by float32 angles: at position ~3,700 they are off by ~2e-4 radians)
        torch.testing.assert_close(moved, expected, rtol=0, atol=1e-3)
        assert (moved - rotated(spec, k, old).float()).abs().max() > 0.1  # the shift moved them
        if spec.rope_dim < spec.head_dim:
            assert torch.equal(moved[..., spec.rope_dim:], expected[..., spec.rope_dim:])  # not turned


def test_keys_of_a_half_precision_cache_keep_their_dtype() -> None:
    spec = parse_random_spec("tiny")
    k = torch.randn(4, spec.num_kv_heads, spec.head_dim).to(torch.float16)
    moved = RopeShift(spec).keys(k, 12)
    assert moved.dtype == torch.float16
    torch.testing.assert_close(RopeShift(spec).keys(moved, -12), k, rtol=0, atol=4e-3)
    assert RopeShift(spec).keys(k, 0) is k
