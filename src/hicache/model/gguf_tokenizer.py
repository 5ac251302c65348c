"""Tokenizers from a GGUF file's metadata (``tokenizer.ggml.*``), built with the ``tokenizers``
library -- what llama.cpp's own tokenizer does with the same arrays:

- ``gpt2``: byte-level BPE. The vocabulary is spelled in GPT-2's byte alphabet and the file lists
  the merges; ``tokenizer.ggml.pre`` names the split the merges were learned over
  (:data:`PRE_TOKENIZERS`): GPT-2's own regex, each digit alone then GPT-2's (SmolLM, StarCoder),
  Llama 3's (digits in runs of up to three; LFM2's ``lfm2`` too, as llama.cpp maps it), Qwen2's
  (digits one by one), Qwen3.5's (``qwen35``: Qwen2's with combining marks, ``\\p{M}``, kept with the
  letters they mark). An unknown name is refused. Where the file does not say
  (``tokenizer.ggml.add_bos_token``), BOS is added for the names llama.cpp adds it for (Llama 3's and
  LFM2's).
- ``llama``: SentencePiece BPE with byte fallback (``<0x0A>``-style byte tokens). Spaces are
  written ``▁``; ``tokenizer.ggml.add_space_prefix`` (default on) puts one before each stretch of
  text that starts the input or follows a special token, as llama.cpp does (transformers' GGUF
  conversion prefixes only the input's start, and not a text that starts with a space). Merges come from the file, or are
  recovered from the vocabulary when it lists none: every way to cut a token into two tokens of
  the vocabulary, best-ranked merged token first -- ranked by score, except for Gemma, whose
  scores do not follow its merge order (the order of the tokens in the file does); Gemma files
  also spell tokens of several spaces with real spaces, which SentencePiece looks up as ``▁``s.

Token types (``tokenizer.ggml.token_type``): control tokens (3) become special added tokens,
user-defined ones (4, e.g. ``<think>``) plain added tokens, so neither is cut into pieces.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers

from hicache.model.errors import ModelFormatError, quoted
from hicache.model.sampling_defaults import from_gguf
from hicache.model.tokenizer import Tokenizer, byte_level_bpe, bytes_to_unicode

# The splits BPE vocabularies were learned over, by their ``tokenizer.ggml.pre`` name. None: GPT-2's
# own regex (ByteLevel's); "digits": each digit alone, then GPT-2's.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # Llama 3's, digits one by one
# Qwen3.5's: Qwen2's, a letter run taking the combining marks in it (Devanagari's vowel signs, a
# decomposed accent), and a run of other symbols not starting at one
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, str | None] = {
    "default": None, "gpt2": None, "gpt-2": None,
    "smollm": "digits", "starcoder": "digits", "refact": "digits",
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "lfm2": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "qwen35": _QWEN35_SPLIT,
}
BOS_BY_DEFAULT = frozenset({"llama3", "llama-v3", "llama-bpe", "lfm2"})  # llama.cpp adds BOS where a file says nothing
TOKENIZER_MODELS = ("gpt2", "llama")
# GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
CONTROL, USER_DEFINED = 3, 4
SPACE = "\u2581"  # SentencePiece's space
MERGE_ORDER_BY_POSITION = {"gemma", "gemma2", "gemma3"}  # SentencePiece files whose scores are not the merge order
# Work recovering merges is the sum of the tokens' squared lengths (every cut of every token): Gemma 3's
# 262K tokens make 10.8M; a hostile vocabulary of long tokens is refused rather than worked through for hours.
MAX_MERGE_WORK = 1 << 27


def tokenizer_from_gguf(fields: Mapping[str, Any], architecture: str) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes; ModelFormatError naming what is not supported."""
    kind = fields.get("tokenizer.ggml.model")
    tokens = list(fields.get("tokenizer.ggml.tokens") or ())
    if not tokens:
        raise ModelFormatError("the GGUF file has no tokenizer.ggml.tokens.")
    types = [int(t) for t in fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)]
    if kind == "gpt2":
        pre = fields.get("tokenizer.ggml.pre", "default")
        backend = _byte_level(tokens, fields.get("tokenizer.ggml.merges") or [], pre)
        add_bos_default = pre in BOS_BY_DEFAULT
    elif kind == "llama":
        backend = _sentencepiece(tokens, types, fields, architecture)
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    else:
        raise ModelFormatError(f"GGUF tokenizer model {quoted(kind)} is not supported; supported: {', '.join(TOKENIZER_MODELS)}.")
    _add_special_tokens(backend, tokens, types, byte_level=kind == "gpt2")
    bos = fields.get("tokenizer.ggml.bos_token_id")
    eos = {int(fields["tokenizer.ggml.eos_token_id"])} if "tokenizer.ggml.eos_token_id" in fields else set()
    # chat models end a turn there
    eos |= {backend.token_to_id(end) for end in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")} - {None}
    return Tokenizer(backend, bos_token_id=None if bos is None else int(bos), eos_token_ids=eos,
                     add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                     chat_template=fields.get("tokenizer.chat_template"), sampling_defaults=from_gguf(fields))


def _byte_level(tokens: Sequence[str], merges: Sequence[str], pre: str) -> HFTokenizer:
    if pre not in PRE_TOKENIZERS:
        raise ModelFormatError(f"GGUF pre-tokenizer {quoted(pre)} is not supported; supported: "
                               f"{', '.join(sorted(PRE_TOKENIZERS))}.")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    return byte_level_bpe({tok: i for i, tok in enumerate(tokens)}, pairs, PRE_TOKENIZERS[pre])  # type: ignore[arg-type]


def _sentencepiece(tokens: Sequence[str], types: Sequence[int], fields: Mapping[str, Any],
                   architecture: str) -> HFTokenizer:
    by_position = architecture in MERGE_ORDER_BY_POSITION
    if by_position:  # "  " is "▁▁" to SentencePiece; a user-defined one is matched in the raw text, as written
        tokens = [SPACE * len(t) if t and not t.strip(" ") and ty != USER_DEFINED else t
                  for t, ty in zip(tokens, types)]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = fields.get("tokenizer.ggml.merges")
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        scores = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        rank = {tok: -i if by_position else float(s) for i, (tok, s) in enumerate(zip(tokens, scores))}
        pairs = recover_merges(vocab, rank)
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=None if unk is None else tokens[int(unk)],
                                 fuse_unk=True, byte_fallback=True))
    # llama.cpp: a space before every stretch of text that starts the input or follows a special token
    # (even one that starts with a space); spaces written as "▁". The normalizer does just that:
    # it runs on each stretch between added tokens.
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend(SPACE)] if prefix else [])
                                          + [normalizers.Replace(" ", SPACE)])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def recover_merges(vocab: Mapping[str, int], rank: Mapping[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every cut of a token into two tokens of the
    vocabulary, the best-ranked merged token first, then by the pieces' ids (a stable order)."""
    work = sum(len(token) ** 2 for token in vocab)
    if work > MAX_MERGE_WORK:
        raise ModelFormatError(f"the GGUF vocabulary's tokens are too long to recover merges from (the sum of their "
                               f"squared lengths is {work}, more than {MAX_MERGE_WORK}).")
    found: list[tuple[float, int, int, str, str]] = []
    for token in vocab:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-rank[token], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def _add_special_tokens(tok: HFTokenizer, tokens: Sequence[str], types: Sequence[int], byte_level: bool) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens (matched whole,
    as llama.cpp does). A byte-level vocabulary spells every real token in its byte alphabet: one
    marked control outside it is a converter's mislabel, left alone (it would grow the vocabulary)."""
    alphabet = set(bytes_to_unicode().values())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                            if ty == CONTROL and (not byte_level or set(t) <= alphabet)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
