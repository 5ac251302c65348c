"""A transformers model written as an F32 GGUF file the way llama.cpp's ``convert_hf_to_gguf.py``
writes its family (tensor names, metadata keys, Llama's q/k row interleave, Gemma's norms with their
1 folded in), with the gguf
package's writer, so the GGUF loader can be checked against transformers on the same weights.
The tokenizer fields are the committed tiny file's (a 320-token byte-level BPE)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gguf_edit import TINY

# HF parameter (after "model.layers.{i}.") -> GGUF tensor (after "blk.{i}.")
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # the last two: Phi-3's fused ones
GEMMA_LAYER = {**LAYER, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def interleave(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permute of Llama q/k rows: within a head, HF rows j and j + d/2 become 2j and 2j + 1."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def hf_to_gguf(model, path: Path, arch: str, pre: str = "gpt-2", q8_0: bool = False) -> Path:
    """Write ``model`` (a transformers Llama, Mistral, Qwen2, Qwen3, Gemma 3 or Phi-3 causal LM) to ``path`` as GGUF
    ``arch``. ``q8_0``: the layers' matrices as Q8_0 blocks (the gguf package's quantizer), the rest F32."""
    import gguf

    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    writer.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))  # Gemma 3: the full layers'

    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converter writes Qwen2's
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if getattr(cfg, "sliding_window", None):  # Gemma 3; Mistral (llama.cpp keeps it in a llama file)
        writer.add_sliding_window(cfg.sliding_window)
    if arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(head_dim)
    elif head_dim != cfg.hidden_size // heads or arch == "gemma3":  # Qwen3: heads narrower or wider than hidden / heads
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    reader = gguf.GGUFReader(TINY)
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            value = pre if field.name == "tokenizer.ggml.pre" else field.contents()
            writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    layer_names = GEMMA_LAYER if arch == "gemma3" else LAYER
    for name, p in model.state_dict().items():
        value = p.detach().float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            value = value + 1.0  # Gemma computes 1 + w: llama.cpp's converter folds the 1 in
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{layer_names[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                value = interleave(value, heads if "q_proj" in module else kv_heads)
        if q8_0 and gguf_name.startswith("blk.") and value.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(value), kind), raw_dtype=kind)
            continue
        writer.add_tensor(gguf_name, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
