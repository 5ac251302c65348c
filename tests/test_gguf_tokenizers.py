"""Tokenizers from GGUF metadata (issue 47): SentencePiece (``llama``) and byte-level BPE with each
family's pre-tokenizer. The vocabularies are small and synthetic (the families' real ones cannot be
fetched here), trained with the ``tokenizers`` library over each family's real split rules; the
file is written by the ``gguf`` package. Our tokenizer must give the source tokenizer's tokens on a
fixed corpus (unicode, digits, whitespace runs, code, chat markup), and transformers' GGUF
conversion of the same file must agree with it."""

from __future__ import annotations

import json

import pytest
from gguf_edit import rewrite_gguf
from gguf_references import transformers_tokenizer
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.implementations import SentencePieceBPETokenizer

from hicache.model.errors import ModelFormatError
from hicache.model.gguf_file import GGUFFile
from hicache.model.gguf_loader import load_gguf_tokenizer
from hicache.model.gguf_tokenizer import tokenizer_from_gguf

pytestmark = pytest.mark.model

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog 12345 times.",
    "def f(x):\n    return x ** 2  # squares\n\n\tprint('ok')\r\n",
    "Ünïcödé naïve café \u2014 東京 🙂 ñ; I'm sure you'll see it's done.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "   leading spaces and   runs    of spaces   ",
    "numbers 3.14159 and 1,000,000 and 2026-12-04 and 0x7fff",
]
MARKS = "नमस्ते दुनिया, कैसे हैं आप? cafe\u0301 re\u0301sume\u0301"  # combining marks (Qwen3.5's split keeps them)
TEXTS = CORPUS + ["", " ", "a", "  two", "x\n\ny", "tab\tsep", "1234567", "HELLO World"]
# The families' split rules as their own tokenizer.json files state them (Meta's Llama 3, Qwen2).
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's tokenizer.json: Qwen2's with combining marks (\p{M}) in the letter runs (llama.cpp's "qwen35").
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_byte_level(split: str | None, corpus: list[str] = CORPUS) -> Tokenizer:
    """A byte-level BPE trained on ``corpus`` over ``split`` (None: GPT-2's regex), specials first."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    tok.pre_tokenizer = byte_level if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 30, trainer)
    return tok


def byte_level_fields(tok: Tokenizer, pre: str) -> dict:
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens], "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": False,
            "tokenizer.ggml.scores": None, "tokenizer.chat_template": None,
            "tokenizer.ggml.padding_token_id": None, "tokenizer.ggml.unknown_token_id": None}  # (the source file's)


def train_sentencepiece() -> tuple[SentencePieceBPETokenizer, dict]:
    """A SentencePiece-style BPE and the GGUF fields llama.cpp's converter writes for one: unknown,
    BOS, EOS, the 256 byte tokens, then the pieces in merge order with falling scores, no merges."""
    spm = SentencePieceBPETokenizer()
    spm.train_from_iterator(CORPUS * 30, vocab_size=420, min_frequency=1, special_tokens=["<unk>", "<s>", "</s>"],
                            show_progress=False)
    pieces = [t for t, _ in sorted(spm.get_vocab().items(), key=lambda kv: kv[1])][3:]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": None, "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
              "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
              "tokenizer.ggml.merges": None, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
              "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True,
              "tokenizer.ggml.add_space_prefix": True, "tokenizer.chat_template": None,
              "tokenizer.ggml.padding_token_id": None}
    return spm, fields


@pytest.mark.parametrize("pre, split", [("llama-bpe", LLAMA3), ("qwen2", QWEN2), ("gpt-2", None)])
def test_byte_level_bpe_splits_as_its_family(tmp_path, pre, split) -> None:
    source = train_byte_level(split)
    path = rewrite_gguf(tmp_path / "bpe.gguf", kv=byte_level_fields(source, pre))
    ours, theirs = load_gguf_tokenizer(path), transformers_tokenizer(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == source.encode(text, add_special_tokens=False).ids, text
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", ""), text
    assert ours.encode("<|im_end|>") == [2] and ours.eos_token_ids == {2}  # control tokens stay whole


@pytest.mark.parametrize("pre, split", [("lfm2", LLAMA3), ("qwen35", QWEN35)])
def test_recurrent_families_pre_tokenizers_split_as_their_hf_tokenizer(tmp_path, pre, split) -> None:
    """LFM2's files (``lfm2``: llama.cpp splits them as Llama 3's) and Qwen3.5's (``qwen35``): the tokens
    of the HF tokenizer trained over the family's split; LFM2's add BOS where the file does not say (as
    llama.cpp does for it)."""
    source = train_byte_level(split, CORPUS + [MARKS])
    ours = load_gguf_tokenizer(rewrite_gguf(tmp_path / "bpe.gguf", kv=byte_level_fields(source, pre)))
    for text in TEXTS + [MARKS]:
        ids = ours.encode(text)
        assert ids == source.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", ""), text
    unsaid = load_gguf_tokenizer(rewrite_gguf(tmp_path / "unsaid.gguf", kv={
        **byte_level_fields(source, pre), "tokenizer.ggml.add_bos_token": None}))
    assert unsaid.add_bos == (pre == "lfm2")


def test_qwen35_keeps_combining_marks_in_words(tmp_path) -> None:
    """The same vocabulary under Qwen2's split cuts a word at each combining mark; under ``qwen35`` the
    merges learned across the marks apply (fewer tokens)."""
    fields = byte_level_fields(train_byte_level(QWEN35, CORPUS + [MARKS]), "qwen35")
    qwen35 = load_gguf_tokenizer(rewrite_gguf(tmp_path / "qwen35.gguf", kv=fields))
    qwen2 = load_gguf_tokenizer(rewrite_gguf(tmp_path / "qwen2.gguf", kv={**fields, "tokenizer.ggml.pre": "qwen2"}))
    for word in (" नमस्ते", " cafe\u0301"):
        assert len(qwen35.encode(word)) < len(qwen2.encode(word)), word


def test_smollm_digits_are_split_one_by_one(tmp_path) -> None:
    """SmolLM's pre-tokenizer (``smollm``): each digit alone, then GPT-2's regex."""
    source = train_byte_level(None)  # learned "12345" whole, as in the corpus
    smollm = load_gguf_tokenizer(rewrite_gguf(tmp_path / "smollm.gguf", kv=byte_level_fields(source, "smollm")))
    gpt2 = load_gguf_tokenizer(rewrite_gguf(tmp_path / "gpt2.gguf", kv=byte_level_fields(source, "gpt-2")))
    assert [smollm.decode([i]) for i in smollm.encode(" 12345")] == [" ", "1", "2", "3", "4", "5"]
    assert len(gpt2.encode(" 12345")) < 6


def test_sentencepiece_with_byte_fallback_and_recovered_merges(tmp_path) -> None:
    spm, fields = train_sentencepiece()
    path = rewrite_gguf(tmp_path / "spm.gguf", kv=fields)
    ours, theirs = load_gguf_tokenizer(path), transformers_tokenizer(path)
    assert ours.add_bos and ours.bos_token_id == 1
    disagree = []
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids[0] == 1 and ours.decode(ids) == text, text  # BOS first; spaces come back
        source = spm.encode(text).tokens
        if text[:1] != " " and "<unk>" not in source:  # (a leading space: below; the source has no byte fallback)
            assert [ours.backend.id_to_token(i) for i in ids[1:]] == source, text
            if ids != theirs.encode(text):
                disagree.append(text)
    assert not disagree, disagree
    # llama.cpp's rule: a space is prefixed to a text that starts with one too, and after a special token
    space = ours.backend.token_to_id("\u2581")
    assert ours.encode(" the quick")[1:] == [space] + ours.encode("the quick")[1:]
    assert ours.backend.id_to_token(ours.encode("</s>hello")[2])[0] == "\u2581"
    unknown = "\U0001f680"  # not in the vocabulary: byte fallback, never <unk>
    assert ours.decode(ours.encode(unknown)) == unknown and 0 not in ours.encode(unknown)


def test_gemma_sentencepiece_files_merge_in_file_order_and_spell_spaces(tmp_path) -> None:
    """Gemma files list no merges, their scores do not follow the merge order (the file order does),
    tokens of several spaces are written with real spaces, and no space is prefixed."""
    spm, fields = train_sentencepiece()
    tokens = fields["tokenizer.ggml.tokens"]
    fields = {**fields, "tokenizer.ggml.add_space_prefix": False,
              "tokenizer.ggml.scores": [0.0] * len(tokens),  # useless as a merge order
              "tokenizer.ggml.tokens": tokens + ["  ", "   "], "tokenizer.ggml.token_type": fields[
                  "tokenizer.ggml.token_type"] + [1, 1]}
    fields["tokenizer.ggml.scores"] += [0.0, 0.0]
    path = rewrite_gguf(tmp_path / "gemma.gguf", kv=fields, arch="gemma3")
    # (until the gemma3 architecture loads, its tokenizer is built from the file's fields directly)
    ours, theirs = tokenizer_from_gguf(GGUFFile(path).fields, "gemma3"), transformers_tokenizer(path)
    for text in ("Hello world", "a   b", "def f(x):\n    return x"):
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    assert ours.backend.id_to_token(ours.encode("a   b")[2]) == "\u2581\u2581\u2581"  # the three-space token, whole


@pytest.mark.parametrize("change, says", [
    ({"tokenizer.ggml.pre": "tekken"}, "GGUF pre-tokenizer 'tekken' is not supported"),
    ({"tokenizer.ggml.model": "t5"}, "GGUF tokenizer model 't5' is not supported"),
])
def test_what_is_not_built_is_refused_naming_it(tmp_path, change, says) -> None:
    with pytest.raises(ModelFormatError, match=says):
        load_gguf_tokenizer(rewrite_gguf(tmp_path / "t.gguf", kv=change))
