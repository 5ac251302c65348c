"""LFM2 at the model level (issue 59 step a): an HF directory written by transformers'
Lfm2ForCausalLM loads through our HF loader to its float32 logits (a tiny config and LFM2-350M's
layer shapes, 3 layers); a prompt split anywhere, then decode steps, gives the one-pass logits, and
the conv state after a split prefill is the one-pass state bit for bit; the MLP width is
transformers' for ``block_auto_adjust_ff_dim`` configs; MoE and unknown layer types are refused in
one sentence; the engine refuses the model until it has a state pool (step b)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from dense_forward import prefill_logits
from recurrent_checks import (assert_refused, assert_states_close, check_batch_keeps_states,
                              check_greedy_equals_generate, check_logits_match, check_split_then_decode, load_pair,
                              one_sentence, random_ids, randomized, save_hf_dir)

from hicache.model import DenseKV, ModelFormatError, ModelSpec, ModelSpecError, load_model, make_forward_batch
from hicache.model.families import LFM2
from hicache.model.hf_loader import spec_from_hf_config
from hicache.model.llama import parameter_shapes
from hicache.model.parallel import model_shard, shard_model
from hicache.model.projection import dense_rows_invariant
from hicache.model.random_model import parse_random_spec

pytestmark = pytest.mark.model

transformers = pytest.importorskip("transformers")

LAYERS = ["conv", "conv", "full_attention"]
CONFIGS = {  # besides the common keys of lfm2_config
    "tiny": dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                 block_auto_adjust_ff_dim=False, conv_bias=True, tie_word_embeddings=False),
    # LFM2-350M's layer shapes (16 heads, 8 KV heads of 64; the MLP 6656 -> 4608), 3 of its 16 layers, a small vocab
    "lfm2-350m-shapes": dict(vocab_size=512, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                             block_ff_dim=6656, block_auto_adjust_ff_dim=True, block_multiple_of=256,
                             block_ffn_dim_multiplier=1.0),
}


def lfm2_config(**keys) -> "transformers.Lfm2Config":
    common = dict(num_hidden_layers=3, layer_types=LAYERS, conv_L_cache=3, max_position_embeddings=4096,
                  bos_token_id=256, eos_token_id=257, pad_token_id=0)
    return transformers.Lfm2Config(**{**common, **keys})


def write_hf_dir(folder, config: str) -> torch.nn.Module:
    """transformers' model of ``CONFIGS[config]`` with random weights, saved in ``folder`` as safetensors
    with a byte tokenizer; returns the model. Every parameter drawn (recurrent_checks.randomized): norms
    1 + N(0, 0.1), conv taps N(0, 0.5), the other vectors (biases) N(0, 0.1)."""
    hf = transformers.Lfm2ForCausalLM(lfm2_config(**CONFIGS[config]))
    return save_hf_dir(randomized(hf, 3, norm_mean=lambda name: 1.0,
                                  rest=lambda name: 0.5 if name.endswith("conv.conv.weight") else 0.1), folder)


@pytest.fixture(scope="module", params=["tiny", pytest.param("lfm2-350m-shapes", marks=pytest.mark.slow)])
def pair(request, tmp_path_factory):
    """transformers' model and ours loaded from the directory it saved."""
    return load_pair(write_hf_dir, request.param, tmp_path_factory.mktemp(request.param))


def test_logits_match_transformers(pair) -> None:
    spec = pair.ours.spec
    assert spec.layer_kinds == ("conv", "conv", "full") and spec.conv_kernel == 3 and spec.qk_norm
    assert spec.intermediate_size == (4608 if pair.name == "lfm2-350m-shapes" else 128)
    check_logits_match(pair)


def test_split_prefill_then_decode_equals_one_pass(pair) -> None:
    """Chunks of 100, 1, 1 (shorter than the conv's 2-input state: the old state's rows move along),
    37 and 141 tokens, then 20 decode steps: every row's logits as the one-pass prompt's, and the conv
    states after the chunks those of one 280-token pass, bit for bit."""
    split, whole = check_split_then_decode(pair.ours.model, (100, 1, 1, 37, 141), steps=20)
    # (the CPU's BLAS gives a row the same bits in any pass: the engine checks it too)
    assert_states_close(split, whole, [(0.0, 0.0)] if dense_rows_invariant() else [(1e-6, 1e-5)])


def test_sequences_of_one_batch_keep_their_own_state() -> None:
    """Three prompts in one pass, their next chunks (3, 1 and 4 tokens, each from its own state) in a
    second, then one decode step of all three: each sequence's logits as it gets alone. A pass reading
    one slot and writing another (a hit's first forward) leaves the source as it was."""
    model = load_model("random:lfm2-tiny", dtype=torch.float32).model
    check_batch_keeps_states(model, (31, 18, 25), ((20, 23), (1, 2), (9, 13)), third=(1, 2))


@pytest.mark.parametrize("keys", [
    dict(block_ff_dim=6656),  # LFM2-350M: int(2 * 6656 / 3) = 4437 -> 4608
    dict(intermediate_size=6656, block_auto_adjust_ff_dim=False),
    dict(block_ff_dim=12288, block_ffn_dim_multiplier=1.5, block_multiple_of=128),
    dict(intermediate_size=1000, block_ffn_dim_multiplier=0.9, block_multiple_of=64),  # int(0.9 * 666) = 599 -> 640
    dict(intermediate_size=512, block_ff_dim=4000),  # block_ff_dim wins
])
def test_mlp_width_is_transformers(keys: dict) -> None:
    """The raw keys (older files: block_ff_dim) and what save_pretrained writes both give Lfm2MLP's width."""
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    config = lfm2_config(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **keys)
    width = Lfm2MLP(config).w1.out_features
    raw = {**config.to_dict(), **keys, "architectures": ["Lfm2ForCausalLM"]}
    raw.pop("intermediate_size") if "intermediate_size" not in keys else None
    assert spec_from_hf_config(raw).intermediate_size == width
    assert spec_from_hf_config({**config.to_dict(), "architectures": ["Lfm2ForCausalLM"]}).intermediate_size == width


def test_older_config_keys_read_as_transformers_reads_them() -> None:
    """LFM2-350M's published config.json style (full_attn_idxs, tie_embedding, top-level rope_theta, norm_eps,
    block_ff_dim beside intermediate_size): the same layers, head, RoPE base, eps and width as Lfm2Config."""
    raw = {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 1024, "num_hidden_layers": 16,
           "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 65536, "max_position_embeddings": 128000,
           "full_attn_idxs": [2, 5, 8, 10, 12, 14], "tie_embedding": True, "rope_theta": 1000000.0, "norm_eps": 1e-5,
           "block_ff_dim": 6656, "intermediate_size": 6656, "block_auto_adjust_ff_dim": True, "block_multiple_of": 256,
           "block_ffn_dim_multiplier": 1.0, "conv_L_cache": 3, "conv_bias": False}
    theirs = transformers.Lfm2Config(**raw)
    spec = spec_from_hf_config(raw)
    assert [{"full": "full_attention"}.get(k, k) for k in spec.layer_kinds] == theirs.layer_types
    assert spec.attention_layers == (2, 5, 8, 10, 12, 14) and spec.tie_word_embeddings
    assert (spec.rope_theta, spec.rms_norm_eps, spec.intermediate_size) == (1e6, 1e-5, 4608)
    assert spec.kv_bytes_per_token(torch.float32) == 6 * 2 * 8 * 64 * 4  # the attention layers' only
    without = {k: v for k, v in raw.items() if k not in ("rope_theta", "full_attn_idxs")}
    assert spec_from_hf_config(without).rope_theta == 1e6 and spec_from_hf_config(without).recurrent_layers == ()


@pytest.mark.parametrize("changes, says", [
    ({"architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe"},
     "mixture-of-experts variant is not supported"),
    ({"architectures": [], "model_type": "lfm2_moe"}, "mixture-of-experts variant is not supported"),
    ({"architectures": ["Lfm2VlForConditionalGeneration"]}, "vision-language variant is not supported"),
    ({"layer_types": ["conv", "linear_attention", "full_attention"]}, "layer_types ['linear_attention'] are not "
                                                                       "implemented for lfm2"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
     "layer_types ['conv'] are not implemented for llama"),
    ({"conv_L_cache": 1}, "conv_L_cache = 1 is not an integer from 2"),
])
def test_what_lfm2_does_not_run_is_refused_in_one_sentence(changes: dict, says: str) -> None:
    config = {**lfm2_config(**CONFIGS["tiny"]).to_dict(), "architectures": ["Lfm2ForCausalLM"], **changes}
    assert_refused(config, r"\b" + says.replace("[", r"\[").replace("]", r"\]"), ModelFormatError)


def test_a_tensor_under_both_names_is_refused(tmp_path) -> None:
    """The final norm stored as transformers names it and as the model does: which one would load is
    not for the loader to guess."""
    from safetensors.torch import load_file, save_file

    write_hf_dir(tmp_path, "tiny")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.embedding_norm.weight"].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelFormatError, match="fills model.norm.weight, which another tensor of the file fills too"):
        load_model(str(tmp_path), dtype=torch.float32)


def test_greedy_paged_equals_transformers_generate() -> None:
    """lfm2-tiny's random weights in transformers' model (by the family's name table): 16 greedy tokens
    through prefill and decode steps (conv states, the attention layer's fused decode) equal generate's."""
    ours = load_model("random:lfm2-tiny", dtype=torch.float32)
    spec = ours.spec
    config = lfm2_config(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                         intermediate_size=spec.intermediate_size, block_auto_adjust_ff_dim=False,
                         num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                         norm_eps=spec.rms_norm_eps, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta})
    check_greedy_equals_generate(transformers.Lfm2ForCausalLM, config, ours,
                                 lambda params, name: params[LFM2.hf_param(name)],
                                 "Short convolutions keep two inputs a channel; 42 times!")


def test_pipeline_stages_index_their_own_kv_and_state_buffers() -> None:
    """PP2 of lfm2-tiny: stage 0 holds the two conv layers (state buffers 0, 1), stage 1 the attention
    layer (KV buffer 0); the two stages chained give the whole model's logits."""
    spec, ids = parse_random_spec("lfm2-tiny"), random_ids(40, 256, seed=2)
    whole = prefill_logits(load_model("random:lfm2-tiny", dtype=torch.float32).model, ids)
    stages = [load_model("random:lfm2-tiny", dtype=torch.float32).model for _ in range(2)]
    for rank, stage in enumerate(stages):
        shard_model(stage, model_shard(spec, 0, 1, rank, 2), None)
    assert [layer.conv.state_index for layer in stages[0].model.layers] == [0, 1]
    assert [layer.self_attn.layer for layer in stages[1].model.layers] == [0]
    full = DenseKV(spec, 41, torch.float32)
    views = [SimpleNamespace(k_buffers=[], v_buffers=[], state_buffers=full.state_buffers, wait_layer=full.wait_layer,
                             layer_ready=full.layer_ready),
             SimpleNamespace(k_buffers=full.k_buffers, v_buffers=full.v_buffers, state_buffers=[],
                             wait_layer=full.wait_layer, layer_ready=full.layer_ready)]
    batch = make_forward_batch([ids], [0], [torch.arange(1, 41)], logits="all", state_slots=[(0, 1)])
    torch.testing.assert_close(stages[1](batch, views[1], stages[0](batch, views[0])), whole, atol=1e-6, rtol=0)


def test_spec_buffers_and_shapes_by_layer_kind() -> None:
    """lfm2-tiny: one KV buffer (its attention layer), two conv states of [hidden, taps - 1]; the file checks'
    shapes name each layer's own parameters; conv layers need >= 2 taps and no MLA; the presets that were
    there keep their identities (storage namespaces and caches keyed by them stay valid)."""
    spec = parse_random_spec("lfm2-tiny")
    kv = DenseKV(spec, 8, torch.float32, state_slots=5)
    assert len(kv.k_buffers) == 1 and [tuple(t.shape) for (t,) in kv.state_buffers] == [(5, 64, 2)] * 2
    assert spec.kv_bytes_per_token(torch.float32) == 2 * 2 * 16 * 4 and spec.state_shapes(1) == ((64, 2),)
    shapes = parameter_shapes(spec)
    assert shapes["model.layers.1.conv.conv.weight"] == (64, 1, 3)
    assert shapes["model.layers.2.self_attn.q_norm.weight"] == (16,)
    assert "model.layers.2.conv.in_proj.weight" not in shapes and "model.layers.0.self_attn.q_proj.weight" not in shapes
    with pytest.raises(ModelSpecError, match="conv layers need conv_kernel >= 2"):
        ModelSpec(**{**spec.to_dict(), "conv_kernel": 1})
    with pytest.raises(ModelSpecError, match="with MLA"):
        ModelSpec(**{**parse_random_spec("mla-tiny").to_dict(), "conv_kernel": 3, "num_layers": 2,
                     "layer_kinds": ("conv", "full")})
    identities = {"tiny": "a2259ab9f828999b", "mla-tiny": "2294866286bebf36", "small": "71215ae82043a99d",
                  "gemma-small": "2ab4e3e3953bd8ca"}  # (as before the recurrent fields existed)
    for preset, digest in identities.items():
        assert load_model(f"random:{preset}", weights=False).identity == f"random:{digest}:seed=0:bfloat16", preset


@pytest.mark.parametrize("field, value, kind", [
    ("num_heads", 0, "positive"), ("conv_kernel", -1, "non-negative"), ("gdn_value_dim", True, "non-negative"),
    ("rotary_dim", 2.5, "non-negative"), ("mamba_state", "16", "non-negative"),
])
def test_a_size_that_is_not_a_whole_number_is_refused_naming_it(field: str, value, kind: str) -> None:
    """A size or count (a bool is not one; the recurrent layers' sizes may be 0 in a model without such
    layers) refused in one sentence naming the field and the value."""
    spec = parse_random_spec("lfm2-tiny")
    with pytest.raises(ModelSpecError, match=re.escape(f"model spec field {field} must be a {kind} integer, "
                                                       f"got {value!r}.")) as caught:
        ModelSpec(**{**spec.to_dict(), field: value})
    assert one_sentence(str(caught.value))


def shard_state_rows(spec: ModelSpec, shard) -> tuple[torch.Tensor, slice]:
    """Which of the whole layer's conv-state rows, and which value heads of its recurrent matrix, ``shard`` holds."""
    if shard.conv_channels:
        return torch.arange(shard.conv_channels.start, shard.conv_channels.stop), slice(None)
    kh, vh, dk, dv, keys = (shard.gdn_key_heads, shard.gdn_value_heads, spec.gdn_key_dim, spec.gdn_value_dim,
                            spec.gdn_key_heads * spec.gdn_key_dim)
    parts = ((kh.start * dk, kh.stop * dk), (keys + kh.start * dk, keys + kh.stop * dk),
             (2 * keys + vh.start * dv, 2 * keys + vh.stop * dv))  # q, k, v channels
    rows = torch.cat([torch.arange(a, b) for a, b in parts])
    return rows, slice(vh.start, vh.stop)


@pytest.mark.parametrize("name", ['random:{"preset": "lfm2-tiny", "conv_bias": true}', "random:gdn-tiny"])
def test_tp_shards_of_a_recurrent_layer_sum_to_its_output_and_hold_slices_of_its_state(name: str) -> None:
    """TP2 (LFM2 by channels, a bias included; gated DeltaNet by key heads): the shards' partial outputs
    sum to the whole mixer's, and each shard's state is its rows of the whole state (its pool's shapes)."""
    whole = load_model(name, dtype=torch.float32).model
    spec, ids = whole.spec, random_ids(70, 256, seed=4)
    x = torch.randn(70, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    batch = make_forward_batch([ids], [0], [torch.arange(1, 71)], state_slots=[(0, 1)])
    kv = DenseKV(spec, 2, torch.float32)
    want = whole.model.layers[0].state_mixer(x, batch, kv)
    got = torch.zeros_like(want)
    for rank in range(2):
        shard = model_shard(spec, rank, 2, 0, 1)
        model = load_model(name, dtype=torch.float32).model
        shard_model(model, shard, None)
        states = [tuple(torch.zeros((2, *shape)) for shape in shard.state_shapes(spec, layer))
                  for layer in spec.recurrent_layers]
        got += model.model.layers[0].state_mixer(x, batch, SimpleNamespace(state_buffers=states))
        rows, heads = shard_state_rows(spec, shard)
        torch.testing.assert_close(states[0][0][1], kv.state_buffers[0][0][1][rows], atol=1e-6, rtol=0)
        if len(states[0]) > 1:
            torch.testing.assert_close(states[0][1][1], kv.state_buffers[0][1][1][heads], atol=1e-6, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
