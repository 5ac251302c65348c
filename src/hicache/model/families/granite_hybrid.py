"""Granite 4.0-H (IBM; ``GraniteMoeHybridForCausalLM`` with dense MLPs: the micro and dense tiny
models): Mamba2 layers (model/recurrent.py: Mamba2Mixer) between attention
layers, a SwiGLU MLP, Granite's multipliers.

What its config.json says, read as ``GraniteMoeHybridConfig`` reads it: ``layer_types`` (or
``layers_block_type``; "mamba" / "attention", or transformers 5's "linear_attention" /
``full_attention``; absent: every layer Mamba2); ``num_local_experts`` (default 8) must be 0: the
MLP is then the ``shared_mlp`` alone, ``input_linear`` holding gate then up rows (width
``shared_intermediate_size``, default 1024), ``output_linear`` the down projection;
``mamba_n_heads`` / ``mamba_n_groups`` / ``mamba_d_state`` / ``mamba_d_conv`` / ``mamba_expand``
(defaults 128, 1, 256, 4, 2), ``mamba_d_head`` ("auto": ``mamba_expand * hidden_size /
mamba_n_heads``), ``mamba_conv_bias`` (default true) and ``mamba_proj_bias`` (false);
``time_step_limit`` (default ``(0, inf)``: the upper bound stored as None), the clamp of the time
step; ``embedding_multiplier``, ``attention_multiplier`` (the attention's score scale, in place of
``head_dim ** -0.5``), ``residual_multiplier`` and ``logits_scaling`` (the logits divided by it),
each 1 where absent; ``position_embedding_type`` "nope" or absent (no RoPE: Granite 4.0-H's) or
"rope" (``rope_theta`` / ``rope_parameters``). ``mamba_chunk_size`` is a kernel's block size, not
the math's (the engine scans 64-token chunks), and ``time_step_min`` / ``time_step_max`` /
``time_step_floor`` only initialise dt_bias for training: neither is read.

Refused, in one sentence each: the mixture-of-experts models (``num_local_experts`` > 0, or
``mlp_layer_types`` naming sparse layers) and Granite's attention-only MoE architectures; a bias
on the attention's projections (transformers' Granite puts one on o_proj too); a position
embedding type other than these.

GGUF files (``general.architecture`` "granitehybrid", as llama.cpp's converter writes them): the
layers with 0 in the per-layer ``attention.head_count_kv`` are the Mamba2 layers;
``ssm.time_step_rank`` the Mamba2 heads, ``ssm.inner_size`` their channels in all,
``ssm.group_count`` / ``ssm.state_size`` / ``ssm.conv_kernel`` the groups, state and taps;
``embedding_scale``, ``attention.scale``, ``residual_scale`` and ``logit_scale`` the multipliers
(absent or 0: none, and the score scale ``head_dim ** -0.5``, as llama.cpp reads them);
``expert_shared_feed_forward_length`` the shared MLP's width (the dense MLP's tensors, as
``feed_forward_length``, say it); ``rope.scaling.finetuned`` false: no RoPE (the converter writes false for every Granite 4.0-H; absent:
RoPE, llama.cpp's default for Granite). The Mamba2 tensors are ``ssm_in``, ``ssm_conv1d`` (squeezed),
``ssm_dt.bias``, ``ssm_a`` (``-exp(A_log)``, stored ``[heads, 1]``), ``ssm_d`` (``[heads, 1]``),
``ssm_norm`` (``[groups, d_inner / groups]``), ``ssm_out``; the shared MLP's ``input_linear`` is
split into ``ffn_gate`` / ``ffn_up``; q/k rows in llama.cpp's interleaved order. No time step clamp
(the converter writes none; Granite's default is none). A file with ``expert_count`` > 0 (the MoE
models share the architecture name) is refused.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from hicache.model.errors import ModelFormatError, as_float, as_int, quoted
from hicache.model.families.base import HF_ATTENTION_TYPES, Family, config_int, kv_layer_kinds
from hicache.model.spec import LayerKind, ModelSpec

MULTIPLIERS = {"embedding_multiplier": "embedding_scale", "attention_multiplier": "attention_scale",
               "residual_multiplier": "residual_scale", "logits_scaling": "logits_scale"}  # config.json -> ModelSpec
GGUF_MULTIPLIERS = {"embedding_scale": "embedding_scale", "attention.scale": "attention_scale",
                    "residual_scale": "residual_scale", "logit_scale": "logits_scale"}  # GGUF key -> ModelSpec field
DEFAULT_EXPERTS = 8  # GraniteMoeHybridConfig's num_local_experts, where a config gives none


def _hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with its layer types, MLP width and RoPE keys as GraniteMoeHybridConfig reads them."""
    out = dict(config, intermediate_size=config_int(config, "shared_intermediate_size", 1024))
    types = config.get("layer_types", config.get("layers_block_type"))
    out["layer_types"] = ["mamba"] * config_int(config, "num_hidden_layers") if types is None else types
    if _nope(config):  # the RoPE keys name nothing the model computes
        out.pop("rope_scaling", None), out.pop("rope_parameters", None)
    return out


def _nope(config: Mapping[str, Any]) -> bool:
    """Whether the attention layers go without RoPE (transformers' model rotates only under "rope")."""
    kind = config.get("position_embedding_type")
    if kind not in (None, "nope", "rope"):
        raise ModelFormatError(f"config.json position_embedding_type = {quoted(kind)} is not implemented (\"nope\" and "
                               "\"rope\" are); the model is refused rather than run wrongly.")
    return kind != "rope"


def _refuse_experts(config: Mapping[str, Any]) -> None:
    experts = config.get("num_local_experts", DEFAULT_EXPERTS)
    sparse = "sparse" in (config.get("mlp_layer_types") or ())
    if experts != 0 or sparse:  # (null too: transformers' layer compares it with 0 and fails)
        what = "mlp_layer_types naming sparse layers" if sparse else f"num_local_experts = {quoted(experts)}"
        raise ModelFormatError(f"Granite's mixture-of-experts models ({what}) are not supported (only the dense "
                               "Granite 4.0-H models, num_local_experts 0, are).")
    if config.get("attention_bias"):
        raise ModelFormatError("config.json attention_bias = true puts a bias on Granite's o_proj too, which this "
                               "engine does not implement; the model is refused.")


def _mamba_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The Mamba2 layer's sizes as GraniteMoeHybridConfig derives them."""
    heads, hidden = config_int(config, "mamba_n_heads", 128), config_int(config, "hidden_size")
    inner = config_int(config, "mamba_expand", 2) * hidden
    head_dim = config.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else config_int(config, "mamba_d_head")
    if head_dim * heads != inner:
        raise ModelFormatError(f"config.json mamba_d_head x mamba_n_heads ({head_dim} x {heads}) is not mamba_expand x "
                               f"hidden_size ({inner}), as Granite's Mamba2 layer needs.")
    return dict(mamba_heads=heads, mamba_head_dim=head_dim, mamba_groups=config_int(config, "mamba_n_groups", 1),
                mamba_state=config_int(config, "mamba_d_state", 256),
                conv_kernel=config_int(config, "mamba_d_conv", 4, least=2),
                conv_bias=bool(config.get("mamba_conv_bias", True)),
                mamba_proj_bias=bool(config.get("mamba_proj_bias")))


def _dt_limits(config: Mapping[str, Any]) -> dict[str, Any]:
    """``time_step_limit`` as ``dt_min`` / ``dt_max`` (an infinite bound, or no limit at all: None)."""
    limit = config.get("time_step_limit", (0.0, math.inf))
    if limit is None:
        return dict(dt_min=0.0, dt_max=None)
    if not (isinstance(limit, (list, tuple)) and len(limit) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in limit)
            and 0 <= limit[0] < limit[1] and math.isfinite(limit[0])):
        raise ModelFormatError(f"config.json time_step_limit = {quoted(limit)} is not two numbers 0 <= low < high.")
    return dict(dt_min=float(limit[0]), dt_max=None if math.isinf(limit[1]) else float(limit[1]))


def _hf_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """Granite 4.0-H's own fields: the Mamba2 sizes, the time step's clamp, the multipliers, NoPE."""
    _refuse_experts(config)
    scales = {ours: as_float(config.get(key, 1.0), f"config.json {key}") for key, ours in MULTIPLIERS.items()}
    return dict(**_mamba_fields(config), **_dt_limits(config), **scales, nope=_nope(config))


def _gguf_fields(fields: Mapping[str, Any], prefix: str, num_layers: int, tensors: frozenset[str]) -> dict[str, Any]:
    """Granite 4.0-H's own fields from its GGUF metadata, as llama.cpp reads them (module docstring)."""
    def size(key: str, least: int = 1) -> int:
        return as_int(fields.get(prefix + key), f"GGUF metadata {prefix}{key}", least)

    heads, inner = size("ssm.time_step_rank"), size("ssm.inner_size")
    if inner % heads:
        raise ModelFormatError(f"GGUF metadata {prefix}ssm.inner_size = {inner} is not a multiple of the Mamba2 heads "
                               f"(ssm.time_step_rank = {heads}).")
    rope = fields.get(prefix + "rope.scaling.finetuned", True)
    if not isinstance(rope, bool):
        raise ModelFormatError(f"GGUF metadata {prefix}rope.scaling.finetuned = {quoted(rope)} is not true or false.")
    scales = {ours: _gguf_scale(fields, prefix + key) for key, ours in GGUF_MULTIPLIERS.items()}
    # none: the score scale head_dim ** -0.5 (None), the other multipliers 1
    scales = {ours: value or (None if ours == "attention_scale" else 1.0) for ours, value in scales.items()}
    return dict(layer_kinds=kv_layer_kinds(fields, prefix, num_layers, LayerKind.MAMBA2), mamba_heads=heads,
                mamba_head_dim=inner // heads, mamba_groups=size("ssm.group_count"), mamba_state=size("ssm.state_size"),
                conv_kernel=size("ssm.conv_kernel", least=2),
                conv_bias=any(name.endswith(".ssm_conv1d.bias") for name in tensors),
                mamba_proj_bias=any(name.endswith(".ssm_in.bias") for name in tensors),
                **scales, nope=not rope)


def _gguf_scale(fields: Mapping[str, Any], key: str) -> float:
    """A multiplier as llama.cpp reads it: 0 where absent or 0 (none), else a finite positive float."""
    value = fields.get(key)
    return 0.0 if value is None or value == 0 else as_float(value, f"GGUF metadata {key}")


def _gguf_values(name: str, values: torch.Tensor, spec: ModelSpec) -> torch.Tensor | None:
    """``A_log`` from the converter's ``ssm_a = -exp(A_log)`` (in float64, rounded once); None for the rest."""
    return torch.log(-values.double()).float() if name.endswith(".mamba.A_log") else None


_ATTENTION = HF_ATTENTION_TYPES["full_attention"]
_MOE = "Granite's mixture-of-experts models are not supported (only the dense Granite 4.0-H models are)"
_GGUF_KEYS = ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size",
              "rope.scaling.finetuned", "expert_shared_feed_forward_length", *GGUF_MULTIPLIERS)
GRANITE_HYBRID = Family(
    "granitemoehybrid", "granitehybrid", ("GraniteMoeHybridForCausalLM",),
    hf_names={"shared_mlp.input_linear": "mlp.gate_up_proj", "shared_mlp.output_linear": "mlp.down_proj"},
    fused={"mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
    hf_layer_types={"mamba": LayerKind.MAMBA2, "linear_attention": LayerKind.MAMBA2, "attention": _ATTENTION,
                    "full_attention": _ATTENTION},
    hf_config=_hf_config, hf_fields=_hf_fields, hf_own_keys=frozenset(MULTIPLIERS),
    hf_refused={name: _MOE for name in ("GraniteMoeForCausalLM", "granitemoe", "GraniteMoeSharedForCausalLM",
                                        "granitemoeshared")},
    gguf_tensors={"ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_dt.bias": "mamba.dt_bias",
                  "ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_norm": "mamba.norm", "ssm_out": "mamba.out_proj"},
    gguf_keys=frozenset(_GGUF_KEYS), gguf_fields=_gguf_fields, gguf_values=_gguf_values,
    gguf_flat=("mamba.A_log", "mamba.D", "mamba.norm.weight"), gguf_experts_refused=_MOE,
)
