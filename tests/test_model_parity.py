"""Parity of our Llama-family model with transformers' implementation on tiny random weights.

transformers builds and randomizes the model and saves it as an HF directory; we load that
directory through our own HF loader, so config parsing, weight naming, RoPE (incl. Llama-3
scaling), GQA, q/k/v bias and tied heads are all checked against an independent implementation.
"""

from __future__ import annotations

import json

import pytest
import torch
from dense_forward import greedy_paged, prefill_logits

from hicache.config import PassPrecision
from hicache.model import load_model
from hicache.model.hf_loader import spec_from_hf_config
from hicache.model.tokenizer import byte_tokenizer

pytestmark = pytest.mark.model

transformers = pytest.importorskip("transformers")

# fp32 on both sides: observed max differences are <= 4e-7. Ignoring the Llama-3 scaling would
# give ~3e-3, so this tolerance does catch RoPE mistakes.
ATOL = 1e-5

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=256,
    eos_token_id=257,
)

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small on purpose: with head_dim 16 this puts wavelengths in all three bands (kept, blended, slowed).
    "original_max_position_embeddings": 64,
}

CASES = {
    "llama": ("llama", dict(rope_theta=10000.0)),
    "llama_tied": ("llama", dict(rope_theta=10000.0, tie_word_embeddings=True)),
    "llama3_rope_scaling": ("llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)),
    "qwen2_bias": ("qwen2", dict(rope_theta=1000000.0)),
    "qwen2_bias_tied": ("qwen2", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    # YaRN (Qwen2.5 / Qwen3 long context); a small original context puts pairs on both sides of the blend
    "qwen2_yarn": ("qwen2", dict(rope_theta=10000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                    "original_max_position_embeddings": 64})),
    # QK-norm, and heads wider than hidden / heads (q width 128 with hidden 64), as Qwen3's
    "qwen3_qk_norm": ("qwen3", dict(rope_theta=1000000.0, head_dim=32, tie_word_embeddings=True)),
    # Gemma 3: four norms a layer, GeGLU, QK-norm, scaled embeddings; 5 sliding layers (window 8, shorter than
    # the prompts) to 1 full, one KV head; the GGUF case keeps query_pre_attn_scalar = head_dim (llama.cpp's rule)
    "gemma3": ("gemma3", dict(num_hidden_layers=7, num_key_value_heads=1, head_dim=32, sliding_window=8,
                              query_pre_attn_scalar=32, pad_token_id=0)),
    "gemma3_attn_scalar": ("gemma3", dict(num_hidden_layers=6, head_dim=24, sliding_window=5,
                                          query_pre_attn_scalar=40, pad_token_id=0)),
    # Mistral's window over every layer
    "mistral_sliding_window": ("mistral", dict(rope_theta=10000.0, sliding_window=6)),
    # Phi-3: q/k/v and gate/up stored fused; its window over every layer (mini 4K: 2047)
    "phi3_fused": ("phi3", dict(rope_theta=10000.0, sliding_window=7, pad_token_id=0)),
}


def _hf_model(kind: str, extra: dict, seed: int = 1234):
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                                 "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                                 "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
                                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
                                 "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM)}[kind]
    model = model_class(config_class(**{**TINY, **extra}))
    # transformers zero-inits biases and one-inits norms; randomize everything so a loader
    # that drops or misplaces any tensor shows up as a mismatch.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.02 * noise)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(transformers model, our LoadedModel) on identical weights."""
    kind, extra = CASES[request.param]
    hf = _hf_model(kind, extra)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    tok = byte_tokenizer()
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": tok.chat_template})
    )
    ours = load_model(str(folder), dtype=torch.float32)
    return hf, ours


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _hf_greedy(hf, ids: list[int], steps: int) -> list[int]:
    seq = list(ids)
    for _ in range(steps):
        seq.append(int(_hf_logits(hf, seq)[-1].argmax()))
    return seq[len(ids):]


PROMPT = "The quick brown fox jumps over the lazy dog; 42 times!"


def test_prefill_logits_match_transformers(pair):
    hf, ours = pair
    ids = ours.tokenizer.encode(PROMPT)
    expected = _hf_logits(hf, ids)
    got = prefill_logits(ours.model, ids)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    # The comparison is meaningful only if logits actually vary between tokens and positions.
    assert expected.std() > 1e-2


def test_greedy_continuation_matches_transformers(pair):
    hf, ours = pair
    ids = ours.tokenizer.encode(ours.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}]))
    assert greedy_paged(ours.model, ids, steps=8) == _hf_greedy(hf, ids, steps=8)


def test_spec_from_transformers4_style_config():
    """Older config.json files keep rope_theta / rope_scaling at top level."""
    spec = spec_from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "vocab_size": 320,
            "rope_theta": 500000.0,
            "rope_scaling": {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64},
        }
    )
    assert spec.rope_theta == 500000.0 and spec.rope_scaling["type"] == "llama3"
    assert spec.head_dim == 16 and not spec.attention_bias and not spec.tie_word_embeddings


# ---- the same checkpoints as GGUF files (issue 47): the GGUF loader against transformers ----------------
GGUF_CASES = {"llama": "llama", "llama_tied": "llama", "qwen2_bias": "qwen2", "qwen2_bias_tied": "qwen2",
              "qwen2_yarn": "qwen2",
              "qwen3_qk_norm": "qwen3", "gemma3": "gemma3", "mistral_sliding_window": "llama", "phi3_fused": "phi3"}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_gguf_files_of_each_family_match_transformers(case, tmp_path):
    """Written as llama.cpp's converter writes the family (Llama's q/k rows interleaved, Qwen2's
    kept in HF order with their biases), loaded by hicache's GGUF loader: float32 logits equal
    transformers' on the same weights."""
    from hf_to_gguf import hf_to_gguf

    kind, extra = CASES[case]
    hf = _hf_model(kind, extra)
    path = hf_to_gguf(hf, tmp_path / f"{case}.gguf", GGUF_CASES[case], pre="qwen2" if kind != "llama" else "gpt-2")
    ours = load_model(str(path), dtype=torch.float32)
    assert ours.spec.attention_bias == (kind == "qwen2") and ours.spec.qk_norm == (kind in ("qwen3", "gemma3"))
    assert ours.spec.tie_word_embeddings == ("tied" in case or kind in ("qwen3", "gemma3"))
    assert ours.spec.sliding_window == (getattr(hf.config, "sliding_window", None) or 0)
    ids = list(range(5, 60, 3))
    torch.testing.assert_close(prefill_logits(ours.model, ids), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_a_gemma3_config_without_tie_word_embeddings_is_tied(tmp_path):
    """Gemma 3's published config.json files leave tie_word_embeddings out (transformers' default for the
    family is True) and their checkpoints hold no lm_head: the family's default applies."""
    hf = _hf_model("gemma3", CASES["gemma3"][1])
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    byte_tokenizer().backend.save(str(tmp_path / "tokenizer.json"))
    ours = load_model(str(tmp_path), dtype=torch.float32)
    assert ours.spec.tie_word_embeddings
    ids = list(range(5, 60, 3))
    torch.testing.assert_close(prefill_logits(ours.model, ids), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_fused_phi3_tensors_split_into_their_parts_blocks_and_all(tmp_path):
    """A Q8_0 Phi-3 file: attn_qkv's and ffn_up's block rows are split into q/k/v and gate/up (blocks are
    per row); decode steps read those blocks and give the logits the dequantized weights give."""
    from hf_to_gguf import hf_to_gguf

    path = hf_to_gguf(_hf_model("phi3", CASES["phi3_fused"][1]), tmp_path / "phi3.gguf", "phi3", q8_0=True)
    ours = load_model(str(path), dtype=torch.float32, precision=PassPrecision(decode_activations="float32"))
    assert ours.model.decode_formats() == {"q8_0": 4 * ours.spec.num_layers, "same": 1}  # the F32 head: as loaded
    attn = ours.model.model.layers[0].self_attn
    assert [attn.q_proj.gguf_blocks.out_features, attn.v_proj.gguf_blocks.out_features] == [64, 32]
    ids = list(range(5, 40, 3))
    steps = greedy_paged(ours.model, ids, steps=6)
    full = prefill_logits(ours.model, ids + steps).argmax(-1)[len(ids) - 1:-1].tolist()
    assert steps == full


@pytest.mark.multirank
@pytest.mark.parallel
def test_gemma3_gguf_runs_alike_on_tp2_and_pp2(tmp_path, checker):
    """Gemma 3 (QK-norm weights per head width, whole on every TP rank; its one KV head held by both
    TP ranks; four norms a layer after the TP sums; sliding layers and their own RoPE on every
    pipeline stage). Greedy outputs of one rank, TP2 and PP2 are the same, the consensus checker on."""
    from hf_to_gguf import hf_to_gguf

    from hicache import Engine, SamplingParams

    path = hf_to_gguf(_hf_model("gemma3", CASES["gemma3"][1]), tmp_path / "g3.gguf", "gemma3", pre="qwen2")
    outputs = []
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        engine = Engine(str(path), dtype="float32", max_total_tokens=2048, tp_size=tp, pp_size=pp)
        try:
            outputs.append([r.output_ids for r in engine.generate(
                [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 7], SamplingParams(max_new_tokens=12, temperature=0))])
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1] == outputs[2]
