"""Moving cached keys to new positions (issue 61, reuse after an edit): RoPE turns each pair of a
key's rotary dimensions by ``position * inv_freq``, so a key cached at position ``p`` becomes the
key of position ``p + shift`` when each pair is turned by ``shift * inv_freq`` more. Values carry
no position and are kept as they are.

That holds for every RoPE the registry supports: the plain one and its scalings (linear, Llama 3,
LongRoPE's per-pair factors, YaRN: its attention factor multiplies cos and sin of q and k alike, so
the stored key carries it already and the turn by ``shift`` is a pure rotation), partial rotary
(only the first ``rope_dim`` dimensions turn), and no RoPE at all (nothing turns). It does not hold
where a key is more than a rotation of its position: a sliding-window layer (the tokens a key's
layer saw are cut by its window), a recurrent layer (its state is not per token), and MLA (the
latent's rotary half is shared by every head; not done yet): such models refuse edit reuse
(hicache/combinations.py).

Units: positions are tokens; keys are ``[L, KvH, D]`` rows of one layer.
"""

from __future__ import annotations

import torch

from .layers import rope_inv_freq, rotate_half
from .spec import ModelSpec


class RopeShift:
    """Re-rotates cached keys of ``spec``'s attention layers by a position shift."""

    def __init__(self, spec: ModelSpec, device: torch.device | str = "cpu") -> None:
        assert not (spec.recurrent_layers or spec.has_sliding_layers or spec.is_mla), "refused by the config"
        self.dim = 0 if spec.nope else spec.rope_dim
        self.inv_freq = rope_inv_freq(spec).to(device) if self.dim else None

    def keys(self, k: torch.Tensor, shift: int) -> torch.Tensor:
        """``k`` ``[L, KvH, D]`` (cached at positions p) as the keys of positions ``p + shift``, in
        k's dtype (turned in float64: the angle of a large shift keeps its bits)."""
        if not self.dim or shift == 0:
            return k
        angles = shift * self.inv_freq.to(torch.float64)
        angles = torch.cat((angles, angles))
        cos, sin = angles.cos().to(torch.float32), angles.sin().to(torch.float32)
        turned = k[..., : self.dim].to(torch.float32)
        turned = turned * cos + rotate_half(turned) * sin
        return torch.cat((turned.to(k.dtype), k[..., self.dim :]), dim=-1)
