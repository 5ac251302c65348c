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
Refused: the MoE variants (Qwen3.5-MoE, Qwen3-Next, which is MoE only).

GGUF files (``general.architecture`` "qwen35", as llama.cpp's converter writes them): every
``full_attention_interval``-th layer (default 4) is attention, the others DeltaNet;
``ssm.group_count`` / ``ssm.state_size`` the key heads and their width, ``ssm.time_step_rank`` the
value heads, ``ssm.inner_size`` their rows in all, ``ssm.conv_kernel`` the taps,
``rope.dimension_count`` the rotary dims; ``rope.dimension_sections`` (llama.cpp's interleaved
mRoPE) is read and left: a text token has one position on every axis. The DeltaNet's tensors are
``attn_qkv``, ``attn_gate`` (z), ``ssm_beta``, ``ssm_alpha``, ``ssm_conv1d`` (squeezed), ``ssm_dt.bias``,
``ssm_a`` (stored ``-exp(A_log)``), ``ssm_norm``, ``ssm_out``; the norms hold ``1 + w`` already (the
gated one as it is); where value heads outnumber key heads, the converter stores the value heads
tiled (``k0v0, k1v0, .., k0v1, ..``) instead of grouped by key head, in every tensor with value rows
(and ``ssm_out``'s columns), which the loader puts back. The MTP head a newer converter appends
(``nextn_predict_layers`` blocks after the model's) is not loaded. ``qwen3next`` and ``qwen35moe``
are refused.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from hicache.model.errors import ModelFormatError, as_float, as_int, quoted
from hicache.model.families.base import HF_ATTENTION_TYPES, Family, config_int
from hicache.model.spec import LayerKind, ModelSpec

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


def _gguf_fields(fields: Mapping[str, Any], prefix: str, num_layers: int, tensors: frozenset[str]) -> dict[str, Any]:
    """Qwen3.5's own fields from its GGUF metadata, as llama.cpp reads them (module docstring)."""
    def size(key: str, default: Any = None, least: int = 1) -> int:
        return as_int(fields.get(prefix + key, default), f"GGUF metadata {prefix}{key}", least)

    value_heads, rows = size("ssm.time_step_rank"), size("ssm.inner_size")
    if rows % value_heads:
        raise ModelFormatError(f"GGUF metadata {prefix}ssm.inner_size = {rows} is not a multiple of the value heads "
                               f"(ssm.time_step_rank = {value_heads}).")
    interval = size("full_attention_interval", 4)
    kinds = tuple(LayerKind.FULL if (i + 1) % interval == 0 else LayerKind.GDN for i in range(num_layers))
    head_dim = size("attention.key_length", size("embedding_length") // size("attention.head_count"))
    rotary = size("rope.dimension_count", head_dim)
    return dict(layer_kinds=kinds if LayerKind.GDN in kinds else (), conv_kernel=size("ssm.conv_kernel", least=2),
                gdn_key_heads=size("ssm.group_count"), gdn_key_dim=size("ssm.state_size"), gdn_value_heads=value_heads,
                gdn_value_dim=rows // value_heads, attn_output_gate=True, rotary_dim=0 if rotary == head_dim else rotary)


def tiled_to_grouped(key_heads: int, groups: int, width: int) -> torch.Tensor:
    """Where llama.cpp's converter put each of the model's value rows: it stores the value heads
    tiled (k0v0, k1v0, .., k0v1, ..: ggml repeats the key heads by tiling) where transformers groups
    them by key head (k0v0, k0v1, .., k1v0, ..); ``width`` rows a head. Model row i is file row [i]."""
    return torch.arange(groups * key_heads * width).view(groups, key_heads, width).transpose(0, 1).reshape(-1)


def _gguf_row_order(name: str, spec: ModelSpec) -> torch.Tensor | None:
    """The file rows of parameter ``name``'s rows in the model's order, for the DeltaNet tensors the
    converter reorders (the value rows, after the q and k rows of the fused projection and conv)."""
    groups = spec.gdn_value_heads // spec.gdn_key_heads if spec.gdn_key_heads else 1
    if groups == 1 or ".linear_attn." not in name:
        return None
    keys, dv = 2 * spec.gdn_key_heads * spec.gdn_key_dim, spec.gdn_value_dim
    lead, width = {"in_proj_qkv.weight": (keys, dv), "conv1d.weight": (keys, dv), "in_proj_z.weight": (0, dv),
                   "in_proj_b.weight": (0, 1), "in_proj_a.weight": (0, 1), "A_log": (0, 1),
                   "dt_bias": (0, 1)}.get(name.rpartition(".linear_attn.")[2], (None, None))
    if lead is None:
        return None
    return torch.cat([torch.arange(lead), lead + tiled_to_grouped(spec.gdn_key_heads, groups, width)])


def _gguf_values(name: str, values: torch.Tensor, spec: ModelSpec) -> torch.Tensor | None:
    """What the converter stored otherwise, undone: ``A_log`` from ``ssm_a = -exp(A_log)`` (in float64,
    then rounded once), ``out_proj``'s columns from the tiled value heads; None for the rest."""
    if name.endswith(".linear_attn.A_log"):
        return torch.log(-values.double()).float()  # (a value >= 0: not finite, refused by the loader)
    groups = spec.gdn_value_heads // spec.gdn_key_heads if spec.gdn_key_heads else 1
    if groups > 1 and name.endswith(".linear_attn.out_proj.weight"):
        return values[:, tiled_to_grouped(spec.gdn_key_heads, groups, spec.gdn_value_dim)]
    return None


_GGUF_KEYS = ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size",
              "full_attention_interval", "rope.dimension_sections", "nextn_predict_layers")
_MOE = "mixture-of-experts variant is not supported (only the dense Qwen3.5 models are)"
QWEN35 = Family(
    "qwen3_5", "qwen35", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), gguf_qk_interleaved=False,
    qk_norm=True, hf_norm_offset=True,
    hf_layer_types={"full_attention": HF_ATTENTION_TYPES["full_attention"], "linear_attention": LayerKind.GDN},
    hf_config=_hf_config, hf_fields=_hf_fields, hf_own_keys=frozenset({"partial_rotary_factor"}),
    hf_plain_norms=("linear_attn.norm",),
    hf_multimodal=("Qwen3_5ForConditionalGeneration",), hf_prefixes={"model.language_model.": "model."},
    hf_skipped=("model.visual.", "mtp."),
    gguf_tensors={"attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                  "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
                  "ssm_conv1d": "linear_attn.conv1d", "ssm_dt.bias": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log",
                  "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
                  "post_attention_norm": "post_attention_layernorm"},
    gguf_keys=frozenset(_GGUF_KEYS), gguf_fields=_gguf_fields, gguf_row_order=_gguf_row_order,
    gguf_values=_gguf_values,
    gguf_refused={"qwen35moe": f"Qwen3.5's {_MOE}",
                  "qwen3next": "Qwen3-Next has mixture-of-experts layers only, which are not supported (dense Qwen3.5 "
                               "files, 'qwen35', are)"},
    hf_refused={**{name: f"Qwen3.5's {_MOE}" for name in (
        "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", "qwen3_5_moe_text")},
        **{name: "Qwen3-Next has mixture-of-experts layers only, which are not supported (the dense Qwen3.5 models "
                 "are)" for name in ("Qwen3NextForCausalLM", "qwen3_next")}},
)
