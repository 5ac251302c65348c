"""Load a GGUF file of a supported family (model/families/: llama -- the embedded SmolLM2 --,
qwen2, qwen3, gemma3, phi3, and the recurrent lfm2, qwen35 and granitehybrid) into :class:`LlamaForCausalLM`.

Fail closed: whatever in a file would change the math and is not implemented -- another
architecture, an unknown key of the architecture's metadata, a tensor with no place in the model
(e.g. Llama 3.1's ``rope_freqs``, QK-norm, Gemma's extra norms) -- is refused with one sentence
naming it, never skipped (:func:`_check_model`).

Checked before anything is allocated (issue 56; model/file_checks.py): the header within bounds
(model/gguf_file.py), ``block_count`` against the layers the tensor table holds, every size a
positive integer and every float finite, each tensor's shape against the spec's; a tokenizer the
``tokenizers`` library refuses is one sentence too.

Where llama.cpp's converter stored a tensor otherwise than the model holds it, the family says how
(model/families/base.py): rows it moved (Llama's q/k interleave; Qwen3.5's tiled value heads) are
put back row by row, which keeps a quantized matrix's blocks; other changes (``ssm_a`` =
``-exp(A_log)``, columns moved) are undone on the float32 values, and that tensor keeps no blocks; a
squeezed depthwise conv ``[C, K]`` fills its ``[C, 1, K]`` parameter, a vector stored as a matrix
(Granite's ``ssm_a`` ``[H, 1]``, ``ssm_norm`` ``[G, d / G]``) its flat one. The multi-token-prediction
blocks a newer converter appends (``nextn_predict_layers``, for a family that lists the key) are
left unread, as the HF loader leaves ``mtp.*``."""

from __future__ import annotations

import functools
import logging
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


logger = logging.getLogger(__name__)

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_KINDS = ("weight", "bias")
# Depthwise conv parameters [C, 1, K], which llama.cpp's converters store squeezed to [C, K].
_CONV_WEIGHTS = ("conv.conv.weight", "conv1d.weight")
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
        layer, rest = m.groups()
        names = family.layer_tensors()
        if rest in names:  # a parameter the family names whole (Qwen3.5's ssm_a: A_log)
            return f"model.layers.{layer}.{names[rest]}"
        part, _, kind = rest.rpartition(".")
        return f"model.layers.{layer}.{names[part]}.{kind}" if part in names and kind in _KINDS else None
    base, _, kind = gguf_name.rpartition(".")
    top = {**_TOP_NAMES, **family.gguf_top}
    return f"{top[base]}.{kind}" if base in top and kind in _KINDS else None


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
    experts = reader.fields.get(prefix + "expert_count", 0)
    if family.gguf_experts_refused and experts != 0:  # (before the keys and tensors the experts bring)
        raise ModelFormatError(f"GGUF metadata {prefix}expert_count = {quoted(experts)}: {family.gguf_experts_refused}.")
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
    for t in model_tensors(reader, family):
        m = _LAYER_RE.match(t.name)
        part = (m.group(2) if m else t.name).rpartition(".")[0]
        if hf_name(t.name, family) is None and t.name != ROPE_FACTORS:
            what = f" ({_UNHANDLED_TENSORS[part]})" if part in _UNHANDLED_TENSORS else ""
            raise ModelFormatError(f"GGUF tensor {cut(t.name)}{what} has no place in this engine's {family.name} model; "
                                   "the file is refused rather than run without it.")
    return family


def _head_dim(reader: GGUFFile, p: str, hidden: int, heads: int, family: Family) -> int:
    """A head's width: ``attention.key_length`` where the file says (Qwen3: not hidden / heads), else
    the rotary dimensions, else hidden / heads. Values as wide as keys, and rotary over the whole head
    but in a family with partial rotary (Qwen3.5: its own fields read ``rope.dimension_count``), are
    what the model implements: anything else is refused."""
    partial = "partial_rotary_factor" in family.hf_own_keys  # (Qwen3.5)
    rotary = None if partial else reader.fields.get(p + "rope.dimension_count")
    head_dim = _int(reader, p + "attention.key_length", rotary if rotary is not None else hidden // heads)
    for key in ("attention.value_length",) + (() if partial else ("rope.dimension_count",)):
        if _int(reader, p + key, head_dim) != head_dim:
            raise ModelFormatError(f"GGUF metadata {p}{key} = {reader.fields.get(p + key)} differs from the head width "
                                   f"{head_dim}, which this engine does not implement; the file is refused.")
    return head_dim


def _kv_heads(reader: GGUFFile, p: str, heads: int) -> int:
    """The attention layers' KV heads: ``attention.head_count_kv``, one number or one a layer (0 for a
    recurrent layer: LFM2; :func:`_check_kv_layers`), the same for every attention layer."""
    key = p + "attention.head_count_kv"
    value = reader.fields.get(key, heads)
    counts = {as_int(v, f"GGUF metadata {key}", 0) for v in (value if isinstance(value, list) else [value])} - {0}
    if len(counts) != 1:
        raise ModelFormatError(f"GGUF metadata {key} = {quoted(value)} gives the attention layers "
                               f"{'different KV head counts' if counts else 'no KV heads'}, which this engine does "
                               "not implement; the file is refused.")
    return counts.pop()


def _check_kv_layers(reader: GGUFFile, p: str, spec: ModelSpec) -> None:
    """A per-layer ``attention.head_count_kv`` gives 0 KV heads to exactly the recurrent layers."""
    value = reader.fields.get(p + "attention.head_count_kv")
    if isinstance(value, list) and [v == 0 for v in value] != [spec.is_recurrent(i) for i in range(spec.num_layers)]:
        raise ModelFormatError(f"GGUF metadata {p}attention.head_count_kv = {quoted(value)} does not give 0 KV heads "
                               f"to exactly the recurrent layers {list(spec.recurrent_layers)} of the "
                               f"{spec.num_layers}; the file is refused.")


def model_tensors(reader: GGUFFile, family: Family) -> list[GGUFTensor]:
    """The file's tensors the model reads: all but those of the multi-token-prediction blocks a newer
    converter appends after the model's (the last ``nextn_predict_layers`` of ``block_count``, where
    the family reads that key: Qwen3.5)."""
    p = f"{family.gguf_architecture}."
    mtp = reader.fields.get(p + "nextn_predict_layers", 0) if "nextn_predict_layers" in family.gguf_keys else 0
    mtp = as_int(mtp, f"GGUF metadata {p}nextn_predict_layers", 0)
    if not mtp:
        return list(reader.tensors)
    first = as_int(reader.fields.get(p + "block_count"), f"GGUF metadata {p}block_count") - mtp
    if first < 1:
        raise ModelFormatError(f"GGUF metadata {p}nextn_predict_layers = {mtp} leaves no layers of the "
                               f"{first + mtp} in block_count to the model.")
    return [t for t in reader.tensors if not (m := _LAYER_RE.match(t.name)) or int(m.group(1)) < first]


def _int(reader: GGUFFile, key: str, default=None) -> int:
    """Metadata ``key`` (else ``default``) as a positive integer; one sentence naming it otherwise."""
    return as_int(reader.fields.get(key, default), f"GGUF metadata {key}")


def _float(reader: GGUFFile, key: str, default: float) -> float:
    """Metadata ``key`` (else ``default``) as a finite positive float; one sentence naming it otherwise."""
    return as_float(reader.fields.get(key, default), f"GGUF metadata {key}")


def _spec_from_gguf(reader: GGUFFile, tensors: list[GGUFTensor], family: Family) -> ModelSpec:
    """The model's shape from the metadata and ``tensors`` (the model's: :func:`model_tensors`)."""
    p = f"{family.gguf_architecture}."
    # first: the spec makes a tuple per layer, and the model a module per layer (MTP blocks count here)
    check_layer_count(reader.fields.get(p + "block_count"), [t.name for t in reader.tensors], GGUF_LAYER,
                      f"GGUF metadata {p}block_count", "its tensor table")
    names = {t.name for t in tensors}
    layers = len({m.group(1) for m in map(GGUF_LAYER.match, names) if m})  # (0 .. n-1: block_count's, less MTP's)
    hidden = _int(reader, p + "embedding_length")
    heads = _int(reader, p + "attention.head_count")
    vocab = _int(reader, p + "vocab_size", len(reader.fields.get("tokenizer.ggml.tokens") or ()))
    spec = ModelSpec(
        num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=_kv_heads(reader, p, heads),
        head_dim=_head_dim(reader, p, hidden, heads, family),
        intermediate_size=_int(reader, p + "feed_forward_length"), vocab_size=vocab,
        rope_theta=_float(reader, p + "rope.freq_base", 10000.0),
        rms_norm_eps=_float(reader, p + "attention.layer_norm_rms_epsilon", 1e-5),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=_int(reader, p + "context_length", 2048),
        attention_bias="blk.0.attn_q.bias" in names, rope_scaling=_rope_scaling(reader, p),
        **gguf_layer_fields(family, reader.fields, hidden, layers, names),
    )
    _check_kv_layers(reader, p, spec)
    return spec


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
    """Read, dequantize (to float32, then ``dtype``) and put in the model's order (the module
    docstring) every tensor of a GGUF file; a quantized matrix also keeps the file's blocks as its
    module's ``gguf_blocks`` (decode steps read them where they rebuild the weights exactly).
    ``weights=False``: only the shape and the tokenizer (the model is None)."""
    reader, tokenizer, family = _read(path)
    tensors = model_tensors(reader, family)
    spec = _spec_from_gguf(reader, tensors, family)
    found = [(t.name, hf_name(t.name, family), t) for t in tensors if t.name != ROPE_FACTORS]
    check_shapes([(file_name, name, _model_shape(name, t, family)) for file_name, name, t in found], spec, "GGUF",
                 "the GGUF file", family.parts_of)
    check_token_ids(tokenizer, spec, "the GGUF file")
    if len(tensors) != len(reader.tensors):
        logger.info("%s: the %d tensors of its multi-token-prediction blocks are not loaded", path.name,
                    len(reader.tensors) - len(tensors))
    if not weights:
        return None, tokenizer, spec
    model = LlamaForCausalLM(spec, dtype, device)
    params = dict(model.named_parameters())
    ops = cpu_kernels() if torch.device(device).type == "cpu" else None  # None: gguf.quants dequantizes then
    with torch.no_grad():
        for t in tensors:
            name = hf_name(t.name, family)
            if name is None:
                continue
            # A fused tensor (Phi-3's attn_qkv) fills its parts row by row (every part's there, the rows
            # add up: check_shapes).
            parts = family.parts_of(name) or (name,)
            values, blocks = _values(t, name, spec, family, ops, ops is not None or dtype == torch.float32)
            first = 0
            for part, piece in zip(parts, values.split([params[p].shape[0] for p in parts])):
                _assign(params[part], piece.reshape(params[part].shape), t.name)  # (a squeezed conv: [C, 1, K])
                # Decode steps read these (model/decode_blocks.py): all but an embedding that is not also
                # the LM head (lookups read its float32 rows; no matmul would read the blocks).
                keeps = (part != "model.embed_tokens.weight" or spec.tie_word_embeddings) and params[part].dim() == 2
                if blocks is not None and dtype == torch.float32 and keeps:
                    model.get_submodule(part.removesuffix(".weight")).gguf_blocks = (
                        blocks if len(parts) == 1 else blocks.rows(first, len(piece)))
                first += len(piece)
    return model, tokenizer, spec  # (every parameter had its tensor: check_shapes)


def _model_shape(name: str | None, t: GGUFTensor, family: Family) -> tuple[int, ...]:
    """Tensor ``t``'s shape, slowest dimension first, as the parameter ``name`` holds it: a depthwise
    conv llama.cpp's converter squeezed to ``[C, K]`` is ``[C, 1, K]``; a vector it stored as a matrix
    (the family's ``gguf_flat``) is flat."""
    shape = tuple(reversed(t.shape))
    if name and family.gguf_flat and name.endswith(family.gguf_flat):
        return (int(np.prod(shape)),)
    return (shape[0], 1, shape[1]) if name and name.endswith(_CONV_WEIGHTS) and len(shape) == 2 else shape


def _values(t: GGUFTensor, name: str, spec: ModelSpec, family: Family, ops,
            want_blocks: bool) -> tuple[torch.Tensor, GGUFBlockWeight | None]:
    """Tensor ``t``'s float32 values as parameter ``name`` holds them (rows in the model's order, the
    family's other changes undone), and, where ``want_blocks``, its quantized blocks if they hold
    exactly those values (rows moved whole: yes; values changed otherwise: None)."""
    import gguf  # local import: only this loader needs it, and it is slow-ish to import

    order = _row_order(t, name, spec, family)
    blocks = _row_blocks(t, name, order) if want_blocks else None
    if blocks is not None and ops is not None:
        # The same float32 bits as gguf.quants (tests/test_gguf_blocks.py), ~2x faster, and the rows
        # come out in the model's order (the blocks are reordered already).
        values = blocks.dequantize(ops)
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # (a hostile file's infinities: refused on assignment)
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        # (copied only where not ours already: F32 tensors come back as views of the read-only mmap)
        values = torch.from_numpy(np.require(array, requirements="CW"))
        values = values if order is None else values[order]
    if family.gguf_flat and name.endswith(family.gguf_flat):
        values = values.reshape(-1)  # (stored [H, 1] or [G, d / G]: :func:`_model_shape`)
    changed = family.gguf_values(name, values, spec) if family.gguf_values is not None else None
    return (values, blocks) if changed is None else (changed, None)


def _assign(target: torch.Tensor, values: torch.Tensor, gguf_name: str) -> None:
    """``values`` (of ``target``'s shape: check_shapes) into the parameter ``target``."""
    check_finite(values, f"GGUF tensor {cut(gguf_name)}")
    if values.dtype == target.dtype and values.device == target.device and values.is_contiguous():
        target.data = values  # a tensor of our own already: no second copy (the empty one is freed)
    else:
        target.copy_(values)


def _row_order(t: GGUFTensor, name: str, spec: ModelSpec, family: Family) -> torch.Tensor | None:
    """The file rows of tensor ``t`` in the model's row order where llama.cpp's converter moved rows
    (q_proj / k_proj of a family it interleaves; the family's own: Qwen3.5's value heads), else None."""
    if family.gguf_qk_interleaved and (".q_proj." in name or ".k_proj." in name):
        heads = spec.num_heads if ".q_proj." in name else spec.num_kv_heads
        return unpermute_rope_rows(torch.arange(int(t.data.shape[0])), heads)
    return family.gguf_row_order(name, spec) if family.gguf_row_order is not None else None


def _row_blocks(t: GGUFTensor, name: str, order: torch.Tensor | None) -> GGUFBlockWeight | None:
    """The matrix's own quantized blocks from the file, rows in the model's order (``order``: the file
    rows to take: whole rows move, blocks untouched), or None for plain types, types the kernels do
    not read, and vectors."""
    if int(t.tensor_type) not in GGUF_BLOCK_TYPES or not name.endswith(".weight") or len(t.shape) != 2:
        return None
    # A copy out of the read-only map either way; numpy's row gather is ~100x torch's on uint8 rows.
    data = np.array(t.data) if order is None else t.data[order.numpy()]
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
