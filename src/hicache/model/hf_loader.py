"""Load a local Hugging Face model directory (config.json + *.safetensors + tokenizer.json).

Checked before anything is allocated (issue 56; model/file_checks.py): config.json of at most
:data:`MAX_CONFIG_BYTES`, a JSON object whose sizes are positive integers and whose floats the math
uses are finite (values the engine does not read may be anything JSON holds, ``Infinity`` included,
as transformers writes a Mamba ``time_step_limit``); the safetensors headers (read by the
``safetensors`` library, which checks their offsets) hold exactly ``num_hidden_layers`` layers and
each tensor has its parameter's shape."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open

from hicache.config import ConfigError
from hicache.model.errors import ModelFormatError, ModelNotFoundError, as_float, as_int, cut, quoted
from hicache.model.families import DEEPSEEK, Family, config_int, hf_family, hf_layer_fields, hf_text_config
from hicache.model.file_checks import HF_LAYER, check_finite, check_layer_count, check_shapes, check_token_ids
from hicache.model.llama import LlamaForCausalLM
from hicache.model.spec import ModelSpec
from hicache.model.tokenizer import Tokenizer, load_hf_tokenizer

# config.json keys that change the math when set, with the values that leave a Llama unchanged.
# Fail closed: another value is refused, naming the key, rather than ignored.
_NEUTRAL_KEYS: dict[str, tuple] = {
    "mlp_bias": (False, None), "attn_logit_softcapping": (None,), "final_logit_softcapping": (None,),
    "partial_rotary_factor": (None, 1.0), "use_qk_norm": (False, None), "qk_layernorm": (False, None),
    "embedding_multiplier": (None, 1.0), "logits_scaling": (None, 1.0), "residual_multiplier": (None, 1.0),
    "attention_multiplier": (None,)}

logger = logging.getLogger(__name__)

MAX_CONFIG_BYTES = 16 << 20  # config.json (a real one: a few KB)
MAX_TOKENIZER_BYTES = 1 << 30  # each tokenizer file (Gemma 3's tokenizer.json: 33 MB)


def spec_from_hf_config(config: dict, tensor_names: Iterable[str] | None = None) -> ModelSpec:
    """A :class:`ModelSpec` from an HF ``config.json`` dict (a family of model/families/).

    RoPE: ``rope_theta`` + ``rope_scaling`` (transformers 4) or ``rope_parameters`` (transformers 5,
    per layer kind where the layers differ: the full layers' here, the sliding ones' in
    ``hf_layer_fields``). Fail closed: a key that changes the math and is not implemented --
    an activation the family's layer does not compute, MLP biases, soft-capping... -- is refused,
    naming it. ``tensor_names``: the checkpoint's, against which ``num_hidden_layers`` is checked
    first (a spec makes a tuple per layer). Every refusal is one sentence (ModelFormatError).
    """
    if not isinstance(config, dict):
        raise ModelFormatError(f"config.json holds {type(config).__name__}, not a JSON object.")
    try:
        return _spec(config, tensor_names)
    except KeyError as e:
        raise ModelFormatError(f"config.json lacks the field {quoted(e.args[0])}.") from None
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError, OverflowError, ZeroDivisionError) as e:  # a value of another type
        raise ModelFormatError(f"config.json holds a value this engine cannot read ({quoted(str(e))}).") from None


def _spec(config: dict, tensor_names: Iterable[str] | None) -> ModelSpec:
    archs = config.get("architectures") or []
    model_type = config.get("model_type", "llama")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs) or not isinstance(model_type, str):
        raise ModelFormatError(f"config.json architectures = {quoted(archs)} and model_type = {quoted(model_type)} "
                               "must be a list of names and a name.")
    family = hf_family(archs, model_type)
    text = hf_text_config(family, config)  # a multimodal checkpoint's text model (Qwen3.5's)
    if text is not config:  # its own model type refused as the outer one would be (a MoE's text model)
        hf_family(archs, str(text.get("model_type", model_type)))
    config = dict(text)
    _check_config(config, family)
    if tensor_names is not None:  # (as the model names them: a multimodal checkpoint's prefixes are not)
        check_layer_count(config["num_hidden_layers"], family.hf_read(tensor_names).values(), HF_LAYER,
                          "config.json num_hidden_layers", "the checkpoint")
    if family.hf_config is not None:  # its own keys as the common ones (LFM2's norm_eps, block_ff_dim...): after
        config = family.hf_config(config)  # the layer count is checked, since they may be per layer
    hidden = config_int(config, "hidden_size")
    heads = config_int(config, "num_attention_heads")
    rope = dict(config.get("rope_parameters") or {})
    rope = dict(rope.get("full_attention", rope))  # per layer kind (Gemma 3): the full layers' here
    _check_config({"partial_rotary_factor": rope.pop("partial_rotary_factor", None)}, family)  # (transformers 5's place)
    scaling = config.get("rope_scaling") or None
    theta = config["rope_theta"] if config.get("rope_theta") is not None else rope.get("rope_theta", 10000.0)
    if scaling is None and rope:
        rope.pop("rope_theta", None)
        scaling = rope if rope.get("rope_type", "default") != "default" else None
    return ModelSpec(
        num_layers=config_int(config, "num_hidden_layers"), hidden_size=hidden, num_heads=heads,
        num_kv_heads=as_int(config.get("num_key_value_heads") or heads, "config.json num_key_value_heads"),
        head_dim=as_int(config.get("head_dim") or hidden // heads, "config.json head_dim"),
        intermediate_size=config_int(config, "intermediate_size"), vocab_size=config_int(config, "vocab_size"),
        rope_theta=as_float(theta, "config.json rope_theta"),
        rms_norm_eps=as_float(config.get("rms_norm_eps", 1e-6), "config.json rms_norm_eps"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", family.tie_embeddings)),
        max_position_embeddings=config_int(config, "max_position_embeddings", 2048),
        attention_bias=bool(config.get("attention_bias", family.attention_bias)), rope_scaling=scaling,
        **hf_layer_fields(family, config), **(_mla_fields(config) if family is DEEPSEEK else {}),
    )


def _check_config(config: dict, family: Family) -> None:
    """Refuse, naming the key, what a model here would otherwise compute wrongly (the layer's own
    keys -- activation, windows, a family's partial rotary or multipliers -- are the family mapping's:
    ``hf_layer_fields``)."""
    for key, neutral in _NEUTRAL_KEYS.items():
        if key in config and key not in family.hf_own_keys and config[key] not in neutral:
            raise ModelFormatError(f"config.json {key} = {quoted(config[key])} changes the math in a way this engine does "
                                   "not implement; the model is refused rather than run wrongly.")


def _mla_fields(config: dict) -> dict:
    """DeepSeek-V2/V3 attention sizes; only all-dense models (every layer before
    ``first_k_dense_replace``, or no routed experts) are supported."""
    layers = config_int(config, "num_hidden_layers")
    if config.get("n_routed_experts") and config_int(config, "first_k_dense_replace", 0, 0) < layers:
        raise ModelFormatError(
            f"{config.get('architectures', ['this model'])[0]} with mixture-of-experts layers is not supported; "
            "only dense layers (first_k_dense_replace >= num_hidden_layers) are.")
    return dict(
        kv_lora_rank=config_int(config, "kv_lora_rank"), q_lora_rank=config_int(config, "q_lora_rank", 0, 0),
        qk_nope_head_dim=config_int(config, "qk_nope_head_dim"),
        qk_rope_head_dim=config_int(config, "qk_rope_head_dim"), v_head_dim=config_int(config, "v_head_dim"),
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
    """``weights=False``: only the shape and the tokenizer (the model is None). Every file is checked
    before the model is allocated (the module's docstring)."""
    weight_files = _check_folder(folder)
    config = _read_config(folder / "config.json")
    headers = _read_headers(weight_files)
    spec = spec_from_hf_config(config, headers)
    family = hf_family(config.get("architectures") or [], config.get("model_type", "llama"))
    # Tied checkpoints may still store lm_head; rotary caches are recomputed. Each stored tensor fills
    # the parameter of the model's name for it (the family's, where they differ: LFM2's feed_forward.w1...).
    stored = {name: ours for name, ours in family.hf_read(headers).items()
              if not (ours == "lm_head.weight" and spec.tie_word_embeddings or name.endswith("rotary_emb.inv_freq"))}
    _log_skipped(folder, family, headers)
    check_shapes([(name, ours, headers[name][1]) for name, ours in stored.items()], spec, "checkpoint",
                 f"the checkpoint in {folder.name}", family.parts_of)
    tokenizer = _tokenizer(folder, config)
    check_token_ids(tokenizer, spec, f"the model directory {folder.name}")
    if not weights:
        return None, tokenizer, spec
    model = LlamaForCausalLM(spec, dtype, device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for file in weight_files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name not in stored:
                        continue
                    ours = stored[name]
                    parts = family.parts_of(ours) or (ours,)  # a fused tensor (Phi-3's qkv_proj) fills its parts
                    values = f.get_tensor(name)
                    check_finite(values, f"checkpoint tensor {cut(name)}")
                    if family.offset_norm(ours):
                        # Gemma (Qwen3.5) stores w and computes 1 + w: add the 1 in float32, then round once to the
                        # model's dtype (as llama.cpp's converter folds it), so every norm is x / rms(x) * weight
                        values = values.float() + 1.0
                    for part, piece in zip(parts, values.split([params[p].shape[0] for p in parts])):
                        params[part].copy_(piece)
    return model, tokenizer, spec


def _log_skipped(folder: Path, family: Family, headers: dict) -> None:
    """One line naming the parts of a checkpoint that are not loaded (Qwen3.5's vision tower and MTP head)."""
    skipped = [name for name in headers if name.startswith(family.hf_skipped)]
    if skipped:
        parts = sorted({p for p in family.hf_skipped for name in skipped if name.startswith(p)})
        logger.info("%s: %d checkpoint tensors of parts this engine does not run (%s) are not loaded; it takes "
                    "text only", folder.name, len(skipped), ", ".join(f"{p}*" for p in parts))


# transformers 5 writes the floats JSON lacks as tagged objects ({"__float__": "Infinity"}); older versions
# wrote the bare words, which Python's json reads too
_TAGGED_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _special_float(obj: dict) -> object:
    """A tagged float as its value; any other JSON object as it is."""
    tag = obj.get("__float__") if len(obj) == 1 else None
    return _TAGGED_FLOATS[tag] if isinstance(tag, str) and tag in _TAGGED_FLOATS else obj


def _read_config(path: Path) -> dict:
    """config.json: at most :data:`MAX_CONFIG_BYTES`, JSON (``Infinity`` and ``NaN`` as transformers
    writes them: bare or tagged)."""
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ModelFormatError(f"{path} is {path.stat().st_size} bytes, more than a config.json may be "
                               f"({MAX_CONFIG_BYTES}).")
    try:  # (an object: spec_from_hf_config checks)
        return json.loads(path.read_text(encoding="utf-8"), object_hook=_special_float)
    except (ValueError, RecursionError) as e:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        raise ModelFormatError(f"{path} is not JSON ({quoted(str(e))}).") from None


def _read_headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor of the checkpoint by name: its file and shape, from the safetensors headers only
    (the library checks each header's size and offsets against its file)."""
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in found:
                        raise ModelFormatError(f"checkpoint tensor {cut(name)} is in both {found[name][0].name} and "
                                               f"{file.name}.")
                    found[name] = (file, tuple(f.get_slice(name).get_shape()))
        except (SafetensorError, OSError) as e:
            raise ModelFormatError(f"cannot read checkpoint {file.name}: {quoted(str(e))}.") from None
    return found


def _tokenizer(folder: Path, config: dict) -> Tokenizer:
    """The directory's tokenizer; its files within :data:`MAX_TOKENIZER_BYTES`, and a refusal of the
    ``tokenizers`` library (a plain Exception) or an ill-typed tokenizer config one sentence."""
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        path = folder / name
        if path.is_file() and path.stat().st_size > MAX_TOKENIZER_BYTES:
            raise ModelFormatError(f"{path} is {path.stat().st_size} bytes, more than {MAX_TOKENIZER_BYTES}.")
    try:
        return load_hf_tokenizer(folder, config)
    except ConfigError:
        raise
    except Exception as e:
        raise ModelFormatError(f"the tokenizer in {folder} cannot be loaded: {quoted(str(e))}.") from None
