"""LFM2 (Liquid AI; HF directories only): short-convolution layers (model/recurrent.py) between
attention layers with QK-norm, a SwiGLU MLP whose width transformers derives from the config, a
tied head.

What its config.json says otherwise than a Llama's, read as ``Lfm2Config`` reads it: ``norm_eps``
(default 1e-5); ``tie_embedding`` (older files) over ``tie_word_embeddings`` (default true);
``block_ff_dim`` over ``intermediate_size``, then, with ``block_auto_adjust_ff_dim`` (default
true), the MLP's width is ``int(2 w / 3)``, times ``block_ffn_dim_multiplier`` (when set) and
rounded up to a multiple of ``block_multiple_of`` (LFM2-350M: 6656 -> 4608); ``layer_types``
("conv", "full_attention"), else attention at ``full_attn_idxs`` (older files; absent: every
layer); ``conv_L_cache``: the convolution's taps (default 3); ``conv_bias``; RoPE base 1e6 where
the file gives none. Its names: ``operator_norm`` / ``ffn_norm`` (the two norms), ``self_attn.out_proj``,
``q_layernorm`` / ``k_layernorm``, ``feed_forward.w1`` / ``w3`` / ``w2`` (gate, up, down), the
final norm ``model.embedding_norm``; the conv layer's (``conv.in_proj``...) are the model's own.
The MoE and vision variants are refused.

GGUF files (``general.architecture`` "lfm2", as llama.cpp's converter writes them): the layers
with 0 in the per-layer ``attention.head_count_kv`` are the conv layers (the others' KV heads);
``shortconv.l_cache`` the taps; the conv layer's tensors ``shortconv.in_proj`` / ``conv`` (stored
``[hidden, K]``, squeezed) / ``out_proj``, biases where the file has them; the final norm is
``token_embd_norm``; q/k rows in HF's order (llama.cpp rotates LFM2 NEOX-style). ``lfm2moe`` is
refused.
"""

from __future__ import annotations

from typing import Any, Mapping

from hicache.model.errors import ModelFormatError, as_float, as_int, quoted
from hicache.model.families.base import HF_ATTENTION_TYPES, Family, config_int, kv_layer_kinds
from hicache.model.spec import LayerKind

DEFAULT_ROPE_THETA = 1e6  # Lfm2Config.default_theta


def mlp_width(config: Mapping[str, Any]) -> int:
    """The MLP's width as transformers' ``Lfm2MLP`` computes it from the config (module docstring)."""
    width = config_int(config, "block_ff_dim" if config.get("block_ff_dim") is not None else "intermediate_size")
    adjust = config.get("block_auto_adjust_ff_dim", True)
    if not isinstance(adjust, bool):
        raise ModelFormatError(f"config.json block_auto_adjust_ff_dim = {quoted(adjust)} is not true or false.")
    if not adjust:
        return width
    width = int(2 * width / 3)
    multiplier = config.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is None:
        return width
    width = int(as_float(multiplier, "config.json block_ffn_dim_multiplier") * width)
    multiple = config_int(config, "block_multiple_of", 256)
    return multiple * ((width + multiple - 1) // multiple)


def _hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with the common keys set as Lfm2Config reads its own (module docstring)."""
    out = dict(config, rms_norm_eps=config.get("norm_eps", 1e-5), intermediate_size=mlp_width(config),
               tie_word_embeddings=config.get("tie_embedding", config.get("tie_word_embeddings", True)))
    if config.get("rope_theta") is None and "rope_theta" not in (config.get("rope_parameters") or {}):
        out["rope_theta"] = DEFAULT_ROPE_THETA
    if config.get("layer_types") is None:
        layers = config_int(config, "num_hidden_layers")
        attention = config.get("full_attn_idxs")
        attention = range(layers) if attention is None else attention
        out["layer_types"] = ["full_attention" if i in attention else "conv" for i in range(layers)]
    return out


def _hf_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """LFM2's own fields: the convolution's taps and whether its layer has biases."""
    return dict(conv_kernel=config_int(config, "conv_L_cache", 3, least=2),
                conv_bias=bool(config.get("conv_bias", False)))


def _gguf_fields(fields: Mapping[str, Any], prefix: str, num_layers: int, tensors: frozenset[str]) -> dict[str, Any]:
    """LFM2's layers from its GGUF metadata as llama.cpp reads them (module docstring): a layer with
    0 KV heads is a conv layer."""
    taps = prefix + "shortconv.l_cache"
    return dict(layer_kinds=kv_layer_kinds(fields, prefix, num_layers, LayerKind.CONV),
                conv_kernel=as_int(fields.get(taps, 3), f"GGUF metadata {taps}", 2),
                conv_bias=any(name.endswith(".shortconv.in_proj.bias") for name in tensors))


_REFUSED = "is not supported (only the dense text model, Lfm2ForCausalLM, is)"
LFM2 = Family(
    "lfm2", "lfm2", ("Lfm2ForCausalLM",), gguf_qk_interleaved=False, qk_norm=True, tie_embeddings=True,
    hf_names={"operator_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
              "self_attn.out_proj": "self_attn.o_proj", "self_attn.q_layernorm": "self_attn.q_norm",
              "self_attn.k_layernorm": "self_attn.k_norm", "feed_forward.w1": "mlp.gate_proj",
              "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
              "model.embedding_norm": "model.norm"},
    hf_layer_types={"full_attention": HF_ATTENTION_TYPES["full_attention"], "conv": LayerKind.CONV},
    hf_config=_hf_config, hf_fields=_hf_fields,
    gguf_tensors={"shortconv.in_proj": "conv.in_proj", "shortconv.conv": "conv.conv", "shortconv.out_proj": "conv.out_proj"},
    gguf_top={"token_embd_norm": "model.norm"}, gguf_keys=frozenset({"shortconv.l_cache"}), gguf_fields=_gguf_fields,
    gguf_refused={"lfm2moe": f"LFM2's mixture-of-experts variant {_REFUSED}"},
    hf_refused={name: f"LFM2's {what} {_REFUSED}" for name, what in (
        ("Lfm2MoeForCausalLM", "mixture-of-experts variant"), ("lfm2_moe", "mixture-of-experts variant"),
        ("Lfm2VlForConditionalGeneration", "vision-language variant"), ("lfm2_vl", "vision-language variant"))},
)
