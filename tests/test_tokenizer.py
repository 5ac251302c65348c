"""Tokenizers: SmolLM2's (built from the GGUF vocabulary) and the random models' byte tokenizer."""

from __future__ import annotations

import pytest
from gguf_references import packaged_transformers_tokenizer

from hicache.model.gguf_loader import load_gguf_tokenizer
from hicache.model.packaged import packaged_model_path
from hicache.model.tokenizer import byte_tokenizer

pytestmark = pytest.mark.model

SAMPLES = [
    "Hello, world!",
    "The year 2024 had 366 days; pi is 3.14159.",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🙂🚀",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(12))",
    "lots   of    spaces\n\n\n  and\ttabs \t\t end   ",
    "",
]

# Verified against transformers' GGUF tokenizer (test below) and by reasoning: its GPT-2
# pre-tokenizer does not split digits the way SmolLM2's does, but the vocabulary has no merge
# involving an ASCII digit, so every digit is its own token either way ('0'..'9' = ids 32..41,
# 216 = 'Ġ', a lone space).
FIXED = {
    "abc 123 4567": [25276, 216, 33, 34, 35, 216, 36, 37, 38, 39],
    "Hello world": [19556, 905],
}


@pytest.fixture(scope="module")
def smol():
    return load_gguf_tokenizer(packaged_model_path("smollm2"))


@pytest.mark.parametrize("text", SAMPLES)
def test_smollm2_round_trip(smol, text):
    assert smol.decode(smol.encode(text)) == text


def test_smollm2_fixed_ids(smol):
    for text, ids in FIXED.items():
        assert smol.encode(text) == ids


def test_no_merge_touches_a_digit(smol):
    vocab = smol.backend.get_vocab()
    assert all(not (any(c.isdigit() for c in tok) and len(tok) > 1) for tok in vocab if tok.isascii())


def test_smollm2_specials_and_ids(smol):
    assert smol.bos_token_id == 1 and not smol.add_bos
    assert smol.eos_token_ids == {2} and smol.backend.id_to_token(2) == "<|im_end|>"
    assert smol.vocab_size == 49152
    assert smol.encode("<|im_start|>user\nhi<|im_end|>")[:1] == [1]
    assert smol.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2
    assert smol.decode([1, 19556, 2]) == "Hello"
    assert smol.decode([1, 19556, 2], skip_special_tokens=False) == "<|im_start|>Hello<|im_end|>"


def test_smollm2_chat_template(smol):
    text = smol.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = smol.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], add_generation_prompt=False
    )
    assert no_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


@pytest.mark.slow  # builds transformers' tokenizer from the GGUF file (~6 s)
def test_smollm2_matches_transformers_gguf_tokenizer(smol):
    ref = packaged_transformers_tokenizer("smollm2")
    for text in SAMPLES + list(FIXED) + ["<|im_start|>assistant\nSure!<|im_end|>"]:
        assert smol.encode(text) == ref.encode(text, add_special_tokens=False), text


def test_byte_tokenizer():
    tok = byte_tokenizer()
    assert tok.vocab_size == 260
    text = "héllo 🙂 <|im_start|>"
    ids = tok.encode(text)
    assert ids[:2] == [ord("h"), 0xC3] and ids[-1] == 258
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "héllo 🙂 "
    assert tok.eos_token_ids == {257, 259}
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
