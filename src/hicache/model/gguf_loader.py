"""Load a GGUF file of a supported family (model/families/: llama -- the embedded SmolLM2 --,
qwen2, qwen3, gemma3) into :class:`LlamaForCausalLM`.

Fail closed: whatever in a file would change the math and is not implemented -- another
architecture, an unknown key of the architecture's metadata, a tensor with no place in the model
(e.g. Llama 3.1's ``rope_freqs``, QK-norm, Gemma's extra norms) -- is refused with one sentence
naming it, never skipped (:func:`_check_model`).

Checked before anything is allocated (issue 56; model/file_checks.py): the header within bounds
(model/gguf_file.py), ``block_count`` against the layers the tensor table holds, every size a
positive integer and every float finite, each tensor's shape against the spec's; a tokenizer the
``tokenizers`` library refuses is one sentence too."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import torch

from hicache.kernels import cpu_kernels
from hicache.model.errors import ModelFormatError, as_float, as_int, cut, quoted
from hicache.model.families import Family, gguf_family, gguf_layer_fields
from hicache.model.file_checks import GGUF_LAYER, check_finite, check_layer_count, check_shapes, check_token_ids
from hicache.model.gguf_blocks import GGUF_BLOCK_TYPES, GGUFBlockWeight
from hicache.model.gguf_file import GGUFFile, GGUFTensor
from hicache.model.llama import LlamaForCausalLM
from hicache.model.spec import ModelSpec
from hicache.model.gguf_tokenizer import tokenizer_from_gguf
from hicache.model.tokenizer import Tokenizer


_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# The architecture's metadata this loader reads ("<architecture>.<key>"). Fail closed: any other key of
# the architecture changes the math in a way the model does not implement, unless it holds the value a
# plain Llama has (:data:`_NEUTRAL_KEYS`): the file is refused, naming it, rather than run wrongly.
_READ_KEYS = frozenset({"block_count", "context_length", "embedding_length", "feed_forward_length",
                        "attention.head_count", "attention.head_count_kv", "rope.freq_base",
                        "attention.layer_norm_rms_epsilon", "vocab_size", "rope.dimension_count",
                        "attention.key_length", "attention.value_length", "rope.scaling.type",
                        "rope.scaling.factor", "rope.scaling.original_context_length"})
# Keys of the architecture beyond those, with the values that leave a Llama unchanged.
_NEUTRAL_KEYS = {"expert_count": (0,), "expert_used_count": (0,)}
ROPE_SCALING_TYPES = ("none", "linear", "yarn")  # rope.scaling.type values this loader reads
# What the tensors a llama file may carry beyond the mapped ones do (for the refusal's sentence).
ROPE_FACTORS = "rope_freqs.weight"  # Llama 3.1+: a frequency factor per rotary pair (spec "freq_factors")
_UNHANDLED_TENSORS = {"attn_q_norm": "QK-norm",
                      "attn_k_norm": "QK-norm", "post_attention_norm": "a norm after attention",
                      "post_ffw_norm": "a norm after the MLP", "ffn_gate_inp": "mixture-of-experts routing",
                      "attn_qkv": "a fused q/k/v projection", "ffn_up_gate": "a fused gate/up projection"}


def hf_name(gguf_name: str, family: Family) -> str | None:
    """HF parameter name for a GGUF tensor name of ``family``'s file, or None for tensors with no
    place in its model."""
    m = _LAYER_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        names = family.layer_tensors()
        return f"model.layers.{layer}.{names[part]}.{kind}" if part in names else None
    base, _, kind = gguf_name.rpartition(".")
    return f"{_TOP_NAMES[base]}.{kind}" if base in _TOP_NAMES else None


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's HF->GGUF row permutation of ``attn_q`` / ``attn_k`` (weight or bias).

    llama.cpp rotates adjacent pairs (2j, 2j+1); HF rotates (j, j + head_dim/2). The converter
    therefore stores, within each head, HF row ``j`` at ``2j`` and row ``j + head_dim/2`` at
    ``2j + 1``. Reading GGUF rows as ``[head, j, pair]`` and swapping to ``[head, pair, j]``
    restores the HF order.
    """
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _check_model(reader: GGUFFile) -> Family:
    """The file's family (model/families.py), after refusing, naming it, what this loader would
    otherwise skip and run wrongly: another architecture (checked before the tokenizer, so the
    sentence names the real problem), a metadata key of the architecture that changes the math, a
    tensor with no place in the model."""
    family = gguf_family(reader.fields.get("general.architecture"))
    prefix = f"{family.gguf_architecture}."
    for key, value in reader.fields.items():
        short = key.removeprefix(prefix)
        read = short in _READ_KEYS or short in family.gguf_keys
        if key.startswith(prefix) and not read and value not in _NEUTRAL_KEYS.get(short, ()):
            raise ModelFormatError(f"GGUF metadata {cut(key)} = {quoted(value)} changes the math in a way this engine does "
                                   "not implement yet; the file is refused rather than run wrongly.")
    scaling = reader.fields.get(prefix + "rope.scaling.type", "none")
    if scaling not in ROPE_SCALING_TYPES:
        raise ModelFormatError(f"GGUF metadata {prefix}rope.scaling.type = {quoted(scaling)} is not implemented (only "
                               f"{', '.join(ROPE_SCALING_TYPES)}); the file is refused rather than run wrongly.")
    for t in reader.tensors:
        m = _LAYER_RE.match(t.name)
        part = m.group(2) if m else t.name.rpartition(".")[0]
        if hf_name(t.name, family) is None and t.name != ROPE_FACTORS:
            what = f" ({_UNHANDLED_TENSORS[part]})" if part in _UNHANDLED_TENSORS else ""
            raise ModelFormatError(f"GGUF tensor {cut(t.name)}{what} has no place in this engine's {family.name} model; "
                                   "the file is refused rather than run without it.")
    return family


def _head_dim(reader: GGUFFile, p: str, hidden: int, heads: int) -> int:
    """A head's width: ``attention.key_length`` where the file says (Qwen3: not hidden / heads), else
    the rotary dimensions, else hidden / heads. Values as wide as keys and rotary over the whole head
    are what the model implements: anything else is refused."""
    head_dim = _int(reader, p + "attention.key_length", reader.fields.get(p + "rope.dimension_count", hidden // heads))
    for key in ("attention.value_length", "rope.dimension_count"):
        if _int(reader, p + key, head_dim) != head_dim:
            raise ModelFormatError(f"GGUF metadata {p}{key} = {reader.fields.get(p + key)} differs from the head width "
                                   f"{head_dim}, which this engine does not implement; the file is refused.")
    return head_dim


def _int(reader: GGUFFile, key: str, default=None) -> int:
    """Metadata ``key`` (else ``default``) as a positive integer; one sentence naming it otherwise."""
    return as_int(reader.fields.get(key, default), f"GGUF metadata {key}")


def _float(reader: GGUFFile, key: str, default: float) -> float:
    """Metadata ``key`` (else ``default``) as a finite positive float; one sentence naming it otherwise."""
    return as_float(reader.fields.get(key, default), f"GGUF metadata {key}")


def _spec_from_gguf(reader: GGUFFile, tensor_names: set[str], family: Family) -> ModelSpec:
    p = f"{family.gguf_architecture}."
    # first: the spec makes a tuple per layer, and the model a module per layer
    layers = check_layer_count(reader.fields.get(p + "block_count"), tensor_names, GGUF_LAYER,
                               f"GGUF metadata {p}block_count", "its tensor table")
    hidden = _int(reader, p + "embedding_length")
    heads = _int(reader, p + "attention.head_count")
    vocab = _int(reader, p + "vocab_size", len(reader.fields.get("tokenizer.ggml.tokens") or ()))
    return ModelSpec(
        num_layers=layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=_int(reader, p + "attention.head_count_kv", heads), head_dim=_head_dim(reader, p, hidden, heads),
        intermediate_size=_int(reader, p + "feed_forward_length"), vocab_size=vocab,
        rope_theta=_float(reader, p + "rope.freq_base", 10000.0),
        rms_norm_eps=_float(reader, p + "attention.layer_norm_rms_epsilon", 1e-5),
        tie_word_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=_int(reader, p + "context_length", 2048),
        attention_bias="blk.0.attn_q.bias" in tensor_names, rope_scaling=_rope_scaling(reader, p),
        **gguf_layer_fields(family, reader.fields, hidden, layers),
    )


def _rope_scaling(reader: GGUFFile, p: str) -> dict | None:
    """Llama 3.1+'s ``rope_freqs`` tensor as a ``freq_factors`` rope scaling; else the metadata's
    (``rope.scaling.type`` linear -- Gemma 3 4B+ -- or yarn -- Qwen2.5 / Qwen3 long context, with
    llama.cpp's defaults for what the file does not say); else None."""
    tensor = next((t for t in reader.tensors if t.name == ROPE_FACTORS), None)
    if tensor is None:
        factor = as_float(reader.fields.get(p + "rope.scaling.factor") or 1.0, f"GGUF metadata {p}rope.scaling.factor")
        kind = reader.fields.get(p + "rope.scaling.type", "none")
        if kind == "none" or factor == 1.0:
            return None
        scaling = {"rope_type": kind, "factor": factor}
        if kind == "yarn":
            scaling["original_max_position_embeddings"] = _int(
                reader, p + "rope.scaling.original_context_length", reader.fields.get(p + "context_length", 2048))
        return scaling
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
    spec = _spec_from_gguf(reader, {t.name for t in reader.tensors}, family)
    check_shapes([(t.name, hf_name(t.name, family), tuple(reversed(t.shape))) for t in reader.tensors
                  if t.name != ROPE_FACTORS], spec, "GGUF", "the GGUF file", family.parts_of)
    check_token_ids(tokenizer, spec, "the GGUF file")
    if not weights:
        return None, tokenizer, spec
    model = LlamaForCausalLM(spec, dtype, device)
    params = dict(model.named_parameters())
    ops = cpu_kernels() if torch.device(device).type == "cpu" else None  # None: gguf.quants dequantizes then
    with torch.no_grad():
        for t in reader.tensors:
            name = hf_name(t.name, family)
            if name is None:
                continue
            # A fused tensor (Phi-3's attn_qkv) fills its parts row by row (every part's there, the rows
            # add up: check_shapes).
            parts = family.parts_of(name) or (name,)
            heads = _interleaved_heads(name, spec, family)
            blocks = _row_blocks(t, name, heads) if ops is not None or dtype == torch.float32 else None
            if blocks is not None and ops is not None:
                # The same float32 bits as gguf.quants (tests/test_gguf_blocks.py), ~2x faster, and the
                # rows come out in the model's order (the blocks are un-permuted already).
                values = blocks.dequantize(ops)
            else:
                with np.errstate(over="ignore", invalid="ignore"):  # (a hostile file's infinities: refused below)
                    array = gguf.quants.dequantize(t.data, t.tensor_type)
                # (copied only where not ours already: F32 tensors come back as views of the read-only mmap)
                values = torch.from_numpy(np.require(array, requirements="CW"))
                if heads is not None:
                    values = unpermute_rope_rows(values, heads)
            first = 0
            for part, piece in zip(parts, values.split([params[p].shape[0] for p in parts])):
                _assign(params[part], piece, t.name)
                # Decode steps read these (model/decode_blocks.py): all but an embedding that is not also
                # the LM head (lookups read its float32 rows; no matmul would read the blocks).
                keeps = part != "model.embed_tokens.weight" or spec.tie_word_embeddings
                if blocks is not None and dtype == torch.float32 and keeps:
                    model.get_submodule(part.removesuffix(".weight")).gguf_blocks = (
                        blocks if len(parts) == 1 else blocks.rows(first, len(piece)))
                first += len(piece)
    return model, tokenizer, spec  # (every parameter had its tensor: check_shapes)


def _assign(target: torch.Tensor, values: torch.Tensor, gguf_name: str) -> None:
    """``values`` (of ``target``'s shape: check_shapes) into the parameter ``target``."""
    check_finite(values, f"GGUF tensor {cut(gguf_name)}")
    if values.dtype == target.dtype and values.device == target.device and values.is_contiguous():
        target.data = values  # a tensor of our own already: no second copy (the empty one is freed)
    else:
        target.copy_(values)


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
    try:
        tokenizer = tokenizer_from_gguf(reader.fields, family.gguf_architecture)
    except ModelFormatError:
        raise
    except Exception as e:  # the tokenizers library's own refusals (plain Exception) and ill-typed arrays
        raise ModelFormatError(f"the GGUF file's tokenizer cannot be built: {quoted(str(e))}.") from None
    return reader, tokenizer, family


def is_gguf_file(path: Path) -> bool:
    """Whether ``path`` is a GGUF file by its magic bytes, whatever its name ends with."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
