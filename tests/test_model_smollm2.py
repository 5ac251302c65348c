"""The embedded SmolLM2-135M-Instruct: parity with transformers loading the same GGUF (which
checks dequantization and the undoing of llama.cpp's q/k row permutation), and sane output."""

from __future__ import annotations

import pytest
import torch
from dense_forward import greedy_paged, prefill_logits
from gguf_references import fast_gguf_reading

from hicache.model.packaged import packaged_model_path

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def smol(smollm2_reference):
    """``load_model("smollm2", dtype=torch.float32)``: the session's reference engine's copy."""
    return smollm2_reference.loaded


@pytest.fixture(scope="module")
def hf_smol():
    transformers = pytest.importorskip("transformers")
    # transformers refuses GGUF checkpoints without accelerate installed.
    pytest.importorskip("accelerate")
    path = packaged_model_path("smollm2")
    # gguf_references: the header parsed once, over a plain array, and the tensor-name table built once
    # (~12 s of its ~21 s of CPU with gguf's reader as is); transformers still dequantizes and
    # un-permutes every tensor its own way.
    with fast_gguf_reading():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
    return model.eval()


def test_spec(smol):
    s = smol.spec
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim) == (30, 576, 9, 3, 64)
    assert (s.intermediate_size, s.vocab_size, s.rope_theta, s.tie_word_embeddings) == (1536, 49152, 100000.0, True)
    assert smol.model.lm_head is None


def test_logits_match_transformers_gguf(smol, hf_smol):
    ids = smol.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    with torch.no_grad():
        expected = hf_smol(torch.tensor([ids])).logits[0].float()
    got = prefill_logits(smol.model, ids)
    # Same dequantized weights, fp32 on both sides: observed max difference is 4e-5 on logits of
    # magnitude ~28. Leaving llama.cpp's q/k row order in place gives differences of ~23.
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_greedy_chat_is_sensible_english(smol):
    tok = smol.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = greedy_paged(smol.model, tok.encode(prompt), steps=16, stop_ids=tok.eos_token_ids)
    text = tok.decode(out)
    assert text.startswith("The capital of France is Paris"), text
    assert out[-1] in tok.eos_token_ids  # the answer ends its turn
