"""The bytes each token id stands for, and which ids are special: the table a grammar engine
(llguidance) matches text against, read from our tokenizer so that the two agree.

Invariants (what :func:`token_table` returns, one entry per id below ``vocab_size``):

- a vocabulary token is its text as bytes: byte-level BPE spells each byte with one character of
  GPT-2's alphabet (:func:`~hicache.model.tokenizer.bytes_to_unicode`); SentencePiece writes
  spaces as ``▁`` (or what the decoder's ``Replace`` names) and bytes as ``<0xNN>``;
- an added token is its content as written; it is *special* exactly when the tokenizer treats it
  as special (a GGUF control token, ``"special": true`` in a ``tokenizer.json``). A user-defined
  token (``<tool_call>`` on Qwen2.5, ``<think>``) is text the tokenizer matches whole, so a grammar
  literal ``"<tool_call>"`` allows that one token. (llguidance's own reader makes every added token
  that looks like ``<...>`` special, which no text literal can ever match.)
- an id past the tokenizer's vocabulary (an embedding padded to a round size) is empty: no grammar
  allows it; a vocabulary token spelled outside the byte alphabet (a converter's mislabel) too.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from tokenizers import Tokenizer as HFTokenizer

from hicache.model.tokenizer import bytes_to_unicode


class TokenTable(NamedTuple):
    """``tokens[i]``: the bytes id ``i`` stands for (``b""``: never allowed); ``special``: sorted ids
    of special tokens (a grammar names them, text never spells them)."""

    tokens: list[bytes]
    special: list[int]


def token_table(tokenizer: HFTokenizer, vocab_size: int) -> TokenTable:
    """The table of ``tokenizer`` padded to ``vocab_size`` ids; ValueError when its decoder says
    neither byte-level nor byte-fallback (how its tokens spell bytes is then unknown)."""
    # The decoder's own JSON (its pickled state): parsing the whole tokenizer's costs ~1.5 s on a 262K vocabulary.
    decoder = tokenizer.decoder
    byte_level, space = _spelling(json.loads(decoder.__getstate__()) if decoder is not None else None)
    alphabet = {c: b for b, c in bytes_to_unicode().items()}
    added = tokenizer.get_added_tokens_decoder()
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    tokens: list[bytes] = []
    for i in range(min(size, vocab_size)):
        name = tokenizer.id_to_token(i) or ""
        if i in added:
            tokens.append(added[i].content.encode())
        elif byte_level:
            tokens.append(bytes(alphabet[c] for c in name) if all(c in alphabet for c in name) else b"")
        elif len(name) == 6 and name.startswith("<0x") and name.endswith(">"):
            tokens.append(bytes([int(name[3:5], 16)]))
        else:
            tokens.append(name.replace(space, " ").encode())
    tokens += [b""] * (vocab_size - len(tokens))
    return TokenTable(tokens, sorted(i for i, t in added.items() if t.special and i < vocab_size))


def _spelling(decoder: dict | None) -> tuple[bool, str]:
    """(byte-level?, the character SentencePiece writes for a space) from a decoder's JSON."""
    steps = (decoder or {}).get("decoders", [decoder] if decoder else [])
    kinds = {step.get("type") for step in steps}
    space = next((step["pattern"].get("String") for step in steps
                  if step.get("type") == "Replace" and step.get("content") == " "
                  and len(step.get("pattern", {}).get("String") or "") == 1), "\u2581")
    if "ByteLevel" in kinds:
        return True, space
    if "ByteFallback" in kinds:
        return False, space
    raise ValueError(f"the tokenizer's decoder ({', '.join(sorted(map(str, kinds))) or 'none'}) is neither "
                     "byte-level nor byte-fallback: the bytes of its tokens are unknown to the grammar engine")
