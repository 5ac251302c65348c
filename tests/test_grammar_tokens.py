"""The grammar engine's token table agrees with the tokenizer (issue 57, item 2): on every added
token of the shipped models, llguidance sees the bytes and the special flag our tokenizer gives it,
so a grammar literal ``"<tool_call>"`` allows Qwen2.5's single token 151657 (the token the model
writes, and the one our tokenizer encodes the text to); on the rest of the vocabulary the table
equals llguidance's own reading of the tokenizer. And the tokenizer stays equal to transformers'
conversion of each file on text that contains the added tokens."""

from __future__ import annotations

import json
from functools import lru_cache

import llguidance
import numpy as np
import pytest
from gguf_references import packaged_transformers_tokenizer

from hicache.model.errors import ModelNotFoundError
from hicache.model.gguf_loader import load_gguf_tokenizer
from hicache.model.packaged import packaged_model_path
from hicache.model.tokenizer import Tokenizer
from hicache.runtime.grammar_vet import tokenizer_config
from hicache.runtime.grammar_worker import ll_tokenizer

pytestmark = pytest.mark.model
SHIPPED = ["smollm2", pytest.param("gemma3-270m", marks=pytest.mark.slow),
           pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow)]


@lru_cache(maxsize=None)  # (each model's tables once: the tests take them in turns)
def shipped(name: str) -> tuple[Tokenizer, dict, object]:
    """(our tokenizer, its llguidance config, llguidance's tokenizer over our table)."""
    try:
        tokenizer = load_gguf_tokenizer(packaged_model_path(name))
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    config = tokenizer_config(tokenizer, tokenizer.vocab_size)
    backend = tokenizer.backend
    return tokenizer, config, ll_tokenizer(llguidance, config, lambda t: backend.encode(t, add_special_tokens=False).ids)


def allowed(lltok, grammar: str, vocab_size: int) -> set[int]:
    """The first tokens a Lark grammar allows."""
    matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", grammar))
    assert not matcher.is_error(), matcher.get_error()
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return {int(i) for i in np.flatnonzero(bits[:vocab_size])}


@pytest.mark.parametrize("name", SHIPPED)
def test_every_added_token_has_the_tokenizers_bytes_and_special_flag(name):
    tokenizer, config, ours = shipped(name)
    backend = tokenizer.backend
    added = backend.get_added_tokens_decoder()
    assert added
    for i, token in added.items():
        assert ours.decode_bytes([i]) == token.content.encode(), token.content
        assert ours.is_special_token(i) == token.special, token.content
        assert backend.encode(token.content, add_special_tokens=False).ids == [i], token.content
        if not token.special:  # text the tokenizer matches whole: llguidance encodes it so too
            assert ours.tokenize_str(token.content) == [i], token.content
    # The rest of the vocabulary: as llguidance reads the tokenizer's JSON itself.
    theirs = llguidance.LLTokenizer(config["tokenizer"], n_vocab=config["vocab_size"])
    plain = [i for i in range(tokenizer.vocab_size) if i not in added]
    assert [ours.decode_bytes([i]) for i in plain] == [theirs.decode_bytes([i]) for i in plain]


@pytest.mark.slow
def test_a_tool_call_literal_allows_qwens_single_token():
    """Where llguidance's own reader makes ``<tool_call>`` (user-defined) special, its mask offered
    the token but consuming it failed ("token [151657] doesn't satisfy the grammar"): every forced
    call on Qwen2.5 was refused."""
    tokenizer, config, ours = shipped("qwen2.5-coder-0.5b")
    call = tokenizer.backend.token_to_id("<tool_call>")
    written = tokenizer.encode('<tool_call>\n{"x": 1}\n</tool_call>')
    assert call == 151657 and written[:2] == [151657, 198] and written[-1] == 151658
    grammar = 'start: "<tool_call>\\n" %json {"type": "object"} "\\n</tool_call>"'
    assert allowed(ours, grammar, tokenizer.vocab_size) == {call}  # forced text: its first token, as we encode it
    matcher = llguidance.LLMatcher(ours, llguidance.grammar_from("lark", grammar))
    assert matcher.consume_tokens(written) and matcher.is_accepting()
    theirs = llguidance.LLTokenizer(config["tokenizer"], n_vocab=config["vocab_size"])
    matcher = llguidance.LLMatcher(theirs, llguidance.grammar_from("lark", grammar), log_level=0)
    assert not matcher.consume_tokens(written)  # the bug this table fixes
    assert "doesn't satisfy the grammar" in matcher.get_error()


def added_texts(tokenizer: Tokenizer) -> list[str]:
    """Strings that contain every added token once, between words, spaces and newlines."""
    added = sorted(tokenizer.backend.get_added_tokens_decoder().items())
    return [f"say {t.content}hi {t.content} x\n{t.content}\n" for _, t in added]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "qwen2.5-coder-0.5b"])
def test_the_tokenizer_equals_transformers_on_text_with_added_tokens(name):
    """transformers' conversion of the GGUF file (Gemma 3's: tests/test_gemma3.py, whose corpus
    holds its control tokens; its thousands of user-defined whitespace and markup tokens are
    matched longest-first, as llama.cpp does, where transformers' conversion differs)."""
    tokenizer = shipped(name)[0]
    theirs = packaged_transformers_tokenizer(name)
    texts = added_texts(tokenizer) + [json.dumps({"name": "f", "arguments": {"x": 1}})]
    for text in texts:
        assert tokenizer.encode(text) == theirs.encode(text, add_special_tokens=False), text
