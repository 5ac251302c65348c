"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over the paged KV pool, absorbed form.

Per token and layer the cache keeps one latent ``[c | k_pe]``: ``c`` = kv_a_layernorm of the
first ``kv_lora_rank`` outputs of ``kv_a_proj_with_mqa``, ``k_pe`` = its last
``qk_rope_head_dim`` outputs after RoPE (shared by every head). The pool stores the latent as one
"KV head" split in halves over its K and V buffers (:class:`~hicache.model.spec.ModelSpec`).

Absorbed attention: ``kv_b_proj`` holds per head ``W_UK`` [nope, rank] and ``W_UV`` [v, rank].
A head's score ``q_nope . (W_UK c) + q_pe . k_pe`` equals ``[W_UK^T q_nope | q_pe] . [c | k_pe]``,
so attention runs as multi-query attention with the latent as key *and* value (one KV head,
``rank + rope`` wide); the first ``rank`` dims of the output are ``softmax . c``, and ``W_UV``
turns them into each head's value. The softmax scale stays ``1 / sqrt(nope + rope)``.

Parameter names follow Hugging Face (``self_attn.kv_a_proj_with_mqa.weight``...). RoPE: with
``rope_interleave`` (DeepSeek-V3) a rotary pair is two adjacent dims; as in transformers, q and
k are rotated and laid out evens-then-odds, which leaves every score unchanged.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from hicache.model.batch import ForwardBatch, KVView
from hicache.model.layers import RMSNorm, rotate_half
from hicache.model.projection import Projection
from hicache.model.spec import ModelSpec

# transformers builds the two small MLA norms with their default eps, whatever rms_norm_eps says.
MLA_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    """MLA self-attention: each new token's latent and absorbed query here; the batch's backend
    stores the latent in the pool and attends over the context latents. ``num_heads`` are this
    rank's heads (TP splits heads; the latent is the same on every rank)."""

    latent = True  # the pool's K and V buffers hold the two halves of one latent per token
    window = 0  # MLA layers attend every earlier position

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = spec.num_heads
        self.nope, self.rope, self.v_dim, self.rank = (spec.qk_nope_head_dim, spec.qk_rope_head_dim,
                                                       spec.v_head_dim, spec.kv_lora_rank)
        qk = self.nope + self.rope
        h, bias = spec.hidden_size, spec.attention_bias
        self.q_lora = spec.q_lora_rank > 0
        if self.q_lora:
            self.q_a_proj = nn.Linear(h, spec.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, MLA_NORM_EPS)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, spec.num_heads * qk, bias=False)
            self.q_up = Projection(self.q_b_proj)
        else:
            self.q_proj = nn.Linear(h, spec.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, MLA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, spec.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(spec.num_heads * self.v_dim, h, bias=bias)
        # q (or q_a) and kv_a read the same input: one GEMM.
        self.inputs = Projection(self.q_a_proj if self.q_lora else self.q_proj, self.kv_a_proj_with_mqa)
        self.out = Projection(self.o_proj)
        self.tp_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.kv_map = None  # (GQA's uneven-TP map: MLA has one latent for every head)
        # SDPA scales by 1/sqrt(rank + rope), the latent's width; the model wants 1/sqrt(nope + rope).
        self.q_scale = math.sqrt((self.rank + self.rope) / qk)
        self.rope_interleave = spec.rope_interleave

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rope_interleave:  # pairs (0, 1), (2, 3)... to halves: even dims, then odd (slices: no index tensor)
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return x * cos + rotate_half(x) * sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                kv: KVView) -> torch.Tensor:
        """``x``: ``[T, hidden]``; ``cos``/``sin``: ``[T, 1, qk_rope_head_dim]``. Returns ``[T, hidden]``."""
        t, heads = x.shape[0], self.num_heads
        q, ckv = self.inputs(x, batch.generated)
        if self.q_lora:
            q = self.q_up(self.q_a_layernorm(q.contiguous()), batch.generated)
        q_nope, q_pe = q.view(t, heads, self.nope + self.rope).split((self.nope, self.rope), dim=-1)
        c, k_pe = ckv.split((self.rank, self.rope), dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c.contiguous()), self._rotate(k_pe, cos[:, 0], sin[:, 0])), dim=-1)
        w = self.kv_b_proj.weight.view(heads, self.nope + self.v_dim, self.rank)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w[:, : self.nope])
        q_full = torch.cat((q_latent, self._rotate(q_pe, cos, sin)), dim=-1) * self.q_scale
        latent = latent.view(t, 1, -1)

        half = kv.k_buffers[self.layer].shape[-1]  # the latent's first half goes to the K buffer
        out = batch.backend.forward(q_full, latent[..., :half], latent[..., half:], self, batch, kv)
        values = torch.einsum("thr,hvr->thv", out[..., : self.rank], w[:, self.nope:])  # softmax . c, then W_UV
        out = self.out(values.reshape(t, heads * self.v_dim), batch.generated)
        return out if self.tp_reduce is None else self.tp_reduce(out)
