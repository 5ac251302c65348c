"""Tiny deterministic random models (``random:<preset>`` / ``random:{json}``) for tests and demos."""

from __future__ import annotations

import dataclasses
import json

import torch

from hicache.model.errors import ModelNotFoundError
from hicache.model.llama import LlamaForCausalLM
from hicache.model.spec import LayerKind, ModelSpec, ModelSpecError
from hicache.model.tokenizer import RANDOM_SPECIAL_TOKENS

# Tokenizer ids: 256 bytes + the specials; the vocab may be larger (unused rows), never smaller.
MIN_RANDOM_VOCAB = 256 + len(RANDOM_SPECIAL_TOKENS)

_COMMON = dict(vocab_size=320, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
               max_position_embeddings=4096)
PRESETS: dict[str, dict] = {
    "tiny": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, **_COMMON),
    # DeepSeek-V3-style MLA (dense layers): one 48-wide latent per token and layer, 4 heads.
    "mla-tiny": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1, head_dim=24, intermediate_size=128,
                     kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=20,
                     rope_interleave=True, **_COMMON),
    "small": dict(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256, **_COMMON),
    # Gemma 3's layer: four norms, GeGLU, QK-norm, scaled embeddings, its own attention scale, one KV head,
    # 5 layers attending an 8-token window (their own RoPE base) to 1 full layer, a tied head.
    "gemma-small": dict(num_layers=6, hidden_size=128, num_heads=4, num_kv_heads=1, head_dim=32, intermediate_size=256,
                        qk_norm=True, sandwich_norms=True, hidden_act="gelu_tanh", embedding_scale=128 ** 0.5,
                        attention_scale=24 ** -0.5, sliding_window=8, local_rope_theta=10000.0,
                        layer_kinds=(LayerKind.SLIDING,) * 5 + (LayerKind.FULL,), **{**_COMMON, "tie_word_embeddings": True}),
    # LFM2's layers: two short convolutions (3 taps, a state of 2 inputs per channel) then an attention
    # layer with QK-norm; the KV pool holds one layer, the state pool two.
    "lfm2-tiny": dict(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                      qk_norm=True, conv_kernel=3, layer_kinds=(LayerKind.CONV, LayerKind.CONV, LayerKind.FULL),
                      **_COMMON),
    # Qwen3.5's layers: two gated DeltaNet layers (2 key heads, 4 value heads reading them in pairs, a conv of
    # 4 taps) then a gated attention layer with QK-norm and partial rotary (4 of 16 dims, Qwen3.5's 0.25).
    "gdn-tiny": dict(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                     qk_norm=True, conv_kernel=4, layer_kinds=(LayerKind.GDN, LayerKind.GDN, LayerKind.FULL),
                     gdn_key_heads=2, gdn_value_heads=4, gdn_key_dim=16, gdn_value_dim=16, attn_output_gate=True,
                     rotary_dim=4, **_COMMON),
    # Granite 4.0-H's layers: two Mamba2 layers (4 heads of 32 channels, d_inner 128 = 2 x hidden as Granite's
    # mamba_expand 2; 2 groups of B and C with a state of 16; a conv of 4 taps with a bias) then a NoPE attention
    # layer scaled by 1 / head_dim; Granite's multipliers on the embeddings, the residual adds and the logits.
    "mamba2-tiny": dict(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                        conv_kernel=4, conv_bias=True, layer_kinds=(LayerKind.MAMBA2, LayerKind.MAMBA2, LayerKind.FULL),
                        mamba_heads=4, mamba_head_dim=32, mamba_groups=2, mamba_state=16, nope=True,
                        embedding_scale=12.0, attention_scale=1 / 16, residual_scale=0.22, logits_scale=2.0, **_COMMON),
}

# Weight scale: small enough that activations stay tame, large enough that logits differ per token.
INIT_STD = 0.02
CONV_TAP_STD = 0.5  # a tap scales one channel's input, as transformers' Conv1d init (bound 1/sqrt(taps)) does
CONV_TAPS = ("conv.conv.weight", "linear_attn.conv1d.weight", "mamba.conv1d.weight")  # the depthwise convs' taps


def parse_random_spec(arg: str) -> ModelSpec:
    """``arg`` is what follows ``random:``: a preset name, or a JSON object of ModelSpec fields
    (optionally with ``"preset"``, default ``tiny``) overriding that preset.

    When the JSON changes ``hidden_size`` or ``num_heads`` but not ``head_dim``, head_dim follows
    ``hidden_size // num_heads``.
    """
    arg = arg.strip()
    try:
        overrides = json.loads(arg) if arg.startswith("{") else {"preset": arg}
    except json.JSONDecodeError as e:
        raise ModelSpecError(f"random model spec is not valid JSON ({e.msg} at character {e.pos}).") from None
    if not isinstance(overrides, dict):
        raise ModelSpecError("random model spec JSON must be an object of ModelSpec fields.")
    preset = overrides.pop("preset", "tiny")
    if preset not in PRESETS:
        raise ModelNotFoundError(f"unknown random model preset {preset!r}: expected one of {', '.join(PRESETS)} or a "
                                 "JSON object of fields.")
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ModelSpecError(f"unknown random model spec field(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}.")
    values = {**PRESETS[preset], **overrides}
    if ("hidden_size" in overrides or "num_heads" in overrides) and "head_dim" not in overrides:
        values["head_dim"] = values["hidden_size"] // values["num_heads"]
    spec = ModelSpec(**values)
    if spec.vocab_size < MIN_RANDOM_VOCAB:
        raise ModelSpecError(f"random model vocab_size must be at least {MIN_RANDOM_VOCAB} (the byte tokenizer's size).")
    return spec


@torch.no_grad()
def init_random_weights(model: LlamaForCausalLM, seed: int) -> LlamaForCausalLM:
    """Fill every parameter deterministically from ``seed``, independent of dtype: values are
    drawn in float32, in parameter order, then copied in. They are drawn on the model's device
    (the CPU's generator draws ~2e8 values a second: an 8B model would take 40 s), so a GPU's
    random weights are not the CPU's (the loader's identity names the device type they were drawn on).

    Matrices and biases ~ N(0, INIT_STD); norm weights ~ 1 + N(0, 0.1) (not all-ones, so a loader
    that drops them would be caught by parity tests); a short convolution's taps (per channel
    scalars, as norm weights are) ~ N(0, CONV_TAP_STD); a gated DeltaNet's or a Mamba2 layer's ``A_log``
    and ``dt_bias`` ~ N(0, INIT_STD) (a decay of about exp(-0.7) a token). Returns ``model``.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        values = torch.randn(param.shape, generator=gen, dtype=torch.float32, device=device)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * values)
        else:
            param.copy_((CONV_TAP_STD if name.endswith(CONV_TAPS) else INIT_STD) * values)
    return model
