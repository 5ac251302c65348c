"""Llama-family decoder (Llama, Qwen2, Mistral, SmolLM2) over a paged KV cache.

Parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight``...) so a
safetensors checkpoint loads by name. RoPE uses the HF rotate-half convention: within a head,
dimension ``i`` pairs with ``i + head_dim / 2``; loaders of other layouts (GGUF) convert on load.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hicache.model.batch import ForwardBatch, KVView
from hicache.model.spec import ModelSpec, rope_inv_freq


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the statistics taken in float32 (as the reference models do)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


Rows = Optional[tuple[torch.Tensor, torch.Tensor]]


def valid_rows(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, dst)``: rows of the padded ``[B*Q]`` query layout that are real, and the flat
    token index (into T) each one belongs to. Computed once per forward (one host sync on CUDA)
    instead of boolean-masking in every layer."""
    src = batch.q_valid.reshape(-1).nonzero().squeeze(1)
    return src, batch.q_index.reshape(-1).index_select(0, src)


class Attention(nn.Module):
    """GQA self-attention that writes new K/V into the paged buffers, then reads context by slot."""

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        bias = spec.attention_bias
        self.q_proj = nn.Linear(spec.hidden_size, q_width, bias=bias)
        self.k_proj = nn.Linear(spec.hidden_size, kv_width, bias=bias)
        self.v_proj = nn.Linear(spec.hidden_size, kv_width, bias=bias)
        self.o_proj = nn.Linear(q_width, spec.hidden_size, bias=False)
        self.tp_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # sum over TP ranks (model/parallel.py)
        # Uneven TP split: the local KV head of each local query head (None: SDPA's equal groups).
        self.kv_map: Optional[torch.Tensor] = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, kv: KVView, rows: Rows
    ) -> torch.Tensor:
        """``x``: ``[T, hidden]``; ``cos``/``sin``: ``[T, 1, head_dim]`` in x's dtype; ``rows``: see
        :func:`valid_rows`. Returns ``[T, hidden]``."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin

        kv.wait_layer(self.layer)
        k_buf, v_buf = kv.k_buffers[self.layer], kv.v_buffers[self.layer]
        k_buf.index_copy_(0, batch.out_slots, k.to(k_buf.dtype))
        v_buf.index_copy_(0, batch.out_slots, v.to(v_buf.dtype))

        if batch.single:
            # Cold prefill of one sequence: its context is exactly the new tokens, so plain causal
            # attention on them is equivalent to gathering from the buffers (and cheaper).
            # 4-D inputs: torch's CPU flash kernel takes them; 3-D ones fall back to the ~4x slower
            # math path.
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], self._heads(k.transpose(0, 1)[None]), self._heads(v.transpose(0, 1)[None]),
                is_causal=True, enable_gqa=self.kv_map is None,
            )[0]  # [H, T, D]
            return self._out(out.transpose(0, 1).reshape(t, -1))

        # Paged path: queries padded per sequence [B, H, Q, D]; context gathered by slot [B, KvH, K, D].
        # index_select rather than advanced indexing: same result, far less overhead on CPU.
        bsz, max_q = batch.q_index.shape
        ctx = batch.kv_slots.reshape(-1)
        qb = q.index_select(0, batch.q_index.reshape(-1)).view(bsz, max_q, self.num_heads, self.head_dim).transpose(1, 2)
        kb = k_buf.index_select(0, ctx).view(bsz, -1, self.num_kv_heads, self.head_dim).to(q.dtype).transpose(1, 2)
        vb = v_buf.index_select(0, ctx).view(bsz, -1, self.num_kv_heads, self.head_dim).to(q.dtype).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, self._heads(kb), self._heads(vb), attn_mask=batch.attn_mask,
                                             enable_gqa=self.kv_map is None)
        out = out.transpose(1, 2).reshape(bsz * max_q, -1)  # [B*Q, H*D]
        assert rows is not None  # computed for every non-single batch
        src_rows, dst_rows = rows
        flat = torch.empty(t, out.shape[1], dtype=out.dtype, device=out.device)
        flat.index_copy_(0, dst_rows, out.index_select(0, src_rows))
        return self._out(flat)

    def _heads(self, kv: torch.Tensor) -> torch.Tensor:
        """``[B, KvH, K, D]`` as SDPA reads it: as is, or one KV head per query head."""
        return kv if self.kv_map is None else kv.index_select(1, self.kv_map)

    def _out(self, x: torch.Tensor) -> torch.Tensor:
        out = self.o_proj(x)
        return out if self.tp_reduce is None else self.tp_reduce(out)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.tp_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # sum over TP ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out if self.tp_reduce is None else self.tp_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, kv: KVView, rows: Rows
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, kv, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head. Parameters are allocated uninitialized; a loader fills them.

    ``forward`` writes the batch's new K/V into ``kv`` and returns float32 logits
    ``[len(batch.logits_index), vocab_size]``.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.spec = spec
        self.dtype = dtype
        self.device = torch.device(device)
        # Build on the meta device, then allocate once: skips the default init of every Linear,
        # which costs seconds for real models and is overwritten by the loader anyway.
        with torch.device("meta"):
            self.model = LlamaModel(spec)
            self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
            self.to(dtype)
        self.to_empty(device=self.device)
        self.requires_grad_(False)
        self.eval()
        # Plain attribute, not a buffer: it must stay float32 whatever the weight dtype.
        self.inv_freq = rope_inv_freq(spec).to(self.device)
        # A pipeline stage (model/parallel.py) holds some layers: the first embeds, the last
        # returns logits, the others take and return hidden states.
        self.first_stage = self.last_stage = True

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, 1, head_dim]`` for absolute ``positions`` (angles in float32, then cast)."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, batch: ForwardBatch, kv: KVView, hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits on the last stage; elsewhere the hidden states ``[T, hidden]`` for the next
        stage. ``hidden``: the previous stage's output (not on the first stage)."""
        h = self.model.embed_tokens(batch.input_ids) if self.first_stage else hidden
        cos, sin = self.rope(batch.positions, h.dtype)
        rows = None if batch.single else valid_rows(batch)
        for layer in self.model.layers:
            h = layer(h, cos, sin, batch, kv, rows)
        if not self.last_stage:
            return h
        # Only the requested rows go through the final norm and the (vocab-wide) head.
        h = self.model.norm(h[batch.logits_index])
        return F.linear(h, self.lm_head_weight()).float()
