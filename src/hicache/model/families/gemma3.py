"""Gemma 3 (text): four norms a layer, GeGLU (GELU's tanh form), QK-norm, embeddings times
sqrt(hidden), a tied head, and 5 sliding-window layers to 1 full one.

HF checkpoints store each RMSNorm weight as ``w`` and compute ``1 + w``; llama.cpp's converter
folds the 1 into the GGUF file. GGUF files carry neither the layer pattern nor the local RoPE base
nor the attention scale: llama.cpp hard-codes them (every 6th layer full, local base 10K, scores
scaled by key_length^-1/2 -- but by (hidden / heads)^-1/2 for the 27B model, 62 layers), and so
does this module."""

from __future__ import annotations

from typing import Any, Mapping

from hicache.model.families.base import Family

_27B_LAYERS = 62  # how llama.cpp tells the 27B model, whose query_pre_attn_scalar is hidden / heads


def _gguf_attention_scale(fields: Mapping[str, Any], prefix: str) -> float:
    hidden, heads = int(fields[prefix + "embedding_length"]), int(fields[prefix + "attention.head_count"])
    if int(fields[prefix + "block_count"]) == _27B_LAYERS:
        return (hidden / heads) ** -0.5
    return float(fields.get(prefix + "attention.key_length", hidden // heads)) ** -0.5


GEMMA3 = Family(
    "gemma3", "gemma3", ("Gemma3ForCausalLM",), gguf_qk_interleaved=False, qk_norm=True, hidden_act="gelu_tanh",
    sandwich_norms=True, scaled_embeddings=True, hf_norm_offset=True, sliding_pattern=6, local_rope_theta=10000.0,
    gguf_tensors={"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                  "post_ffw_norm": "post_feedforward_layernorm"},
    gguf_keys=frozenset({"attention.sliding_window"}), gguf_attention_scale=_gguf_attention_scale,
    tie_embeddings=True,
)
