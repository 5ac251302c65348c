"""Load a local Hugging Face model directory (config.json + *.safetensors + tokenizer.json)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from hicache.model.errors import ModelFormatError, ModelNotFoundError
from hicache.model.families import DEEPSEEK, hf_family, hf_layer_fields
from hicache.model.llama import LlamaForCausalLM
from hicache.model.spec import ModelSpec
from hicache.model.tokenizer import Tokenizer, load_hf_tokenizer

# config.json keys that change the math when set, with the values that leave a Llama unchanged.
# Fail closed: another value is refused, naming the key, rather than ignored.
_NEUTRAL_KEYS: dict[str, tuple] = {
    "mlp_bias": (False, None), "attn_logit_softcapping": (None,), "final_logit_softcapping": (None,),
    "partial_rotary_factor": (None, 1.0), "use_qk_norm": (False, None),
    "qk_layernorm": (False, None), "embedding_multiplier": (None, 1.0), "logits_scaling": (None, 1.0),
    "residual_multiplier": (None, 1.0), "attention_multiplier": (None,),
}


def spec_from_hf_config(config: dict) -> ModelSpec:
    """A :class:`ModelSpec` from an HF ``config.json`` dict (a family of model/families/).

    RoPE: ``rope_theta`` + ``rope_scaling`` (transformers 4) or ``rope_parameters`` (transformers 5,
    per layer kind where the layers differ: the full layers' here, the sliding ones' in
    ``hf_layer_fields``). Fail closed: a key that changes the math and is not implemented --
    an activation the family's layer does not compute, MLP biases, soft-capping... -- is refused,
    naming it.
    """
    archs = config.get("architectures") or []
    family = hf_family(archs, config.get("model_type", "llama"))
    _check_config(config)
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        rope = dict(config.get("rope_parameters") or {})
        rope = dict(rope.get("full_attention", rope))  # per layer kind (Gemma 3): the full layers' here
        partial = rope.pop("partial_rotary_factor", 1.0)  # transformers 5 keeps it here
        if partial not in (None, 1.0):
            raise ModelFormatError(f"config.json partial_rotary_factor = {partial!r} changes the math in a way this "
                                   "engine does not implement; the model is refused rather than run wrongly.")
        scaling = config.get("rope_scaling") or None
        theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
        if scaling is None and rope:
            rope.pop("rope_theta", None)
            scaling = rope if rope.get("rope_type", "default") != "default" else None
        return ModelSpec(
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            rope_theta=float(theta),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", family.tie_embeddings)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            attention_bias=bool(config.get("attention_bias", family.attention_bias)),
            rope_scaling=scaling,
            **hf_layer_fields(family, config),
            **(_mla_fields(config) if family is DEEPSEEK else {}),
        )
    except KeyError as e:
        raise ModelFormatError(f"config.json lacks the field {e.args[0]!r}.") from None


def _check_config(config: dict) -> None:
    """Refuse, naming the key, what a model here would otherwise compute wrongly (the layer's own
    keys -- activation, windows -- are the family mapping's: ``hf_layer_fields``)."""
    for key, neutral in _NEUTRAL_KEYS.items():
        if key in config and config[key] not in neutral:
            raise ModelFormatError(f"config.json {key} = {config[key]!r} changes the math in a way this engine does "
                                   "not implement; the model is refused rather than run wrongly.")


def _mla_fields(config: dict) -> dict:
    """DeepSeek-V2/V3 attention sizes; only all-dense models (every layer before
    ``first_k_dense_replace``, or no routed experts) are supported."""
    layers = int(config["num_hidden_layers"])
    if config.get("n_routed_experts") and int(config.get("first_k_dense_replace", 0)) < layers:
        raise ModelFormatError(
            f"{config.get('architectures', ['this model'])[0]} with mixture-of-experts layers is not supported; "
            "only dense layers (first_k_dense_replace >= num_hidden_layers) are.")
    return dict(
        kv_lora_rank=int(config["kv_lora_rank"]), q_lora_rank=int(config.get("q_lora_rank") or 0),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]), qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        # V3 says so in its config; V2 rotates adjacent pairs too (as complex numbers).
        rope_interleave=bool(config.get("rope_interleave", True)),
    )


def _check_folder(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise ModelNotFoundError(f"model directory {folder} does not exist.")
    for needed in ("config.json", "tokenizer.json"):
        if not (folder / needed).is_file():
            raise ModelNotFoundError(f"model directory {folder} has no {needed}.")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ModelNotFoundError(f"model directory {folder} has no *.safetensors weights.")
    return weights


def load_hf_dir(folder: Path, dtype: torch.dtype, device: torch.device | str,
                weights: bool = True) -> tuple[LlamaForCausalLM | None, Tokenizer, ModelSpec]:
    """``weights=False``: only the shape and the tokenizer (the model is None)."""
    weight_files = _check_folder(folder)
    with open(folder / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    spec = spec_from_hf_config(config)
    family = hf_family(config.get("architectures") or [], config.get("model_type", "llama"))
    tokenizer = load_hf_tokenizer(folder, config)
    if not weights:
        return None, tokenizer, spec
    model = LlamaForCausalLM(spec, dtype, device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for file in weight_files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    parts = family.parts_of(name) or (name,)  # a fused tensor (Phi-3's qkv_proj) fills its parts
                    if any(p not in params for p in parts):
                        # Tied checkpoints may still store lm_head; rotary caches are recomputed.
                        if name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"):
                            continue
                        raise ModelFormatError(f"checkpoint tensor {name} in {file.name} has no place in the model.")
                    values = f.get_tensor(name)
                    want = (sum(params[p].shape[0] for p in parts), *params[parts[0]].shape[1:])
                    if tuple(values.shape) != want:
                        raise ModelFormatError(f"checkpoint tensor {name} has shape {tuple(values.shape)}, expected {want}.")
                    if family.hf_norm_offset and name.endswith("norm.weight"):
                        # Gemma stores w and computes 1 + w: add the 1 in float32, then round once to the
                        # model's dtype (as llama.cpp's converter folds it), so every norm is x / rms(x) * weight
                        values = values.float() + 1.0
                    for part, piece in zip(parts, values.split([params[p].shape[0] for p in parts])):
                        params[part].copy_(piece)
                        loaded.add(part)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelFormatError(f"checkpoint in {folder} lacks {', '.join(missing[:3])}{'...' if len(missing) > 3 else ''}.")
    return model, tokenizer, spec
