"""GGUF files of the recurrent families as llama.cpp's converter writes them (issue 59, step f): LFM2
(``lfm2``), Qwen3.5 (``qwen35``) and Granite 4.0-H (``granitehybrid``). Random transformers weights are saved as an HF directory and
written as GGUF by ``tests/hf_to_gguf.py`` (its docstring: the llama.cpp commits it follows, and
how the converter stores each tensor: squeezed convs, ``ssm_a = -exp(A_log)``, norms with their 1
folded in, Qwen3.5's value heads tiled, Granite's vectors as matrices and q/k rows interleaved); the GGUF loader must undo each, so that:

- an F32 file gives the HF directory's spec and, over 320 positions, its logits (bit for bit: every
  transform is exact or, for ``A_log``, rounded once from float64);
- a Q8_0 file (the gguf package's quantizer; rows reordered as whole blocks) loads with each weight
  within Q8_0's rounding of the F32 one (half a block's scale: a misplaced row is far off), logits
  within 12% (max) and 1% (mean) of the F32 logits' spread, 90% of the top tokens the same, and
  decode steps read its blocks;
- a newer converter's MTP blocks are left unread; an unknown or a missing tensor, metadata the
  model cannot run, and the MoE / Qwen3-Next architectures (Granite's MoE by its ``expert_count``) are
  refused in one sentence.

The written names are checked against the gguf package's tensor list for each architecture (what
llama.cpp's loader accepts), not only against the loader."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from dense_forward import greedy_paged, prefill_logits
from gguf_edit import rewrite_gguf
from hf_to_gguf import QWEN35_MROPE_SECTIONS, RECURRENT_ARCHS, recurrent_to_gguf, tiled

from hicache.errors import ConfigError
from hicache.model import load_model
from hicache.model.families.qwen35 import tiled_to_grouped
from hicache.model.gguf_file import GGUFFile
from hicache.model.tokenizer import byte_tokenizer

pytestmark = pytest.mark.model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

GDN, FULL, MAMBA, ATTENTION = "linear_attention", "full_attention", "mamba", "attention"
POSITIONS = 320
F32_TOL = 1e-5  # max |GGUF - HF directory| over the logits' spread (seen: 0, bit for bit)
# Q8_0 vs F32 logits over their spread, max and mean, and the top tokens that agree (seen: 1.0% / 0.12% / 100% LFM2,
# 7.2% / 0.29% / 95.6% Qwen3.5, whose error does not grow along the 320 positions)
Q8_MAX, Q8_MEAN, Q8_TOP = 0.12, 0.01, 0.9


def lfm2_model() -> torch.nn.Module:
    """LFM2 as published (no conv bias, a tied head), the MLP width derived (192 -> 128), conv layers
    around an attention layer."""
    config = transformers.Lfm2Config(
        vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=192,
        block_auto_adjust_ff_dim=True, block_multiple_of=32, block_ffn_dim_multiplier=1.0, num_hidden_layers=4,
        layer_types=["conv", "conv", FULL, "conv"], conv_L_cache=3, conv_bias=False, tie_word_embeddings=True,
        max_position_embeddings=4096, bos_token_id=256, eos_token_id=257, pad_token_id=0)
    return _randomized(transformers.Lfm2ForCausalLM(config), offset_norms=False)


def qwen35_model() -> torch.nn.Module:
    """Qwen3.5 with three value heads per key head (so the converter's tiling is no involution), value
    heads as wide as key heads, half of the attention heads' dims rotary, every 4th layer attention."""
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5, "mrope_section": [4, 2, 2],
            "mrope_interleaved": True}
    config = transformers.Qwen3_5TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=[GDN, GDN, GDN, FULL], num_hidden_layers=4, rope_parameters=rope,
        tie_word_embeddings=False, max_position_embeddings=4096, bos_token_id=256, eos_token_id=257, pad_token_id=0)
    return _randomized(transformers.Qwen3_5ForCausalLM(config), offset_norms=True)


def granite_model() -> torch.nn.Module:
    """Granite 4.0-H as published (dense: no experts; NoPE, the only kind its converter writes; a tied head;
    conv biases, no projection biases; its four multipliers) with B and C in two groups, so the stored
    ``[groups, d_inner / groups]`` norm is not a plain row."""
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, shared_intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=4, layer_types=[MAMBA, MAMBA, ATTENTION, MAMBA], mamba_n_heads=4,
        mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, num_local_experts=0,
        num_experts_per_tok=0, position_embedding_type="nope", tie_word_embeddings=True, embedding_multiplier=2.0,
        attention_multiplier=0.25, residual_multiplier=0.5, logits_scaling=4.0, rms_norm_eps=1e-5,
        max_position_embeddings=4096, bos_token_id=256, eos_token_id=257, pad_token_id=0)
    return _randomized(transformers.GraniteMoeHybridForCausalLM(config), offset_norms=False)


def _randomized(hf: torch.nn.Module, offset_norms: bool) -> torch.nn.Module:
    """Every parameter drawn, so a dropped, misplaced or mis-transformed tensor shows: norms ~ 1 + N(0, 0.1)
    (Qwen3.5's zero-centred ones ~ N(0, 0.1), its gated norm as LFM2's), matrices at 1/sqrt(fan-in),
    embeddings N(0, 1), the rest (conv taps, A_log, dt_bias) N(0, 0.5)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                plain = not offset_norms or name.endswith("linear_attn.norm.weight")
                p.copy_(1.0 + 0.1 * r if plain else 0.1 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r / p.shape[1] ** 0.5 if p.dim() == 2 else 0.5 * r)
    return hf.eval()


ARCHS = {"lfm2": lfm2_model, "qwen35": qwen35_model, "granitehybrid": granite_model}
# spec fields a file says otherwise than the HF directory, by architecture: Granite's converter writes a
# 2**20 context for a model without RoPE
FILE_FIELDS = {"granitehybrid": ("max_position_embeddings",)}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def case(request, tmp_path_factory):
    """One architecture's HF directory, its F32 GGUF file, and the HF directory's model and logits."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = ARCHS[request.param]()
    hf.save_pretrained(folder / "hf")
    byte_tokenizer().backend.save(str(folder / "hf" / "tokenizer.json"))
    (folder / "hf" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    reference = load_model(str(folder / "hf"), dtype=torch.float32)
    ids = torch.randint(0, 320, (POSITIONS,), generator=torch.Generator().manual_seed(1)).tolist()
    return SimpleNamespace(arch=request.param, hf=hf, folder=folder, reference=reference, ids=ids,
                           logits=prefill_logits(reference.model, ids),
                           f32=recurrent_to_gguf(hf, folder / "f32.gguf", request.param))


def spread_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / (want.max() - want.min()))


def test_f32_file_loads_to_the_hf_directorys_spec_and_logits(case) -> None:
    loaded = load_model(str(case.f32), dtype=torch.float32)
    want = case.reference.spec
    assert loaded.spec.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # (stored as float32)
    same = {key: getattr(want, key) for key in FILE_FIELDS.get(case.arch, ())}
    assert dataclasses.replace(loaded.spec, rms_norm_eps=want.rms_norm_eps, **same) == want
    got = prefill_logits(loaded.model, case.ids)
    assert spread_error(got, case.logits) <= F32_TOL
    assert torch.equal(got, case.logits)  # (seen on every run: say so if a platform ever differs)


def test_written_file_has_llama_cpps_layout(case) -> None:
    """Every tensor is one the gguf package lists for the architecture (llama.cpp's loader accepts no
    other), and the stored forms are the converter's: squeezed convs, per-layer KV heads for LFM2,
    ``-exp(A_log)`` and the interval keys for Qwen3.5."""
    reader = GGUFFile(str(case.f32))
    arch = gguf.MODEL_ARCH[RECURRENT_ARCHS[case.arch]]
    layers = case.hf.config.num_hidden_layers
    allowed = {gguf.TENSOR_NAMES[t].format(bid=i) + suffix for t in gguf.MODEL_TENSORS[arch] for i in range(layers)
               for suffix in (".weight", ".bias", "")}
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) <= allowed
    if case.arch == "lfm2":
        assert reader.fields["lfm2.attention.head_count_kv"] == [0, 0, 2, 0]
        assert reader.fields["lfm2.feed_forward_length"] == 128 and reader.fields["lfm2.shortconv.l_cache"] == 3
        assert tensors["blk.0.shortconv.conv.weight"].shape == (3, 64)  # (GGUF order: fastest first)
        assert "token_embd_norm.weight" in tensors and "output.weight" not in tensors
    elif case.arch == "granitehybrid":
        _check_granite_layout(reader, tensors, case.hf)
    else:
        assert reader.fields["qwen35.full_attention_interval"] == 4 and reader.fields["qwen35.rope.dimension_count"] == 16
        assert reader.fields["qwen35.rope.dimension_sections"] == [4, 2, 2, 0] != QWEN35_MROPE_SECTIONS
        assert (reader.fields["qwen35.ssm.group_count"], reader.fields["qwen35.ssm.time_step_rank"]) == (2, 6)
        assert tensors["blk.0.ssm_conv1d.weight"].shape == (4, 2 * 2 * 16 + 6 * 16)
        a_log = case.hf.model.layers[0].linear_attn.A_log.detach()
        stored = torch.from_numpy(np.array(tensors["blk.0.ssm_a"].data))
        assert torch.equal(stored, -tiled(a_log, 0, 2, 1).exp())


def _check_granite_layout(reader: GGUFFile, tensors: dict, hf: torch.nn.Module) -> None:
    """Granite's stored forms: KV heads per layer, no RoPE, the multipliers, the Mamba2 sizes, ``ssm_a`` as
    ``-exp(A_log)`` in ``[heads, 1]``, the norm as ``[groups, d_inner / groups]``, the MLP split."""
    fields = reader.fields
    assert fields["granitehybrid.attention.head_count_kv"] == [0, 0, 2, 0]
    assert fields["granitehybrid.rope.scaling.finetuned"] is False and fields["granitehybrid.context_length"] == 2 ** 20
    assert [fields[f"granitehybrid.{key}"] for key in ("embedding_scale", "attention.scale", "residual_scale",
                                                       "logit_scale")] == [2.0, 0.25, 0.5, 4.0]
    assert [fields[f"granitehybrid.ssm.{key}"] for key in ("time_step_rank", "inner_size", "group_count", "state_size",
                                                           "conv_kernel")] == [4, 128, 2, 16, 4]
    assert tensors["blk.0.ssm_a"].shape == (1, 4) and tensors["blk.0.ssm_norm.weight"].shape == (64, 2)
    assert tensors["blk.0.ssm_conv1d.weight"].shape == (4, 128 + 2 * 2 * 16)
    a_log = hf.model.layers[0].mamba.A_log.detach()
    assert torch.equal(torch.from_numpy(np.array(tensors["blk.0.ssm_a"].data)).reshape(-1), -a_log.exp())
    assert tensors["blk.2.ffn_gate.weight"].shape == tensors["blk.2.ffn_up.weight"].shape == (64, 96)
    assert "output.weight" not in tensors and "blk.2.ssm_in.weight" not in tensors


def test_granite_rope_follows_rope_scaling_finetuned(tmp_path) -> None:
    """llama.cpp's Granite switch for RoPE: the converter's false is NoPE; true, or no key (llama.cpp's
    Granite default), is RoPE, which changes the logits."""
    source = recurrent_to_gguf(granite_model(), tmp_path / "source.gguf", "granitehybrid")
    ids = list(range(3, 120, 3))
    nope = load_model(str(source), dtype=torch.float32)
    for value in (True, None):
        path = rewrite_gguf(tmp_path / f"{value}.gguf", src=source, kv={"granitehybrid.rope.scaling.finetuned": value})
        rope = load_model(str(path), dtype=torch.float32)
        assert nope.spec.nope and not rope.spec.nope
        assert not torch.allclose(prefill_logits(rope.model, ids), prefill_logits(nope.model, ids), atol=1e-3)


def test_tiled_value_heads_are_put_back() -> None:
    """llama.cpp's converter: grouped ``[G0_v0, G0_v1, G0_v2, G1_v0, ..]`` -> tiled ``[G0_v0, G1_v0, G0_v1, ..]``;
    the loader's order takes each model row back from there."""
    grouped = torch.arange(6)
    assert tiled(grouped, 0, 2, 1).tolist() == [0, 3, 1, 4, 2, 5]
    assert torch.equal(tiled(grouped, 0, 2, 1)[tiled_to_grouped(2, 3, 1)], grouped)
    rows = torch.arange(2 * 3 * 4)
    assert torch.equal(tiled(rows, 0, 2, 4)[tiled_to_grouped(2, 3, 4)], rows)


def test_q8_0_file_loads_close_and_decodes_from_its_blocks(case) -> None:
    """Each weight is within Q8_0's rounding of the F32 file's (half its block's scale absmax / 127, the
    scale itself rounded to float16; bounded by its row's absmax, since a file block may hold other
    columns than the model's 32): a row or column put back in the wrong place would be off by the
    weights' own size. Decode steps read the file's blocks for every matrix but Qwen3.5's DeltaNet
    ``out_proj`` (its columns were moved), the reordered rows' included, and greedy steps agree with
    the prefill's argmax."""
    q8 = load_model(str(recurrent_to_gguf(case.hf, case.folder / "q8.gguf", case.arch, q8_0=True)),
                    dtype=torch.float32)
    f32 = load_model(str(case.f32), dtype=torch.float32).model
    exact = dict(f32.named_parameters())
    for name, p in q8.model.named_parameters():
        want = exact[name]
        if p.dim() == 2 and p.shape[1] % 32 == 0:
            bound = want.abs().amax(1, keepdim=True) / 127 * (0.5 + 127 / 2048) + 1e-6
            assert ((p - want).abs() <= bound).all(), name
        else:
            assert torch.equal(p, want), name
    # 4 projections a layer (the mixer's two or q|k|v and o, gate|up, down; the DeltaNet's in_proj_qkv|z|b|a is
    # one) and the F32 head: all of LFM2's and Granite's layers' from the file's blocks, all of Qwen3.5's but 3
    # out_proj.
    formats = q8.model.decode_formats()
    assert (formats["q8_0"], sum(formats.values())) == ((13, 17) if case.arch == "qwen35" else (16, 17))
    if case.arch == "qwen35":
        mixer = q8.model.model.layers[0].linear_attn
        assert hasattr(mixer.in_proj_b, "gguf_blocks") and not hasattr(mixer.out_proj, "gguf_blocks")
    got, want = prefill_logits(q8.model, case.ids), case.logits
    error, spread = (got - want).abs(), want.max() - want.min()
    assert error.max() <= Q8_MAX * spread and error.mean() <= Q8_MEAN * spread
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= Q8_TOP
    steps = greedy_paged(q8.model, case.ids[:40], steps=6)
    assert steps == prefill_logits(q8.model, case.ids[:40] + steps).argmax(-1)[39:-1].tolist()


def test_mtp_blocks_are_left_unread(tmp_path) -> None:
    """A newer converter appends the checkpoint's MTP head as ``nextn_predict_layers`` blocks after the
    model's: the file loads as the one without them, its block_count less those."""
    hf = qwen35_model()
    plain = load_model(str(recurrent_to_gguf(hf, tmp_path / "plain.gguf", "qwen35")), dtype=torch.float32)
    with_mtp = load_model(str(recurrent_to_gguf(hf, tmp_path / "mtp.gguf", "qwen35", mtp=1)), dtype=torch.float32)
    assert GGUFFile(str(tmp_path / "mtp.gguf")).fields["qwen35.block_count"] == 5
    assert with_mtp.spec == plain.spec
    ids = list(range(3, 200, 2))
    assert torch.equal(prefill_logits(with_mtp.model, ids), prefill_logits(plain.model, ids))


def one_sentence(message: str) -> bool:
    return "\n" not in message and message.endswith(".") and ". " not in message


REFUSED = [  # (arch, what is changed: arch / kv / tensors / drop, what the sentence says)
    ("lfm2", dict(arch="lfm2moe"), "GGUF architecture 'lfm2moe': LFM2's mixture-of-experts variant is not supported"),
    ("qwen35", dict(arch="qwen3next"), "GGUF architecture 'qwen3next': Qwen3-Next has mixture-of-experts layers only"),
    ("qwen35", dict(arch="qwen35moe"), "Qwen3.5's mixture-of-experts variant is not supported"),
    ("lfm2", dict(tensors={"blk.0.shortconv.gate.weight": np.zeros((64, 64), np.float32)}),
     "GGUF tensor blk.0.shortconv.gate.weight has no place in this engine's lfm2 model"),
    ("qwen35", dict(tensors={"blk.0.ssm_dt_norm.weight": np.zeros(16, np.float32)}),
     "GGUF tensor blk.0.ssm_dt_norm.weight has no place in this engine's qwen3_5 model"),
    ("qwen35", dict(tensors={"blk.3.ssm_a": np.zeros(6, np.float32)}), "GGUF tensor blk.3.ssm_a has no place in the model"),
    ("lfm2", dict(drop=("token_embd_norm.weight",)), "the GGUF file lacks tensors for model.norm.weight"),
    ("qwen35", dict(drop=("blk.1.ssm_a",)), "the GGUF file lacks tensors for model.layers.1.linear_attn.A_log"),
    ("lfm2", dict(kv={"lfm2.attention.head_count_kv": [0, 0, 2, 4]}),
     "gives the attention layers different KV head counts"),
    ("qwen35", dict(kv={"qwen35.attention.head_count_kv": [0, 0, 1, 1]}),
     r"does not give 0 KV heads to exactly the recurrent layers \[0, 1, 2\]"),
    ("qwen35", dict(kv={"qwen35.full_attention_interval": 2}), r"GGUF tensor blk\.1\.\S+ has no place in the model"),
    ("qwen35", dict(kv={"qwen35.ssm.inner_size": 95}), "ssm.inner_size = 95 is not a multiple of the value heads"),
    ("qwen35", dict(kv={"qwen35.ssm.group_count": 4}), "the value heads a multiple of the key heads"),
    ("qwen35", dict(kv={"qwen35.nextn_predict_layers": 4}), "nextn_predict_layers = 4 leaves no layers"),
    ("granitehybrid", dict(kv={"granitehybrid.expert_count": 8}),
     "granitehybrid.expert_count = 8: Granite's mixture-of-experts models are not supported"),
    ("granitehybrid", dict(kv={"granitehybrid.ssm.inner_size": 126}), "126 is not a multiple of the Mamba2 heads"),
    ("granitehybrid", dict(drop=("blk.1.ssm_d",)), "the GGUF file lacks tensors for model.layers.1.mamba.D"),
    ("granitehybrid", dict(kv={"granitehybrid.attention.head_count_kv": [0, 2, 2, 0]}),
     r"does not give 0 KV heads to exactly the recurrent layers|GGUF tensor blk\.1\.\S+ has no place"),
]


@pytest.mark.parametrize("arch, change, says", REFUSED, ids=[f"{a}-{s[:40]}" for a, _, s in REFUSED])
def test_what_the_model_cannot_run_is_refused_in_one_sentence(arch, change, says, tmp_path) -> None:
    source = recurrent_to_gguf(ARCHS[arch](), tmp_path / "source.gguf", arch)
    path = rewrite_gguf(tmp_path / "changed.gguf", src=source, **change)
    with pytest.raises(ConfigError, match=says) as refused:  # (ModelFormatError; ModelSpecError for sizes)
        load_model(str(path), dtype=torch.float32)
    assert one_sentence(str(refused.value)), refused.value
