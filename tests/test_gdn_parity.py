"""Qwen3.5 at the model level (issue 59 step f): an HF directory written by transformers'
Qwen3_5ForCausalLM loads through our HF loader to its float32 logits -- gated DeltaNet layers, gated
attention with partial rotary, zero-centred norms but the DeltaNet's gated one -- at tiny shapes
(value heads = key heads, and twice the key heads as Qwen3-Next's) and Qwen3.5-0.8B's layer shapes
(4 of its 24 layers); a prompt split mid scan chunk, then decode steps, gives the one-pass logits;
greedy tokens equal transformers' generate; the official ConditionalGeneration layout (text_config,
``model.language_model.`` tensors, a vision tower and an MTP head left unread) loads to the same
model; MoE variants and config options the layer does not implement are refused in one sentence."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from dense_forward import prefill_logits
from recurrent_checks import (SPREAD_TOL, assert_refused, assert_states_close, check_batch_keeps_states,
                              check_bfloat16_recurrence, check_greedy_equals_generate, check_logits_match,
                              check_split_then_decode, load_pair, random_ids, randomized, run_pass, save_hf_dir,
                              spread_error)

from hicache.errors import ConfigError
from hicache.model import DenseKV, load_model
from hicache.model.families import QWEN35
from hicache.model.hf_loader import spec_from_hf_config
from hicache.model.llama import parameter_shapes
from hicache.model.parallel import check_parallel, model_shard
from hicache.model.random_model import parse_random_spec

pytestmark = pytest.mark.model

transformers = pytest.importorskip("transformers")

GDN, FULL = "linear_attention", "full_attention"
CONFIGS = {  # besides the common keys of qwen35_config
    "tiny": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, layer_types=[GDN, GDN, FULL], tie_word_embeddings=False),
    # value heads twice the key heads (Qwen3-Next's 16 / 32), value heads narrower than key heads, half the dims rotary
    "tiny-grouped": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=8, layer_types=[GDN, FULL, GDN],
                         partial_rotary_factor=0.5, tie_word_embeddings=False),
    # Qwen3.5-0.8B's layer shapes (its published text_config): 16 key and value heads of 128, attention 8 heads and
    # 2 KV heads of 256 rotating 64 dims, MLP 3584, a tied head; 4 of its 24 layers, a small vocab
    "qwen3.5-0.8b-shapes": dict(vocab_size=512, hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                                num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                                linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                                layer_types=[GDN, GDN, GDN, FULL], tie_word_embeddings=True),
}


def qwen35_config(**keys) -> "transformers.Qwen3_5TextConfig":
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": keys.pop("partial_rotary_factor", 0.25),
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    common = dict(num_hidden_layers=len(keys["layer_types"]), linear_conv_kernel_dim=4, max_position_embeddings=4096,
                  rope_parameters=rope, bos_token_id=256, eos_token_id=257, pad_token_id=0)
    return transformers.Qwen3_5TextConfig(**{**common, **keys})


def write_hf_dir(folder, config: str) -> torch.nn.Module:
    """transformers' model of ``CONFIGS[config]`` with random weights, saved in ``folder`` as safetensors with
    a byte tokenizer; returns the model. Every parameter drawn (recurrent_checks.randomized): zero-centred
    norms (stored w, computing 1 + w) N(0, 0.1), the gated norm (stored as it computes) 1 + N(0, 0.1), so a
    norm offset applied to the wrong norm shows; conv taps, A_log, dt_bias N(0, 0.5)."""
    hf = transformers.Qwen3_5ForCausalLM(qwen35_config(**CONFIGS[config]))
    return save_hf_dir(randomized(hf, 5, norm_mean=lambda name: float(name.endswith("linear_attn.norm.weight")),
                                  rest=lambda name: 0.5), folder)


@pytest.fixture(scope="module", params=["tiny", "tiny-grouped",
                                        pytest.param("qwen3.5-0.8b-shapes", marks=pytest.mark.slow)])
def pair(request, tmp_path_factory):
    """transformers' model and ours loaded from the directory it saved."""
    return load_pair(write_hf_dir, request.param, tmp_path_factory.mktemp(request.param))


def test_logits_match_transformers(pair) -> None:
    spec, config = pair.ours.spec, CONFIGS[pair.name]
    assert [{"gdn": GDN, "full": FULL}[k] for k in spec.layer_kinds] == config["layer_types"]
    assert spec.attn_output_gate and spec.qk_norm and spec.conv_kernel == 4
    assert spec.rope_dim == int(config["head_dim"] * config.get("partial_rotary_factor", 0.25))
    check_logits_match(pair)


def test_split_prefill_then_decode_equals_one_pass(pair) -> None:
    """Prompt chunks of 100, 1, 37 and 162 tokens (each split inside a 64-token scan chunk, so the scan
    resumes mid chunk), then 24 decode steps (the batched one-token step): every row's logits as the
    one-pass prompt's, and the states after the chunks those of one 300-token pass."""
    split, whole = check_split_then_decode(pair.ours.model, (100, 1, 37, 162), steps=24)
    assert_states_close(split, whole, [(1e-6, 0.0), (1e-5, 1e-5)])  # the conv's last inputs, the recurrent matrix


def test_sequences_of_one_batch_keep_their_own_state() -> None:
    """Three prompts in one pass, their next chunks (3, 1 and 70 tokens, each from its own state) in a
    second, then one decode step of all three: each sequence's logits as it gets alone."""
    model = load_model("random:gdn-tiny", dtype=torch.float32).model
    check_batch_keeps_states(model, (31, 18, 100), ((20, 23), (1, 2), (9, 79)))


def test_greedy_paged_equals_transformers_generate() -> None:
    """gdn-tiny's random weights in transformers' model (its zero-centred norms as w - 1, the gated norm as
    it is): 16 greedy tokens through the prefill's scan and the decode steps equal generate's."""
    ours = load_model("random:gdn-tiny", dtype=torch.float32)
    spec = ours.spec
    config = qwen35_config(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                           intermediate_size=spec.intermediate_size, num_attention_heads=spec.num_heads,
                           num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                           linear_num_key_heads=spec.gdn_key_heads, linear_num_value_heads=spec.gdn_value_heads,
                           linear_key_head_dim=spec.gdn_key_dim, linear_value_head_dim=spec.gdn_value_dim,
                           layer_types=[GDN, GDN, FULL], rms_norm_eps=spec.rms_norm_eps, tie_word_embeddings=False,
                           partial_rotary_factor=spec.rotary_dim / spec.head_dim)
    config.rope_parameters["rope_theta"] = spec.rope_theta
    check_greedy_equals_generate(transformers.Qwen3_5ForCausalLM, config, ours,
                                 lambda params, name: params[name] - (1.0 if QWEN35.offset_norm(name) else 0.0),
                                 "Gated deltas keep a matrix a head; " * 3)


def test_conditional_generation_layout_loads_the_text_model(tmp_path_factory, caplog) -> None:
    """The official checkpoints' layout: config.json with the text model's config under text_config, its
    tensors under model.language_model., a vision tower's and an MTP head's tensors beside them: the same
    logits as the ForCausalLM directory, one log line naming the parts not loaded."""
    from safetensors.torch import load_file, save_file

    pair = SimpleNamespace(folder=tmp_path_factory.mktemp("causal-lm"))
    write_hf_dir(pair.folder, "tiny")
    pair.ours = load_model(str(pair.folder), dtype=torch.float32)
    tmp_path = tmp_path_factory.mktemp("conditional-generation")
    text = json.loads((pair.folder / "config.json").read_text())
    outer = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
             "vision_config": {"model_type": "qwen3_5", "depth": 1}, "tie_word_embeddings": False,
             "image_token_id": 248056}
    (tmp_path / "config.json").write_text(json.dumps(outer))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((pair.folder / name).read_bytes())
    tensors = {name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: t
               for name, t in load_file(str(pair.folder / "model.safetensors")).items()}
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with caplog.at_level(logging.INFO, logger="hicache.model.hf_loader"):
        loaded = load_model(str(tmp_path), dtype=torch.float32)
    assert loaded.spec == pair.ours.spec
    ids = random_ids(150, loaded.spec.vocab_size, seed=4)
    assert torch.equal(prefill_logits(loaded.model, ids), prefill_logits(pair.ours.model, ids))
    said = [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage()]
    assert len(said) == 1 and "2 checkpoint tensors" in said[0] and "model.visual.*, mtp.*" in said[0], said


def published_text_config(**changes) -> dict:
    """Qwen3.5-0.8B's config.json (Qwen3_5ForConditionalGeneration) as published, its vision part cut short."""
    text = {"attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
            "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
            "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3584,
            "layer_types": ([GDN] * 3 + [FULL]) * 6, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_value_head_dim": 128,
            "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_5_text",
            "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": 8,
            "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
            "use_cache": True, "vocab_size": 248320, "mamba_ssm_dtype": "float32",
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                                "rope_theta": 10000000, "partial_rotary_factor": 0.25}}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "image_token_id": 248056, "model_type": "qwen3_5",
            "text_config": {**text, **changes}, "tie_word_embeddings": True, "video_token_id": 248057,
            "vision_config": {"depth": 12, "hidden_size": 768, "model_type": "qwen3_5"}}


def test_published_config_reads_as_transformers_reads_it() -> None:
    """Qwen3.5-0.8B: 18 gated DeltaNet layers and 6 gated attention layers, 64 of 256 dims rotary, RoPE base
    1e7, a tied head; a state of 73,728 + 1,048,576 bytes a DeltaNet layer in float32 (the plan's 19.3 MiB a
    snapshot), KV 24 KiB a token; the defaults (no layer_types, no partial_rotary_factor) as transformers'."""
    raw = published_text_config()
    spec = spec_from_hf_config(raw)
    theirs = transformers.Qwen3_5TextConfig(**raw["text_config"])
    assert [{"gdn": GDN, "full": FULL}[k] for k in spec.layer_kinds] == theirs.layer_types
    assert spec.attention_layers == (3, 7, 11, 15, 19, 23) and spec.tie_word_embeddings
    assert (spec.rope_theta, spec.rope_dim, spec.rms_norm_eps, spec.intermediate_size) == (1e7, 64, 1e-6, 3584)
    assert spec.rope_scaling is None and spec.state_shapes(0) == ((6144, 3), (16, 128, 128))
    assert sum(torch.Size(s).numel() * 4 for s in spec.state_shapes(0)) == 73_728 + 1_048_576
    assert spec.kv_bytes_per_token(torch.float32) == 24 * 1024
    bare = {k: v for k, v in raw["text_config"].items() if k not in ("layer_types", "rope_parameters")}
    assert spec_from_hf_config({**bare, "architectures": ["Qwen3_5ForCausalLM"]}).layer_kinds == spec.layer_kinds
    assert spec_from_hf_config({**bare, "architectures": ["Qwen3_5ForCausalLM"]}).rope_dim == 64  # 0.25 of 256
    assert not spec_from_hf_config({**raw, "tie_word_embeddings": False}).tie_word_embeddings  # the outer config's


@pytest.mark.parametrize("changes, says", [
    ({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe"},
     "Qwen3.5's mixture-of-experts variant is not supported"),
    ({"architectures": ["Qwen3_5MoeForCausalLM"]}, "Qwen3.5's mixture-of-experts variant is not supported"),
    ({"architectures": [], "model_type": "qwen3_5_moe_text"}, "mixture-of-experts variant is not supported"),
    ({"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}, "Qwen3-Next has mixture-of-experts"),
    ({"attn_output_gate": False}, "attn_output_gate = False changes the attention's output gate"),
    ({"output_gate_type": "swish"}, "output_gate_type = 'swish' changes the attention's output gate"),
    ({"rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 1.5}}, "partial_rotary_factor = 1.5 is not in"),
    ({"layer_types": [GDN, "conv", FULL]}, r"layer_types \['conv'\] are not implemented for qwen3_5"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not what this engine's qwen3_5 layer computes"),
    ({"linear_num_key_heads": 3}, "the value heads a multiple of the key heads"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim = 1 is not an integer from 2"),
    ({"mlp_bias": True}, "mlp_bias = True changes the math"),
])
def test_what_qwen35_does_not_run_is_refused_in_one_sentence(changes: dict, says: str) -> None:
    config = {**qwen35_config(**CONFIGS["tiny"]).to_dict(), "architectures": ["Qwen3_5ForCausalLM"], **changes}
    assert_refused(config, says)
    with pytest.raises(ConfigError, match=says):  # the same inside a ConditionalGeneration config
        spec_from_hf_config({**published_text_config(**{k: v for k, v in changes.items() if k != "architectures"}),
                             **({"architectures": changes["architectures"]} if "architectures" in changes else {})})


def test_spec_buffers_shapes_and_modes() -> None:
    """gdn-tiny: one KV buffer; per DeltaNet layer a conv state [2*2*16 + 4*16, 3] in the model's dtype and a
    recurrent matrix [4, 16, 16] in float32; HF's parameter names and shapes (q_proj emits query and gate);
    a TP2 rank's state shapes, TP beyond the key heads refused; the preset's identity is its own."""
    spec = parse_random_spec("gdn-tiny")
    kv = DenseKV(spec, 8, torch.bfloat16, state_slots=5)
    assert len(kv.k_buffers) == 1
    assert [[(tuple(t.shape), t.dtype) for t in layer] for layer in kv.state_buffers] == \
        [[((5, 128, 3), torch.bfloat16), ((5, 4, 16, 16), torch.float32)]] * 2
    shapes = parameter_shapes(spec)
    assert shapes["model.layers.0.linear_attn.in_proj_qkv.weight"] == (128, 64)
    assert shapes["model.layers.1.linear_attn.conv1d.weight"] == (128, 1, 4)
    assert (shapes["model.layers.0.linear_attn.in_proj_z.weight"], shapes["model.layers.0.linear_attn.in_proj_a.weight"],
            shapes["model.layers.0.linear_attn.A_log"], shapes["model.layers.0.linear_attn.norm.weight"]) == \
        ((64, 64), (4, 64), (4,), (16,))
    assert shapes["model.layers.2.self_attn.q_proj.weight"] == (2 * 4 * 16, 64)
    assert "model.layers.2.linear_attn.A_log" not in shapes and "model.layers.0.self_attn.q_proj.weight" not in shapes
    check_parallel(spec, 2, 1)  # a key head a rank, with the two value heads that read it
    assert model_shard(spec, 1, 2, 0, 1).state_shapes(spec, 0) == ((2 * 16 + 2 * 16, 3), (2, 16, 16))
    with pytest.raises(ConfigError, match="--tp-size 3 exceeds the model's 2 gated DeltaNet key heads"):
        check_parallel(spec, 3, 1)
    assert load_model("random:gdn-tiny", weights=False).identity != load_model("random:lfm2-tiny", weights=False).identity


def test_bfloat16_keeps_the_recurrence_in_float32() -> None:
    """The model in bfloat16: its recurrent matrices stay float32 through a split prefill and decode steps,
    and its logits stay within a few percent of the float32 model's spread."""
    check_bfloat16_recurrence("gdn-tiny")


def test_gated_attention_with_partial_rotary_never_takes_the_fused_decode() -> None:
    """Attention-only layers with an output gate and 8 of 32 dims rotary (the native fused decode layer has
    neither): each decode step's logits are the one-pass prompt's rows."""
    model = load_model('random:{"preset": "small", "attn_output_gate": true, "rotary_dim": 8}',
                       dtype=torch.float32).model
    ids = random_ids(60, 256, seed=7)
    want = prefill_logits(model, ids)
    kv = DenseKV(model.spec, 61, torch.float32)
    rows = [run_pass(model, kv, ids, 0, 40, (0, 0))] + [run_pass(model, kv, ids, p, 1, (0, 0), generated=True)
                                                        for p in range(40, 60)]
    assert spread_error(torch.cat(rows), want) < SPREAD_TOL
