"""Exact 4- and 8-bit block copies of float32 weight matrices, for decode steps.

A GGUF model stores most matrices as Q4_1 (groups of 32 along K: ``W = d * q + m``, q in 0..15,
d and m float16) or Q8_0 (``W = d * q``, q in -127..127); loading dequantizes them to float32, so
a decode step reads 4 bytes per weight. The copies here take 0.75 (Q4_1) or 1.125 (Q8_0): the
blocks' scales are kept in float32, so the kernels never convert them. :func:`pack_exact` recovers
the blocks from the float32 matrix and keeps them only if they rebuild every weight exactly (a
-0.0 weight comes back as +0.0, the one difference ``torch.equal`` does not see) --
the values are the model's own, not a new quantization -- so a matrix that is not block-exact
(a float32 checkpoint, a TP shard that cuts a group, bf16 weights) simply gets no copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

GROUP = 32  # weights per block along the input (K) axis


@dataclass
class BlockQuantWeight:
    """``W[n, k] = scale[n, k // 32] * q[n, k] (+ minv[n, k // 32])``, exact in float32.

    ``kind`` "q4": ``qs`` uint8 ``[N, K / 2]``, byte j of a group holding q[j] in its low nibble
    and q[j + 16] in its high one; ``minv`` set. ``kind`` "q8": ``qs`` int8 ``[N, K]``, no minv.
    """

    kind: str
    qs: torch.Tensor
    scale: torch.Tensor
    minv: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.qs, self.scale, self.minv) if t is not None)

    resident_nbytes = nbytes  # bytes held: no copy beside the blocks (GGUFBlockWeight's may have one)

    def linear(self, x: torch.Tensor, ops) -> torch.Tensor:
        """``x @ W.T`` for a contiguous float32 ``x`` (any rows: passes of 8), through the native kernels."""
        if self.kind == "q4":
            return ops.q4_linear(x, self.qs, self.scale, self.minv)
        return ops.q8_linear(x, self.qs, self.scale)


def pack_exact(w: torch.Tensor) -> Optional[BlockQuantWeight]:
    """The 4-bit (else 8-bit) blocks that rebuild the float32 CPU matrix ``w`` exactly, or None."""
    if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2 or w.shape[1] % GROUP or not w.numel():
        return None
    groups = w.detach().reshape(w.shape[0], -1, GROUP)
    return _pack_q4(groups) or _pack_q8(groups) or _pack_q4_wide(w.detach())


def _as_float16_scale(x: torch.Tensor) -> torch.Tensor:
    # GGUF keeps d in float16: rounding the recovered ratio there lands on the stored value.
    return x.to(torch.float16).to(torch.float32)


def _pack_q4(groups: torch.Tensor, float16_scale: bool = True) -> Optional[BlockQuantWeight]:
    """Q4_1 blocks of ``groups`` ``[N, K / width, width]`` (width a multiple of 32), each group's
    scale and minimum repeated over its 32-wide blocks; ``float16_scale``: the scale was stored
    in float16 (GGUF), else it is the float32 ratio itself (``model.requantize``)."""
    minv = groups.amin(-1)  # the block minimum has q = 0, so it *is* m
    scale = (groups.amax(-1) - minv) / 15  # and the maximum has q = 15
    if float16_scale:
        scale = _as_float16_scale(scale)
    q = torch.where(scale[..., None] > 0, (groups - minv[..., None]) / scale[..., None], 0.0).round_()
    # q in 0..15, and two separately rounded float32 ops, as the dequantizer did: the check is bit for bit.
    if q.amin() < 0 or q.amax() > 15 or not torch.equal(scale[..., None] * q + minv[..., None], groups):
        return None
    per_group = groups.shape[-1] // GROUP  # 32-wide blocks per group: they share its scale
    q = q.to(torch.uint8).reshape(groups.shape[0], -1, GROUP)
    packed = q[..., : GROUP // 2] | (q[..., GROUP // 2:] << 4)
    return BlockQuantWeight("q4", packed.reshape(groups.shape[0], -1).contiguous(),
                            scale.repeat_interleave(per_group, -1).contiguous(),
                            minv.repeat_interleave(per_group, -1).contiguous())


def _pack_q4_wide(w: torch.Tensor) -> Optional[BlockQuantWeight]:
    """A requantized copy's matrix (:mod:`hicache.model.requantize`: 4 bits, groups of 32 or 64,
    float32 scales): the same blocks, rebuilt exactly from float32 ratios."""
    for width in (GROUP, 2 * GROUP):
        if w.shape[1] % width == 0:
            packed = _pack_q4(w.reshape(w.shape[0], -1, width), float16_scale=False)
            if packed is not None:
                return packed
    return None


def _pack_q8(groups: torch.Tensor) -> Optional[BlockQuantWeight]:
    scale = _as_float16_scale(groups.abs().amax(-1) / 127)
    q = torch.where(scale[..., None] > 0, groups / scale[..., None], 0.0).round_()
    if q.abs().amax() > 127 or not torch.equal(scale[..., None] * q, groups):
        return None
    return BlockQuantWeight("q8", q.to(torch.int8).reshape(groups.shape[0], -1).contiguous(), scale.contiguous())
