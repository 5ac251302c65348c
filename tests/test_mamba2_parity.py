"""Granite 4.0-H at the model level (issue 59 step f): an HF directory written by transformers'
GraniteMoeHybridForCausalLM with dense MLPs (num_local_experts 0: the shared MLP alone) loads through
our HF loader to its float32 logits -- Mamba2 layers, NoPE or RoPE attention scaled by
attention_multiplier, the embedding / residual multipliers and the logits divided by logits_scaling
-- at tiny shapes (B and C in two groups, NoPE; one group, RoPE, projection biases, a finite
time_step_limit) and Granite 4.0-H-micro's layer shapes (3 of its 40 layers); a prompt split mid scan
chunk, then decode steps, gives the one-pass logits; greedy tokens equal transformers' generate; MoE
configs and options the layers do not implement are refused in one sentence."""

from __future__ import annotations

import json

import pytest
import torch
from recurrent_checks import (assert_refused, assert_states_close, check_batch_keeps_states,
                              check_bfloat16_recurrence, check_greedy_equals_generate, check_logits_match,
                              check_split_then_decode, load_pair, randomized, save_hf_dir)

from hicache.errors import ConfigError
from hicache.model import DenseKV, load_model
from hicache.model.hf_loader import spec_from_hf_config
from hicache.model.llama import parameter_shapes
from hicache.model.parallel import check_parallel
from hicache.model.random_model import parse_random_spec

pytestmark = pytest.mark.model

transformers = pytest.importorskip("transformers")

MAMBA, ATTENTION = "mamba", "attention"
GRANITE = dict(embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=8.0)
CONFIGS = {  # besides the common keys of granite_config
    "tiny": dict(vocab_size=320, hidden_size=64, shared_intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, layer_types=[MAMBA, MAMBA, ATTENTION], mamba_n_heads=4, mamba_n_groups=2,
                 mamba_d_state=16, position_embedding_type="nope", tie_word_embeddings=False, embedding_multiplier=2.0,
                 attention_multiplier=0.3, residual_multiplier=0.5, logits_scaling=4.0),
    # one group, an explicit head width, biases on in_proj / out_proj but none on the conv's taps, RoPE, a finite
    # clamp of the time step (softplus(dt + dt_bias) is often past 0.5 at these weights), a tied head
    "tiny-rope": dict(vocab_size=320, hidden_size=64, shared_intermediate_size=128, num_attention_heads=2,
                      num_key_value_heads=1, layer_types=[ATTENTION, MAMBA, MAMBA], mamba_n_heads=8, mamba_d_head=16,
                      mamba_n_groups=1, mamba_d_state=8, mamba_proj_bias=True, mamba_conv_bias=False,
                      position_embedding_type="rope", rope_parameters={"rope_type": "default", "rope_theta": 5e4},
                      time_step_limit=(0.0, 0.5), tie_word_embeddings=True, embedding_multiplier=3.0,
                      attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=3.0),
    # Granite 4.0-H-micro's layer shapes (hidden 2048; 32 heads, 8 KV heads of 64; 64 Mamba2 heads of 64, one group,
    # state 128; shared MLP 8192; its multipliers; NoPE; a tied head): 3 of its 40 layers, a small vocab
    "granite-4.0-h-micro-shapes": dict(vocab_size=512, hidden_size=2048, shared_intermediate_size=8192,
                                       num_attention_heads=32, num_key_value_heads=8,
                                       layer_types=[MAMBA, MAMBA, ATTENTION], mamba_n_heads=64, mamba_d_head=64,
                                       mamba_n_groups=1, mamba_d_state=128, position_embedding_type="nope",
                                       tie_word_embeddings=True, **GRANITE),
}


def granite_config(**keys) -> "transformers.GraniteMoeHybridConfig":
    common = dict(num_hidden_layers=len(keys["layer_types"]), mamba_d_conv=4, mamba_expand=2, num_local_experts=0,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=256, eos_token_id=257, pad_token_id=0)
    return transformers.GraniteMoeHybridConfig(**{**common, **keys})


def write_hf_dir(folder, config: str) -> torch.nn.Module:
    """transformers' model of ``CONFIGS[config]`` with random weights, saved in ``folder`` as safetensors with
    a byte tokenizer; returns the model. Every parameter drawn (recurrent_checks.randomized): norms (the gated
    one too) 1 + N(0, 0.1); the rest -- conv taps and biases, A_log, dt_bias, D -- N(0, 0.5)."""
    hf = transformers.GraniteMoeHybridForCausalLM(granite_config(**CONFIGS[config]))
    return save_hf_dir(randomized(hf, 5, norm_mean=lambda name: 1.0, rest=lambda name: 0.5), folder)


@pytest.fixture(scope="module", params=["tiny", "tiny-rope",
                                        pytest.param("granite-4.0-h-micro-shapes", marks=pytest.mark.slow)])
def pair(request, tmp_path_factory):
    """transformers' model and ours loaded from the directory it saved."""
    return load_pair(write_hf_dir, request.param, tmp_path_factory.mktemp(request.param))


def test_logits_match_transformers(pair) -> None:
    spec, config = pair.ours.spec, CONFIGS[pair.name]
    assert [{"mamba2": MAMBA, "full": ATTENTION}[k] for k in spec.layer_kinds] == config["layer_types"]
    assert (spec.embedding_scale, spec.attention_scale, spec.residual_scale, spec.logits_scale) == tuple(
        config[k] for k in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"))
    assert spec.nope == (config["position_embedding_type"] == "nope") and spec.scan_chunk == 64
    assert spec.intermediate_size == config["shared_intermediate_size"] and spec.conv_kernel == 4
    assert spec.dt_max == (None if "time_step_limit" not in config else config["time_step_limit"][1])
    check_logits_match(pair)


def test_split_prefill_then_decode_equals_one_pass(pair) -> None:
    """Prompt chunks of 100, 1, 37 and 162 tokens (each split inside a 64-token scan chunk, so the scan
    resumes mid chunk), then 24 decode steps (the batched one-token step): every row's logits as the
    one-pass prompt's, and the states after the chunks those of one 300-token pass."""
    split, whole = check_split_then_decode(pair.ours.model, (100, 1, 37, 162), steps=24)
    assert_states_close(split, whole, [(1e-6, 0.0), (1e-5, 1e-5)])  # the conv's last inputs, the SSM state


def test_sequences_of_one_batch_keep_their_own_state() -> None:
    """Three prompts in one pass, their next chunks (3, 1 and 70 tokens, each from its own state) in a
    second, then one decode step of all three: each sequence's logits as it gets alone."""
    model = load_model("random:mamba2-tiny", dtype=torch.float32).model
    check_batch_keeps_states(model, (31, 18, 100), ((20, 23), (1, 2), (9, 79)))


def hf_tensor(params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """transformers' tensor ``name`` from our parameters: the shared MLP's input_linear is gate then up."""
    if "shared_mlp.input_linear" in name:
        return torch.cat([params[name.replace("shared_mlp.input_linear", f"mlp.{p}_proj")] for p in ("gate", "up")])
    return params[name.replace("shared_mlp.output_linear", "mlp.down_proj")]


def test_greedy_paged_equals_transformers_generate() -> None:
    """mamba2-tiny's random weights in transformers' model (the MLP's gate and up rows joined into the shared
    MLP's input_linear): 16 greedy tokens through the prefill's scan and the decode steps equal generate's."""
    ours = load_model("random:mamba2-tiny", dtype=torch.float32)
    spec = ours.spec
    config = granite_config(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                            shared_intermediate_size=spec.intermediate_size, num_attention_heads=spec.num_heads,
                            num_key_value_heads=spec.num_kv_heads, layer_types=[MAMBA, MAMBA, ATTENTION],
                            mamba_n_heads=spec.mamba_heads, mamba_n_groups=spec.mamba_groups,
                            mamba_d_state=spec.mamba_state, mamba_conv_bias=spec.conv_bias,
                            position_embedding_type="nope", rms_norm_eps=spec.rms_norm_eps, tie_word_embeddings=False,
                            embedding_multiplier=spec.embedding_scale, attention_multiplier=spec.attention_scale,
                            residual_multiplier=spec.residual_scale, logits_scaling=spec.logits_scale)
    check_greedy_equals_generate(transformers.GraniteMoeHybridForCausalLM, config, ours, hf_tensor,
                                 "Selective state spaces keep a matrix a head; " * 3)


def published_config(**changes) -> dict:
    """Granite 4.0-H-micro's config.json as third-party mirrors give it (attention at layers 5, 15, 25, 35)."""
    types = [ATTENTION if i in (5, 15, 25, 35) else MAMBA for i in range(40)]
    config = {"architectures": ["GraniteMoeHybridForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "attention_multiplier": 0.015625, "bos_token_id": 100257, "embedding_multiplier": 12,
              "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 2048, "init_method": "mup",
              "initializer_range": 0.1, "intermediate_size": 8192, "layer_types": types, "logits_scaling": 8,
              "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_head": 64,
              "mamba_d_state": 128, "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 64,
              "mamba_proj_bias": False, "max_position_embeddings": 131072, "model_type": "granitemoehybrid",
              "normalization_function": "rmsnorm", "num_attention_heads": 32, "num_experts_per_tok": 0,
              "num_hidden_layers": 40, "num_key_value_heads": 8, "num_local_experts": 0, "output_router_logits": False,
              "pad_token_id": 100256, "position_embedding_type": "nope", "residual_multiplier": 0.22,
              "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000, "router_aux_loss_coef": 0.01,
              "shared_intermediate_size": 8192, "tie_word_embeddings": True, "time_step_limit": [0.0, float("inf")],
              "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 100352}
    return {**config, **changes}


def test_published_config_reads_as_transformers_reads_it() -> None:
    """Granite 4.0-H-micro: 36 Mamba2 and 4 NoPE attention layers; a state of 52,224 + 2,097,152 bytes a Mamba2
    layer in float32 (73.8 MiB a snapshot: 4,723 tokens of its 16 KiB of KV a token); the infinite
    time_step_limit stored as no bound; transformers' defaults where keys are absent (layer_types: every layer
    Mamba2; multipliers 1; the MLP 1024 wide)."""
    raw = published_config()
    spec = spec_from_hf_config(raw)
    theirs = transformers.GraniteMoeHybridConfig(**raw)
    assert [{"mamba2": "linear_attention", "full": "full_attention"}[k] for k in spec.layer_kinds] == theirs.layer_types
    assert spec.attention_layers == (5, 15, 25, 35) and spec.tie_word_embeddings and spec.nope
    assert (spec.mamba_heads, spec.mamba_head_dim, spec.mamba_groups, spec.mamba_state) == (64, 64, 1, 128)
    assert (spec.dt_min, spec.dt_max, spec.intermediate_size, spec.head_dim) == (0.0, None, 8192, 64)
    assert spec.state_shapes(0) == ((4352, 3), (64, 64, 128))
    assert sum(torch.Size(s).numel() * 4 for s in spec.state_shapes(0)) == 52_224 + 2_097_152
    assert spec.kv_bytes_per_token(torch.float32) == 16 * 1024
    bare = {k: v for k, v in raw.items() if k not in ("layer_types", "attention_multiplier", "embedding_multiplier",
                                                      "residual_multiplier", "logits_scaling", "time_step_limit",
                                                      "shared_intermediate_size", "mamba_d_head")}
    defaults = spec_from_hf_config(bare)
    assert set(defaults.layer_kinds) == {"mamba2"} and defaults.intermediate_size == 1024 and defaults.dt_max is None
    assert (defaults.attention_scale, defaults.embedding_scale, defaults.residual_scale, defaults.logits_scale) == \
        (1.0, 1.0, 1.0, 1.0) and defaults.mamba_head_dim == 64
    assert spec_from_hf_config(published_config(position_embedding_type="rope")).nope is False


def test_a_tagged_infinity_reads_as_the_bare_word(tmp_path) -> None:
    """transformers 5 writes time_step_limit's infinity as {"__float__": "Infinity"}, older versions as the bare
    word: the loader reads both as no upper bound."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    write_hf_dir(folder, "tiny")
    tagged = json.loads((folder / "config.json").read_text())
    assert tagged["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    assert load_model(str(folder), weights=False).spec.dt_max is None
    (folder / "config.json").write_text(json.dumps({**tagged, "time_step_limit": [0.0, float("inf")]}))
    assert '"time_step_limit": [0.0, Infinity]' in (folder / "config.json").read_text()
    assert load_model(str(folder), weights=False).spec.dt_max is None


@pytest.mark.parametrize("changes, says", [
    ({"num_local_experts": 8}, r"Granite's mixture-of-experts models \(num_local_experts = 8\) are not supported"),
    ({"num_local_experts": None}, r"Granite's mixture-of-experts models \(num_local_experts = None\)"),
    ({"num_local_experts": "absent"}, r"Granite's mixture-of-experts models \(num_local_experts = 8\)"),
    ({"mlp_layer_types": ["dense", "sparse", "dense"]}, "mlp_layer_types naming sparse layers"),
    ({"architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe"},
     "Granite's mixture-of-experts models are not supported"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type = 'alibi' is not implemented"),
    ({"attention_bias": True}, "attention_bias = true puts a bias on Granite's o_proj too"),
    ({"mamba_d_head": 24}, r"mamba_d_head x mamba_n_heads \(24 x 4\) is not mamba_expand x hidden_size \(128\)"),
    ({"mamba_n_groups": 3}, "the heads a multiple of the groups"),
    ({"time_step_limit": [0.5, 0.1]}, r"time_step_limit = \[0.5, 0.1\] is not two numbers"),
    ({"logits_scaling": 0}, "logits_scaling = 0 is not a finite positive number"),
    ({"residual_multiplier": None}, "residual_multiplier = None is not a finite positive number"),
    ({"layer_types": [MAMBA, "conv", ATTENTION]}, r"layer_types \['conv'\] are not implemented for granitemoehybrid"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not what this engine's granitemoehybrid layer computes"),
    ({"mamba_d_conv": 1}, "mamba_d_conv = 1 is not an integer from 2"),
])
def test_what_granite_does_not_run_is_refused_in_one_sentence(changes: dict, says: str) -> None:
    config = {**granite_config(**CONFIGS["tiny"]).to_dict(), "architectures": ["GraniteMoeHybridForCausalLM"]}
    if changes.get("num_local_experts") == "absent":  # transformers' default: 8 experts a layer
        changes, config = {}, {k: v for k, v in config.items() if k != "num_local_experts"}
    assert_refused({**config, **changes}, says)


def test_spec_buffers_shapes_and_modes() -> None:
    """mamba2-tiny: one KV buffer; per Mamba2 layer a conv state [4 heads * 32 + 2 * 2 groups * 16, 3] in the
    model's dtype and an SSM state [4, 32, 16] in float32; HF's parameter names and shapes (in_proj emits z,
    x|B|C and dt); TP that does not split the heads evenly, or the groups by TP or TP by them, refused; the
    preset's identity is its own."""
    spec = parse_random_spec("mamba2-tiny")
    kv = DenseKV(spec, 8, torch.bfloat16, state_slots=5)
    assert len(kv.k_buffers) == 1 and spec.scan_chunk == 64
    assert [[(tuple(t.shape), t.dtype) for t in layer] for layer in kv.state_buffers] == \
        [[((5, 192, 3), torch.bfloat16), ((5, 4, 32, 16), torch.float32)]] * 2
    shapes = parameter_shapes(spec)
    assert shapes["model.layers.0.mamba.in_proj.weight"] == (128 + 192 + 4, 64)
    assert (shapes["model.layers.1.mamba.conv1d.weight"], shapes["model.layers.1.mamba.conv1d.bias"]) == \
        ((192, 1, 4), (192,))
    mixer = "model.layers.0.mamba."
    assert [shapes[mixer + name] for name in ("A_log", "D", "dt_bias", "norm.weight", "out_proj.weight")] == \
        [(4,), (4,), (4,), (128,), (64, 128)]
    assert "model.layers.2.mamba.A_log" not in shapes and "model.layers.0.self_attn.q_proj.weight" not in shapes
    check_parallel(spec, 2, 1), check_parallel(spec, 4, 1)  # (TP: tests/test_recurrent_parallel.py)
    with pytest.raises(ConfigError, match="--tp-size 3 does not split the model's 4 Mamba2 heads in 2 groups"):
        check_parallel(spec, 3, 1)
    with pytest.raises(ConfigError, match="--tp-size 2 does not split the model's 6 Mamba2 heads in 3 groups"):
        check_parallel(parse_random_spec('{"preset": "mamba2-tiny", "mamba_heads": 6, "mamba_groups": 3}'), 2, 1)
    identities = {load_model(f"random:{name}", weights=False).identity for name in ("mamba2-tiny", "gdn-tiny", "tiny")}
    assert len(identities) == 3


def test_bfloat16_keeps_the_recurrence_in_float32() -> None:
    """The model in bfloat16: its SSM states stay float32 through a split prefill and decode steps, and its
    logits stay within a few percent of the float32 model's spread."""
    check_bfloat16_recurrence("mamba2-tiny")
