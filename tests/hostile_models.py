"""Hostile model files (issue 56, S6): a tiny Llama written from scratch as a GGUF file or a Hugging
Face directory, the crafted variants the issue reported, and seeded mutations of both for the
model-file fuzz campaign (:mod:`hicache.bench.model_campaign`, tests/test_hostile_model_files.py).

The GGUF writer is this module's own (not the ``gguf`` package's): a hostile file breaks the
format's rules -- an alignment of 0, an array count of 2^63, tensors that overlap -- and the
package's writer refuses to write those. Sizes: 2 layers, hidden 64, 4 heads of 16, 2 KV heads,
MLP 128, 259 tokens (the 256 bytes + 3 specials), float32 weights (~370 KB a file).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np

from hicache.model.tokenizer import byte_tokenizer, bytes_to_unicode

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR_FORMATS = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q",
                   I64: "q", F64: "d"}
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS, CONTEXT = 64, 4, 2, 16, 128, 2, 256
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
VOCAB = 256 + len(SPECIALS)
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A chat template that never ends (issue 56: it hung --chat), and one whose output is ~10 GB.
NESTED_RANGES = "{% for i in range(99999) %}{% for j in range(99999) %}{{ '' }}{% endfor %}{% endfor %}"
DOUBLING = "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"


@dataclass(frozen=True)
class Raw:
    """A value written as these bytes, whatever its declared type says (a count of 2^63...)."""

    data: bytes


@dataclass
class GGUFDoc:
    """A GGUF file before it is written: ``fields`` (key, value type, value; an array's value is
    ``(item type, items)``, nested for arrays of arrays), ``tensors`` (name, dims fastest first,
    GGML type, data). ``offsets``: each tensor's offset into the data section (None: in order,
    each aligned). ``alignment``: the data layout's (the ``general.alignment`` field is separate)."""

    fields: list[tuple[str, int, Any]]
    tensors: list[tuple[str, tuple[int, ...], int, bytes]]
    alignment: int = 32
    offsets: list[int] | None = None
    version: int = 3

    def set(self, key: str, kind: int, value: Any) -> "GGUFDoc":
        """``key`` set to ``value`` (added at the end when new); returns self."""
        self.fields = [f for f in self.fields if f[0] != key] + [(key, kind, value)]
        return self

    def to_bytes(self) -> bytes:
        out = [struct.pack("<4sIQQ", b"GGUF", self.version, len(self.tensors), len(self.fields))]
        for key, kind, value in self.fields:
            out += [_string(key), struct.pack("<I", kind), _value(kind, value)]
        offsets = self.offsets or self.packed_offsets()
        for (name, dims, kind, _), offset in zip(self.tensors, offsets):
            out += [_string(name), struct.pack(f"<I{len(dims)}Q", len(dims), *dims), struct.pack("<IQ", kind, offset)]
        head = b"".join(out)
        placed = [(o, t[3]) for o, t in zip(offsets, self.tensors) if o < 1 << 26]  # (an offset of 2^62: declared only)
        body = bytearray(max((o + len(data) for o, data in placed), default=0))
        for offset, data in placed:
            body[offset:offset + len(data)] = data
        return head + bytes(-len(head) % self.alignment) + bytes(body)

    def packed_offsets(self) -> list[int]:
        """Each tensor's offset when they lie in order, each aligned (what a well-formed file has)."""
        sizes = (-(-len(t[3]) // self.alignment) * self.alignment for t in self.tensors)
        return list(accumulate(sizes, initial=0))[:-1]

    def write(self, path: Path) -> Path:
        path.write_bytes(self.to_bytes())
        return path


def _string(text: str | bytes) -> bytes:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def _value(kind: int, value: Any) -> bytes:
    if isinstance(value, Raw):
        return value.data
    if kind in _SCALAR_FORMATS:
        return struct.pack("<" + _SCALAR_FORMATS[kind], value)
    if kind == STRING:
        return _string(value)
    item, items = value
    return struct.pack("<IQ", item, len(items)) + b"".join(_value(item, v) for v in items)


def _layer_shapes() -> dict[str, tuple[int, ...]]:
    """A layer's tensors by GGUF name (after ``blk.N.``), dims fastest first."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return {"attn_norm": (HIDDEN,), "attn_q": (HIDDEN, q), "attn_k": (HIDDEN, kv), "attn_v": (HIDDEN, kv),
            "attn_output": (q, HIDDEN), "ffn_norm": (HIDDEN,), "ffn_gate": (HIDDEN, MLP), "ffn_up": (HIDDEN, MLP),
            "ffn_down": (MLP, HIDDEN)}


def tiny_gguf(seed: int = 0) -> GGUFDoc:
    """The tiny Llama as a GGUF document: llama.cpp's keys and tensor names, a byte-level BPE vocabulary
    without merges, ChatML; weights drawn from ``seed`` (norms 1)."""
    rng = np.random.default_rng(seed)

    def weights(dims: tuple[int, ...]) -> bytes:
        values = np.ones(dims[::-1], np.float32) if len(dims) == 1 else rng.normal(0, 0.05, dims[::-1])
        return values.astype(np.float32).tobytes()

    tensors = [("token_embd.weight", (HIDDEN, VOCAB), 0, weights((HIDDEN, VOCAB))),
               ("output_norm.weight", (HIDDEN,), 0, weights((HIDDEN,)))]
    for layer in range(LAYERS):
        tensors += [(f"blk.{layer}.{name}.weight", dims, 0, weights(dims)) for name, dims in _layer_shapes().items()]
    tokens = list(bytes_to_unicode().values()) + list(SPECIALS)  # GPT-2's byte-level alphabet, in byte order
    fields = [("general.architecture", STRING, "llama"), ("general.name", STRING, "tiny-hostile"),
              ("llama.vocab_size", U32, VOCAB), ("llama.context_length", U32, CONTEXT),
              ("llama.embedding_length", U32, HIDDEN), ("llama.block_count", U32, LAYERS),
              ("llama.feed_forward_length", U32, MLP), ("llama.attention.head_count", U32, HEADS),
              ("llama.attention.head_count_kv", U32, KV_HEADS), ("llama.rope.dimension_count", U32, HEAD_DIM),
              ("llama.rope.freq_base", F32, 10000.0), ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
              ("tokenizer.ggml.model", STRING, "gpt2"), ("tokenizer.ggml.pre", STRING, "gpt-2"),
              ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
              ("tokenizer.ggml.token_type", ARRAY, (I32, [1] * 256 + [3] * len(SPECIALS))),
              ("tokenizer.ggml.merges", ARRAY, (STRING, [])),
              ("tokenizer.ggml.bos_token_id", U32, VOCAB - 1), ("tokenizer.ggml.eos_token_id", U32, 257),
              ("tokenizer.chat_template", STRING, CHATML)]
    return GGUFDoc(fields, tensors)


HF_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "num_hidden_layers": LAYERS,
    "intermediate_size": MLP, "vocab_size": 320, "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float32"}


def hf_tensors(config: dict[str, Any] = HF_CONFIG, seed: int = 0) -> dict[str, np.ndarray]:
    """The tiny Llama's checkpoint tensors (transformers' names and shapes) for ``HF_CONFIG``."""
    rng = np.random.default_rng(seed)
    h, v, m = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    q, kv = h, KV_HEADS * (h // config["num_attention_heads"])
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (m, h), p + "mlp.up_proj.weight": (m, h),
                       p + "mlp.down_proj.weight": (h, m)})
    return {name: rng.normal(0, 0.05, shape).astype(np.float32) for name, shape in shapes.items()}


def write_hf_dir(folder: Path, config: dict[str, Any] | None = None, tensors: dict[str, np.ndarray] | None = None,
                 config_text: str | None = None, tokenizer_config: dict[str, Any] | None = None) -> Path:
    """A Hugging Face directory: ``config.json`` (``config_text`` as written, else ``config`` dumped
    with ``Infinity`` where a value is infinite, as transformers writes it), ``model.safetensors``
    (``tensors``, default :func:`hf_tensors`), a byte-level ``tokenizer.json`` and a tokenizer
    config with ChatML."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = dict(HF_CONFIG if config is None else config)
    (folder / "config.json").write_text(config_text if config_text is not None else json.dumps(config))
    save_file(hf_tensors() if tensors is None else tensors, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text(byte_tokenizer().backend.to_str())
    tcfg = {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": CHATML, **(tokenizer_config or {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return folder


def _nested_arrays(depth: int) -> Raw:
    """An array of an array ... ``depth`` deep, the innermost empty."""
    return Raw(struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQ", U8, 0))


def _overlapping(doc: GGUFDoc) -> GGUFDoc:
    """Two layers' ``attn_q`` at the same offset: one matrix read for both."""
    doc.alignment, offsets = 32, doc.packed_offsets()
    names = [t[0] for t in doc.tensors]
    offsets[names.index("blk.1.attn_q.weight")] = offsets[names.index("blk.0.attn_q.weight")]
    doc.offsets = offsets
    return doc


# The crafted GGUF files, by what each does: the tiny file changed.
CRAFTED_GGUF = {
    "block_count 1e9": lambda d: d.set("llama.block_count", U32, 10**9),
    "block_count 1e5": lambda d: d.set("llama.block_count", U32, 10**5),
    "alignment 0": lambda d: d.set("general.alignment", U32, 0),
    "alignment 7": lambda d: d.set("general.alignment", U32, 7),
    "array count 2^63": lambda d: d.set("general.tags", ARRAY, Raw(struct.pack("<IQ", U8, 2**63))),
    "5,000 nested arrays": lambda d: d.set("general.tags", ARRAY, _nested_arrays(5000)),
    "1 MB architecture": lambda d: d.set("general.architecture", STRING, "llama" + "x" * (1 << 20)),
    "overlapping tensors": _overlapping,
    "eps = inf": lambda d: d.set("llama.attention.layer_norm_rms_epsilon", F32, float("inf")),
    "nested range(99999) template": lambda d: d.set("tokenizer.chat_template", STRING, NESTED_RANGES),
}


def crafted_gguf(name: str, path: Path) -> Path:
    """The crafted file ``name`` of :data:`CRAFTED_GGUF` written at ``path``."""
    return CRAFTED_GGUF[name](tiny_gguf()).write(path)
