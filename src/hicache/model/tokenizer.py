"""Text <-> token ids and chat prompts, over a ``tokenizers.Tokenizer``.

Builders here make byte-level BPE tokenizers (a GGUF file's: model/gguf_tokenizer.py) and a tiny
one for random test models; an HF ``tokenizer.json`` is loaded as-is by :func:`load_hf_tokenizer`.
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from hicache.errors import ConfigError, InvalidRequestError
from hicache.model.chat_render import MIN_RENDER_CHARS, ChatTemplateError, compile_chat_template, render
from hicache.model.chat_templates import BUILTIN, CHATML
from hicache.model.errors import cut
from hicache.model.sampling_defaults import from_generation_config


class Tokenizer:
    """Encode/decode plus the ids an engine needs (BOS, the set of stop tokens) and chat rendering.

    ``encode`` adds no special tokens, except a leading BOS when ``add_bos`` (the model was trained
    with one) and the text does not already start with it (chat templates often write it).

    Chats render within limits (model/chat_render.py): ``render_chars`` characters of output
    (:meth:`with_render_limit`; the engine's: per token of its context). A template that does not
    compile leaves completions working; chats are refused, naming why.
    """

    def __init__(self, tokenizer: HFTokenizer, *, bos_token_id: int | None, eos_token_ids: Iterable[int],
                 add_bos: bool = False, chat_template: str | None = None,
                 sampling_defaults: Mapping[str, float] | None = None) -> None:
        self.backend = tokenizer  # the wrapped ``tokenizers.Tokenizer``
        # the model's recommended sampling (model/sampling_defaults.py), read with its chat template
        self.sampling_defaults: dict[str, float] = dict(sampling_defaults or {})
        self.bos_token_id = bos_token_id
        self.eos_token_ids: set[int] = {int(i) for i in eos_token_ids}
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template  # None: the model has none (a base model): chats are refused
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self.render_chars = MIN_RENDER_CHARS
        self._template, self._template_error = None, None
        try:
            self._template = None if chat_template is None else compile_chat_template(chat_template)
        except Exception as e:  # a syntax error, a source too long, nesting past the parser's recursion
            self._template_error = cut(str(e) or type(e).__name__).rstrip(".")

    def with_chat_template(self, template: str) -> "Tokenizer":
        """This tokenizer (sharing its backend) rendering chats with ``template`` instead; ConfigError
        when it does not compile."""
        other = Tokenizer(self.backend, bos_token_id=self.bos_token_id, eos_token_ids=self.eos_token_ids,
                          add_bos=self.add_bos, chat_template=template,
                          sampling_defaults=self.sampling_defaults).with_render_limit(self.render_chars)
        if other._template_error:
            raise ConfigError(f"the chat template does not compile: {other._template_error}.")
        return other

    def with_render_limit(self, max_chars: int) -> "Tokenizer":
        """This tokenizer (sharing its backend and compiled template) rendering chats of at most ``max_chars``."""
        other = copy.copy(self)
        other.render_chars = max_chars
        return other

    def special_token_id(self, text: str) -> int | None:
        """The id of special token ``text`` (text never encodes to it unless it is written whole), or None."""
        token_id = self.backend.token_to_id(text)
        return token_id if token_id in self._special_ids else None

    def encode(self, text: str) -> list[int]:
        # encode_batch gives the same ids as encode but releases the GIL while it works, so a
        # server tokenizing a huge prompt on a worker thread keeps answering other requests.
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_with_ends(self, text: str) -> tuple[list[int], list[int]]:
        """:meth:`encode` and, per token, the character offset in ``text`` where it ends (non-decreasing;
        a BOS it added ends at 0): how many tokens lie wholly within ``text[:n]`` is a bisection."""
        enc = self.backend.encode_batch([text], add_special_tokens=False)[0]
        ids, ends = enc.ids, list(itertools.accumulate((end for _, end in enc.offsets), max))
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
            ends.insert(0, 0)
        return ids, ends

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def renders_tools(self) -> bool:
        """The chat template writes a ``tools`` list itself (else the server describes them)."""
        return "tools" in (self.chat_template or "")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render ``messages`` (``{"role", "content"}`` dicts) with the model's Jinja template;
        ``tools`` goes to a template that takes them (:attr:`renders_tools`). InvalidRequestError
        when the model has no template; ChatTemplateError (one) when it does not compile, raises, or
        runs past a limit."""
        if self._template_error:
            raise ChatTemplateError(f"this model's chat template does not compile ({self._template_error}): start it "
                                    f"with --chat-template FILE or one of {', '.join(BUILTIN)}.")
        if self._template is None:
            raise InvalidRequestError("this model has no chat template (a base model?): send a completion, or start "
                                      f"it with --chat-template FILE or one of {', '.join(BUILTIN)}.", param="messages")
        bos = self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.backend.id_to_token(min(self.eos_token_ids)) if self.eos_token_ids else ""
        return render(self._template, self.render_chars, messages=messages, add_generation_prompt=add_generation_prompt,
                      bos_token=bos or "", eos_token=eos or "", **({"tools": tools} if tools else {}))


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: each byte maps to one printable character.

    Printable Latin-1 bytes map to themselves; the rest (controls, space...) are shifted to
    code points from 256 upward, in byte order, so no byte becomes whitespace or a control.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return {byte: chr(byte if byte in keep else next(shifted)) for byte in range(256)}


def byte_level_bpe(vocab: dict[str, int], merges: Sequence[tuple[str, str]], split: str | None = None) -> HFTokenizer:
    """A byte-level BPE tokenizer (vocabulary in :func:`bytes_to_unicode`'s alphabet). ``split``:
    None, GPT-2's regex; ``"digits"``, each digit alone and then GPT-2's; else the regex the merges
    were learned over (llama.cpp's pre-tokenizer names: model/gguf_tokenizer.py)."""
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False, byte_fallback=False))
    if split is None or split == "digits":
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.pre_tokenizer = byte_level if split is None else pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


RANDOM_SPECIAL_TOKENS = ("<bos>", "<eos>", "<|im_start|>", "<|im_end|>")


def byte_tokenizer() -> Tokenizer:
    """A tiny real tokenizer for random models: ids 0-255 are the bytes, then 4 specials (256-259)."""
    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)} | {s: 256 + i for i, s in enumerate(RANDOM_SPECIAL_TOKENS)}
    tok = byte_level_bpe(vocab, [])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in RANDOM_SPECIAL_TOKENS])
    return Tokenizer(tok, bos_token_id=256, eos_token_ids={257, 259}, add_bos=False, chat_template=CHATML)


def _as_id_list(value: Any) -> list[int]:
    """A config's token id or list of ids (None: none) as a list."""
    return [value] if isinstance(value, int) else [int(v) for v in value or () if isinstance(v, int)]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def load_hf_tokenizer(folder: Path, config: dict) -> Tokenizer:
    """The tokenizer of an HF model directory: ``tokenizer.json`` plus optional
    ``tokenizer_config.json`` / ``chat_template.jinja`` / ``generation_config.json``."""
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tcfg = _read_json(folder / "tokenizer_config.json")
    gen = _read_json(folder / "generation_config.json")

    def lookup(value: Any) -> int | None:
        """``tokenizer_config.json`` writes a special token as a string or ``{"content": ...}``."""
        content = value.get("content") if isinstance(value, dict) else value
        return tok.token_to_id(content) if isinstance(content, str) else None

    bos = lookup(tcfg.get("bos_token"))
    if bos is None:
        bos = next(iter(_as_id_list(gen.get("bos_token_id")) or _as_id_list(config.get("bos_token_id"))), None)
    eos: set[int] = {*_as_id_list(gen.get("eos_token_id")), *_as_id_list(config.get("eos_token_id")),
                     lookup(tcfg.get("eos_token"))} - {None}

    # Whether the model expects a leading BOS: tokenizer_config says so, or tokenizer.json's
    # post-processor adds one (Llama 3 style) -- detected by encoding with and without specials.
    add_bos = tcfg.get("add_bos_token")
    if add_bos is None and bos is not None:
        with_specials = tok.encode("a", add_special_tokens=True).ids
        add_bos = bool(with_specials) and with_specials[0] == bos and tok.encode("a", add_special_tokens=False).ids[:1] != [bos]

    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = folder / "chat_template.jinja"
    if not template and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    if template and "<|im_end|>" in template and tok.token_to_id("<|im_end|>") is not None:
        eos.add(tok.token_to_id("<|im_end|>"))
    return Tokenizer(tok, bos_token_id=bos, eos_token_ids=eos, add_bos=bool(add_bos), chat_template=template,
                     sampling_defaults=from_generation_config(gen))
