"""Layers every decoder shares, whatever its attention: RMSNorm, the SwiGLU MLP, rotary
embedding, and the native CPU kernels beside each.

Each native kernel is the same arithmetic as the torch ops beside it, bit for bit (float32):
they only save Python dispatches and intermediate tensors. RoPE follows the HF rotate-half
convention: within a head, dimension ``i`` pairs with ``i + rope_dim / 2``.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hicache.kernels import cpu_kernels
from hicache.model.projection import Projection
from hicache.model.spec import ModelSpec, rope_scaling_type


def native_ops(x: torch.Tensor):
    """The native CPU kernels when they serve ``x`` (a contiguous float32 CPU tensor), else None:
    the torch ops beside each call are the same arithmetic for every other device and dtype."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    return cpu_kernels()


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the statistics taken in float32 (as the reference models do)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; the same arithmetic as below
            ops = native_ops(x)
            if ops is not None:  # torch's CPU rms_norm is several small ops: a decode step pays 60 of them
                return ops.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)  # rounded before the weight, as the reference models do


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; GeGLU (``hidden_act`` "gelu_tanh", Gemma): GELU's
    tanh form in place of SiLU."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gelu = spec.hidden_act == "gelu_tanh"
        self.gate_proj, self.up_proj = (nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False) for _ in "gu")
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.gate_up = Projection(self.gate_proj, self.up_proj)
        self.down = Projection(self.down_proj)
        self.tp_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # sum over TP ranks

    def forward(self, x: torch.Tensor, generated: bool) -> torch.Tensor:
        """``x``: ``[T, hidden]``; ``generated``: the rows are generated tokens (``ForwardBatch.generated``)."""
        gate_up = self.gate_up.whole(x, generated)
        ops = native_ops(gate_up)
        if ops is not None and gate_up.shape[-1] % 16 == 0 and not self.gelu:
            hidden = ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        out = self.down(hidden, generated)
        return out if self.tp_reduce is None else self.tp_reduce(out)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's partner of each dimension (HF rotate-half convention): ``[-x2, x1]``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_inv_freq(spec: ModelSpec, local: bool = False) -> torch.Tensor:
    """Per-pair rotary frequencies ``[rope_dim // 2]`` float32 (radians per position), scaling applied.
    ``local``: those of sliding-window layers (``spec.local_rope_theta``, no scaling)."""
    dim = spec.rope_dim
    theta = spec.local_rope_theta if local else spec.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = "default" if local else rope_scaling_type(spec.rope_scaling)
    scaling = spec.rope_scaling or {}
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "freq_factors":
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band between
        # is blended linearly in (context / wavelength).
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq  # low frequencies: wavelengths past old_ctx / low; high: below old_ctx / high
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(in_band, blended, scaled)
    elif kind == "yarn":
        low, high = _yarn_bounds(spec, scaling)
        ramp = ((torch.arange(inv_freq.numel(), dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
        inv_freq = inv_freq / float(scaling["factor"]) * ramp + inv_freq * (1 - ramp)
    return inv_freq.to(torch.float32)


def _yarn_bounds(spec: ModelSpec, scaling: dict) -> tuple[float, float]:
    """The rotary pairs between which YaRN blends (floor / ceil of the dims that turn ``beta_fast`` and
    ``beta_slow`` times over the original context): below the first kept, past the second divided."""
    dim, base = spec.rope_dim, spec.rope_theta
    context = float(scaling.get("original_max_position_embeddings") or spec.max_position_embeddings)

    def dim_turning(turns: float) -> float:
        return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(float(scaling.get("beta_fast") or 32)), dim_turning(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def rope_attention_factor(spec: ModelSpec) -> float:
    """What YaRN multiplies cos and sin by (``attention_factor``, else from ``factor`` and ``mscale`` /
    ``mscale_all_dim``: ``0.1 * m * ln(factor) + 1``); 1 for other scalings."""
    scaling = spec.rope_scaling or {}
    if rope_scaling_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(float(m)) / mscale(float(m_all)) if m and m_all else mscale(1.0)


class RotaryEmbedding:
    """cos/sin of each absolute position, computed once per forward and shared by every layer."""

    def __init__(self, spec: ModelSpec, device: torch.device, local: bool = False) -> None:
        # Plain tensor, not a module buffer: it must stay float32 whatever the weight dtype.
        self.inv_freq = rope_inv_freq(spec, local).to(device)
        self.scale = 1.0 if local else rope_attention_factor(spec)  # YaRN's; 1 otherwise

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, 1, rope_dim]`` for ``positions`` ``[T]`` (angles in float32, then cast)."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)  # (* 1.0: the same bits)
