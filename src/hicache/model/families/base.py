"""What a model family is: where its decoder departs from a plain Llama layer, and how its GGUF
metadata and HF ``config.json`` name those departures. The one place both loaders map a file onto
:class:`~hicache.model.spec.ModelSpec` fields (:func:`gguf_layer_fields`, :func:`hf_layer_fields`);
each family's own module (``llama.py``, ``qwen.py``, ``gemma3.py``, ``deepseek.py``) only states
data."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from hicache.model.errors import ModelFormatError, as_float, as_int, quoted
from hicache.model.spec import LayerKind, ModelSpec

# GGUF tensor of a layer (after "blk.{i}.") -> HF parameter (after "model.layers.{i}."), as llama.cpp
# names a Llama layer. A family whose converter maps a name elsewhere says so (Family.gguf_tensors).
LLAMA_LAYER_TENSORS: Mapping[str, str] = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# config.json names of the activations the MLP computes, by ModelSpec.hidden_act
HF_ACTIVATIONS = {"silu": ("silu", "swish"), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}
# config.json layer_types of attention layers, by the kind each is
HF_ATTENTION_TYPES: Mapping[str, LayerKind] = {"full_attention": LayerKind.FULL, "sliding_attention": LayerKind.SLIDING}


@dataclass(frozen=True)
class Family:
    """A decoder family. Beyond its names (``gguf_architecture``: ``general.architecture`` of its
    GGUF files, None when they say another's; ``hf_architectures``: ``architectures`` in its
    config.json), each field says where its layer departs from Llama's:

    ``gguf_qk_interleaved``: llama.cpp's converter reorders q/k rows so rotary pairs are adjacent
    (Llama; families whose llama.cpp rope is NEOX-style keep HF's rotate-half order).
    ``attention_bias``: q/k/v biases where a config does not say. ``qk_norm``: q and k
    RMS-normalized per head before RoPE. ``hidden_act``: the MLP's gate activation.
    ``sandwich_norms``: four norms a layer (Gemma). ``scaled_embeddings``: embeddings times
    sqrt(hidden). ``hf_norm_offset``: its HF checkpoints store each RMSNorm weight as ``w`` and
    compute ``1 + w`` (the GGUF converter folds the 1 in). ``sliding_pattern``: every
    ``sliding_pattern``-th layer is full, the others sliding-window (0: none). ``local_rope_theta``:
    the sliding layers' RoPE base. ``gguf_tensors``: GGUF layer tensors its converter maps
    elsewhere than Llama's (:data:`LLAMA_LAYER_TENSORS`). ``gguf_keys``: architecture metadata keys
    beyond the common ones the loader reads for it. ``gguf_attention_scale``: the score scale from
    the GGUF file's sizes where the file does not carry it (``(fields, prefix) -> scale``).
    ``tie_embeddings``: the head is the embedding where a config.json does not say (transformers'
    default for the family: Gemma 3's published configs leave the key out).
    ``fused``: a stored projection (HF name after "model.layers.{i}.") -> the model's parts it holds
    row after row (Phi-3's qkv_proj: q, k, v), split by the loaders.

    HF names and keys where they are not Llama's (LFM2): ``hf_names``: a stored module (after
    "model.layers.{i}.", or its whole name outside the layers) -> the model's (:meth:`hf_param`);
    ``hf_layer_types``: the ``layer_types`` its config.json may name, by kind; ``hf_config``: the
    config as the common keys read it (its aliases and derived sizes resolved as transformers'
    config class does); ``hf_fields``: ModelSpec fields of its own read from the config;
    ``hf_refused``: architectures and model types of its kin that are refused, each with what it is.

    ``hf_own_keys``: config keys the loader refuses at other than a Llama's values which the
    family's ``hf_fields`` reads (Qwen3.5's ``partial_rotary_factor``, Granite's multipliers).

    Qwen3.5's departures: ``hf_plain_norms``: norm modules (after "model.layers.{i}.") stored
    as they are despite ``hf_norm_offset``; ``hf_multimodal``: architectures whose config.json nests
    the text model's under ``text_config`` (:func:`hf_text_config`); ``hf_prefixes``: a stored
    name's prefix -> the model's ("model.language_model." -> "model."); ``hf_skipped``: prefixes of
    stored tensors of parts the engine does not run (a vision tower, an MTP head), left unread.

    GGUF layouts of the recurrent families (llama.cpp's converters): ``gguf_tensors`` may name a
    layer tensor whole, suffix included or absent (Qwen3.5's ``ssm_a`` -> ``linear_attn.A_log``);
    ``gguf_top``: top-level tensors beyond Llama's (LFM2's final norm is ``token_embd_norm``);
    ``gguf_fields``: ModelSpec fields of its own from the metadata ``(fields, prefix, layers, tensor
    names)`` (layer kinds, the mixers' sizes); ``gguf_row_order``: ``(parameter, spec) -> order``
    where the converter moved rows, the model's rows being the file's at ``order`` (whole rows: a
    quantized matrix keeps its blocks); ``gguf_values``: ``(parameter, values, spec) -> values`` it
    stored otherwise (after the row order; None where it did not: a changed tensor keeps no
    blocks); ``gguf_refused``: architecture names of its kin that are refused, each with what it is;
    ``gguf_flat``: parameters (name suffixes) the converter stored as matrices though they are vectors
    (Granite's ``ssm_a`` / ``ssm_d`` as ``[heads, 1]``, ``ssm_norm`` as ``[groups, d_inner / groups]``),
    read flattened; ``gguf_experts_refused``: what a file of the architecture with ``expert_count`` > 0
    is, refused (Granite 4.0-H's MoE models share the dense ones' architecture name).
    """

    name: str
    gguf_architecture: str | None
    hf_architectures: tuple[str, ...]
    gguf_qk_interleaved: bool = True
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sandwich_norms: bool = False
    scaled_embeddings: bool = False
    hf_norm_offset: bool = False
    sliding_pattern: int = 0
    local_rope_theta: float | None = None
    gguf_tensors: Mapping[str, str] = field(default_factory=dict)
    gguf_keys: frozenset[str] = frozenset()
    gguf_attention_scale: Callable[[Mapping[str, Any], str], float] | None = None
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    tie_embeddings: bool = False
    hf_names: Mapping[str, str] = field(default_factory=dict)
    hf_layer_types: Mapping[str, LayerKind] = field(default_factory=lambda: HF_ATTENTION_TYPES)
    hf_config: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    hf_fields: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    hf_refused: Mapping[str, str] = field(default_factory=dict)
    hf_own_keys: frozenset[str] = frozenset()
    hf_plain_norms: tuple[str, ...] = ()
    hf_multimodal: tuple[str, ...] = ()
    hf_prefixes: Mapping[str, str] = field(default_factory=dict)
    hf_skipped: tuple[str, ...] = ()
    gguf_top: Mapping[str, str] = field(default_factory=dict)
    gguf_fields: Callable[[Mapping[str, Any], str, int, frozenset[str]], dict[str, Any]] | None = None
    gguf_row_order: Callable[[str, ModelSpec], torch.Tensor | None] | None = None
    gguf_values: Callable[[str, torch.Tensor, ModelSpec], torch.Tensor | None] | None = None
    gguf_refused: Mapping[str, str] = field(default_factory=dict)
    gguf_flat: tuple[str, ...] = ()
    gguf_experts_refused: str | None = None

    def parts_of(self, name: str) -> tuple[str, ...] | None:
        """The model parameters a stored fused tensor ``name`` ("model.layers.3.self_attn.qkv_proj.weight")
        holds row after row, or None when it is not fused."""
        head, _, rest = name.partition(".layers.")
        layer, _, tail = rest.partition(".")
        module, _, kind = tail.rpartition(".")
        parts = self.fused.get(module)
        return None if parts is None else tuple(f"{head}.layers.{layer}.{p}.{kind}" for p in parts)

    def hf_param(self, name: str) -> str:
        """The model parameter a checkpoint tensor ``name`` fills: its own name, but where the family
        names the module otherwise ("model.layers.3.feed_forward.w1.weight" -> "...mlp.gate_proj.weight")."""
        stored = next((p for p in self.hf_prefixes if name.startswith(p)), None)
        if stored is not None:
            name = self.hf_prefixes[stored] + name[len(stored):]
        if not self.hf_names:
            return name
        module, _, kind = name.rpartition(".")
        head, sep, rest = module.partition(".layers.")
        if not sep:
            return f"{self.hf_names.get(module, module)}.{kind}"
        layer, _, sub = rest.partition(".")
        return f"{head}.layers.{layer}.{self.hf_names.get(sub, sub)}.{kind}"

    def hf_read(self, names: Iterable[str]) -> dict[str, str]:
        """Each checkpoint tensor of ``names`` the model reads -> the parameter it fills
        (:meth:`hf_param`); those under ``hf_skipped`` left out."""
        return {name: self.hf_param(name) for name in names if not name.startswith(self.hf_skipped)}

    def offset_norm(self, param: str) -> bool:
        """Whether the checkpoint stores model parameter ``param`` as ``w`` for ``1 + w`` (the
        family's ``hf_norm_offset``, a norm weight, not one of its ``hf_plain_norms``)."""
        return (self.hf_norm_offset and param.endswith("norm.weight")
                and not param.removesuffix(".weight").endswith(self.hf_plain_norms))

    def layer_tensors(self) -> Mapping[str, str]:
        """GGUF layer tensor -> HF parameter for this family (QK-norm and extra norms only where it has them)."""
        names = {**LLAMA_LAYER_TENSORS, **self.gguf_tensors}
        if not self.qk_norm:
            names.pop("attn_q_norm"), names.pop("attn_k_norm")
        return names


def _patterned(period: int, first: int, num_layers: int) -> tuple[LayerKind, ...]:
    """Every ``period``-th layer full, the others sliding; without a period, the layers from ``first`` on sliding."""
    full = (lambda i: (i + 1) % period == 0) if period else (lambda i: i < first)
    return tuple(LayerKind.FULL if full(i) else LayerKind.SLIDING for i in range(num_layers))


def _common_fields(family: Family, hidden: int, window: int, kinds: tuple[LayerKind, ...]) -> dict[str, Any]:
    return dict(
        qk_norm=family.qk_norm, hidden_act=family.hidden_act, sandwich_norms=family.sandwich_norms,
        embedding_scale=math.sqrt(hidden) if family.scaled_embeddings else 1.0,
        sliding_window=window if kinds else 0, layer_kinds=kinds,
        local_rope_theta=family.local_rope_theta if kinds and family.local_rope_theta else None,
    )


def gguf_layer_fields(family: Family, fields: Mapping[str, Any], hidden: int, num_layers: int,
                      tensor_names: Iterable[str] = ()) -> dict[str, Any]:
    """The ModelSpec fields of a family's layer from its GGUF metadata ``fields`` (and, for a family's
    own fields, the file's ``tensor_names``: LFM2's conv biases)."""
    prefix = f"{family.gguf_architecture}."
    key = prefix + "attention.sliding_window"
    window = as_int(fields.get(key, 0) or 0, f"GGUF metadata {key}", 0)
    # Each layer full or sliding: the family's pattern, or every layer sliding where a family
    # without one has a window (Mistral).
    out = _common_fields(family, hidden, window, _patterned(family.sliding_pattern, 0, num_layers) if window else ())
    if family.gguf_attention_scale is not None:
        out["attention_scale"] = family.gguf_attention_scale(fields, prefix)
    if family.gguf_fields is not None:
        out.update(family.gguf_fields(fields, prefix, num_layers, frozenset(tensor_names)))
    return out


def kv_layer_kinds(fields: Mapping[str, Any], prefix: str, num_layers: int,
                   recurrent: LayerKind) -> tuple[LayerKind, ...]:
    """Each layer's kind from a hybrid file's per-layer ``attention.head_count_kv`` as llama.cpp reads
    it (LFM2, Granite 4.0-H): a layer with 0 KV heads is ``recurrent``, the others full attention; ()
    where no layer is recurrent. The loader checks the attention layers' counts."""
    key = prefix + "attention.head_count_kv"
    per_layer = fields.get(key)
    per_layer = per_layer if isinstance(per_layer, list) else [per_layer] * num_layers
    if len(per_layer) != num_layers:
        raise ModelFormatError(f"GGUF metadata {key} holds {len(per_layer)} values for {num_layers} layers.")
    kinds = tuple(recurrent if as_int(n, f"GGUF metadata {key}", 0) == 0 else LayerKind.FULL for n in per_layer)
    return kinds if recurrent in kinds else ()


def hf_text_config(family: Family, config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's config: a multimodal config.json's (with a ``text_config``, of a family with
    ``hf_multimodal`` architectures) ``text_config``, its head tied as the outer config says
    (transformers' default: untied); any other config as it is."""
    architectures = config.get("architectures") or []
    if not family.hf_multimodal or "text_config" not in config:
        return config
    text = config["text_config"]
    if not isinstance(text, dict):
        raise ModelFormatError(f"config.json text_config holds {quoted(text)}, not a JSON object.")
    return {**text, "architectures": architectures, "tie_word_embeddings": config.get("tie_word_embeddings", False)}


def hf_layer_fields(family: Family, config: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelSpec fields of a family's layer from its ``config.json``; a key that changes the math
    in a way the family's layer does not is refused, naming it."""
    act = config.get("hidden_act", config.get("hidden_activation")) or HF_ACTIVATIONS[family.hidden_act][0]
    hidden_act = next((ours for ours, names in HF_ACTIVATIONS.items() if act in names), None)
    if hidden_act != family.hidden_act:
        raise ModelFormatError(f"config.json hidden_act {quoted(act)} is not what this engine's {family.name} layer "
                               f"computes ({family.hidden_act}); the model is refused rather than run wrongly.")
    num_layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])  # (checked by the caller)
    kinds = _hf_layer_kinds(family, config, num_layers)
    window = config_int(config, "sliding_window", 0, least=0) if LayerKind.SLIDING in kinds else 0
    if not window:  # (sliding layers without a window attend every position)
        kinds = tuple(LayerKind.FULL if kind == LayerKind.SLIDING else kind for kind in kinds)
    out = _common_fields(family, hidden, window, () if set(kinds) <= {LayerKind.FULL} else kinds)
    if family.hf_fields is not None:
        out.update(family.hf_fields(config))
    scalar = config.get("query_pre_attn_scalar")
    if scalar is not None:
        out["attention_scale"] = as_float(scalar, "config.json query_pre_attn_scalar") ** -0.5
    if out["local_rope_theta"] is not None:
        local = (config.get("rope_parameters") or {}).get("sliding_attention") or {}
        theta = local.get("rope_theta", config.get("rope_local_base_freq", family.local_rope_theta))
        out["local_rope_theta"] = as_float(theta, "config.json rope_local_base_freq")
    return out


def _hf_layer_kinds(family: Family, config: Mapping[str, Any], num_layers: int) -> tuple[LayerKind, ...]:
    """Full or sliding, per layer: ``layer_types`` where the config has them, else the family's
    pattern (older Gemma 3 configs: ``sliding_window_pattern``), else a window over every layer
    (Mistral; Qwen2's ``use_sliding_window`` from ``max_window_layers`` on)."""
    types = config.get("layer_types")
    if types:
        known = family.hf_layer_types
        unknown = set(types) - set(known)
        if unknown or len(types) != num_layers:
            raise ModelFormatError(f"config.json layer_types {quoted(sorted(unknown) or types)} are not implemented "
                                   f"for {family.name} ({', '.join(known)} are, one per layer); the model is refused "
                                   "rather than run wrongly.")
        return tuple(known[t] for t in types)
    window = config_int(config, "sliding_window", 0, least=0)
    if not window or not config.get("use_sliding_window", True) or \
            window >= config_int(config, "max_position_embeddings", 2048):
        return ()
    pattern = config_int(config, "sliding_window_pattern", family.sliding_pattern, least=0)
    first = config_int(config, "max_window_layers", 0, least=0) if "use_sliding_window" in config and not pattern else 0
    return _patterned(pattern, first, num_layers)


def config_int(config: Mapping[str, Any], key: str, default: int | None = None, least: int = 1) -> int:
    """``config[key]`` (absent or None: ``default``; no default: KeyError) as an integer of at least
    ``least``; one sentence naming the key otherwise."""
    value = config.get(key)
    value = default if value is None else value
    if value is None:
        raise KeyError(key)
    return as_int(value, f"config.json {key}", least)
