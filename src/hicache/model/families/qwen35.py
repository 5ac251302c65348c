"""Qwen3.5 (dense; HF directories only): gated DeltaNet layers (model/recurrent.py: GatedDeltaNet)
between gated attention layers -- q_proj emits each head's query and its output gate, QK-norm,
partial rotary -- a SwiGLU MLP, zero-centred RMSNorm weights (``1 + w``, folded in at load) but for
the DeltaNet's gated norm, stored as is.

What its config.json says, read as ``Qwen3_5TextConfig`` reads it: ``layer_types``
("linear_attention", "full_attention"), else every ``full_attention_interval``-th layer (default
4) full; ``linear_num_key_heads`` / ``linear_num_value_heads`` / ``linear_key_head_dim`` /
``linear_value_head_dim`` / ``linear_conv_kernel_dim`` (defaults 16, 32, 128, 128, 4);
``head_dim`` (default 256); ``partial_rotary_factor`` in ``rope_parameters``, else at the top,
else 0.25: RoPE turns the first ``int(head_dim * factor)`` dims of each head. ``rope_parameters``'
``mrope_section`` / ``mrope_interleaved`` are dropped: a text token has the same position on the
three mRoPE axes, which is plain RoPE over the rotary dims. ``attn_output_gate`` false and an
``output_gate_type`` other than sigmoid are refused (transformers' layer always gates by a sigmoid).

The official checkpoints are ``Qwen3_5ForConditionalGeneration``: the text model's config under
``text_config`` (the head tied as the outer config says), its tensors under
``model.language_model.``; the vision tower (``model.visual.``) and the multi-token-prediction
head (``mtp.``) are not loaded (one log line), in either layout. The engine takes text only.
Refused: the MoE variants (Qwen3.5-MoE, Qwen3-Next, which is MoE only). GGUF files are not read.
"""

from __future__ import annotations

from typing import Any, Mapping

from hicache.model.errors import ModelFormatError, as_float, quoted
from hicache.model.families.base import HF_ATTENTION_TYPES, Family, config_int
from hicache.model.spec import LayerKind

DEFAULT_PARTIAL_ROTARY = 0.25  # Qwen3_5TextConfig's, where a config gives none
DEFAULT_HEAD_DIM = 256
MROPE_KEYS = ("mrope_section", "mrope_interleaved")  # equal positions per axis for text: plain RoPE


def _hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with its layer types, head width and RoPE parameters as Qwen3_5TextConfig reads them."""
    out = dict(config)
    if config.get("head_dim") is None:
        out["head_dim"] = DEFAULT_HEAD_DIM
    if config.get("layer_types") is None:
        interval = config_int(config, "full_attention_interval", 4)
        out["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                              for i in range(config_int(config, "num_hidden_layers"))]
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        out["rope_parameters"] = {key: value for key, value in rope.items() if key not in MROPE_KEYS}
    return out


def _rotary_dim(config: Mapping[str, Any]) -> int:
    """The dims of each head RoPE turns (0: all of them) from ``partial_rotary_factor``."""
    rope = config.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    factor = DEFAULT_PARTIAL_ROTARY if factor is None else as_float(factor, "config.json partial_rotary_factor")
    if not 0 < factor <= 1:
        raise ModelFormatError(f"config.json partial_rotary_factor = {quoted(factor)} is not in (0, 1].")
    head_dim = config_int(config, "head_dim")
    dims = int(head_dim * factor)
    return 0 if dims == head_dim else dims


def _hf_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3.5's own fields: the DeltaNet's sizes, the output gate, partial rotary."""
    gate, gate_type = config.get("attn_output_gate", True), config.get("output_gate_type")
    if gate is not True or gate_type not in (None, "sigmoid"):
        key, value = ("attn_output_gate", gate) if gate is not True else ("output_gate_type", gate_type)
        raise ModelFormatError(f"config.json {key} = {quoted(value)} changes the attention's output gate in a way "
                               "this engine does not implement (a sigmoid gate on every head); the model is refused.")
    return dict(conv_kernel=config_int(config, "linear_conv_kernel_dim", 4, least=2),
                gdn_key_heads=config_int(config, "linear_num_key_heads", 16),
                gdn_value_heads=config_int(config, "linear_num_value_heads", 32),
                gdn_key_dim=config_int(config, "linear_key_head_dim", 128),
                gdn_value_dim=config_int(config, "linear_value_head_dim", 128),
                attn_output_gate=True, rotary_dim=_rotary_dim(config))


_MOE = "mixture-of-experts variant is not supported (only the dense Qwen3.5 models are)"
QWEN35 = Family(
    "qwen3_5", None, ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), qk_norm=True, hf_norm_offset=True,
    hf_layer_types={"full_attention": HF_ATTENTION_TYPES["full_attention"], "linear_attention": LayerKind.GDN},
    hf_config=_hf_config, hf_fields=_hf_fields, hf_own_keys=frozenset({"partial_rotary_factor"}),
    hf_plain_norms=("linear_attn.norm",),
    hf_multimodal=("Qwen3_5ForConditionalGeneration",), hf_prefixes={"model.language_model.": "model."},
    hf_skipped=("model.visual.", "mtp."),
    hf_refused={**{name: f"Qwen3.5's {_MOE}" for name in (
        "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", "qwen3_5_moe_text")},
        **{name: "Qwen3-Next has mixture-of-experts layers only, which are not supported (the dense Qwen3.5 models "
                 "are)" for name in ("Qwen3NextForCausalLM", "qwen3_next")}},
)
