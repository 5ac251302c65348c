"""What both loaders check in a model file before they allocate anything for it (issue 56: a
``block_count`` of 1e9 grew a process to 4 GB in 90 s with no error).

Order, for a GGUF file and an HF directory alike: the header is read within bounds
(model/gguf_file.py; safetensors' own reader), the declared layer count must be the number of
layers the tensor table holds (:func:`check_layer_count`: before the spec is built, since a spec
makes a tuple per layer), each size a positive integer and each float finite (``as_int``,
``as_float`` of model/errors.py), then every tensor's shape must be the shape the spec gives its
parameter, and every parameter must have its tensor (:func:`check_shapes`, against
:func:`~hicache.model.llama.parameter_shapes`). Only then is the model allocated: its bytes are
the file's tensors' own, dequantized.

Every message is one sentence, its quoted values cut by :func:`~hicache.model.errors.quoted`.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import torch

from hicache.model.errors import ModelFormatError, as_int, cut, quoted
from hicache.model.llama import parameter_shapes
from hicache.model.spec import ModelSpec
from hicache.model.tokenizer import Tokenizer

GGUF_LAYER = re.compile(r"^blk\.(\d+)\.")
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def check_layer_count(declared: Any, names: Iterable[str], pattern: re.Pattern, what: str, source: str) -> int:
    """The declared layer count (``what``: "GGUF metadata llama.block_count"...) once it is exactly
    the layers the tensor ``names`` hold, each index from 0 on present; cheap for any declared value."""
    layers = as_int(declared, what)
    found = {int(m.group(1)) for m in map(pattern.match, names) if m}
    if len(found) != layers or (found and max(found) != layers - 1):  # (distinct indices: then they are 0..n-1)
        missing = [i for i in range(min(layers, len(found) + 1)) if i not in found]
        extra = sorted(i for i in found if i >= layers)
        detail = f"no tensors for layer {missing[0]}" if missing else f"tensors for layer {extra[0]}"
        raise ModelFormatError(f"{what} = {layers} does not match the {len(found)} layers {source} holds "
                               f"({detail}); the file is refused before anything is allocated for it.")
    return layers


def check_shapes(found: Iterable[tuple[str, str | None, tuple[int, ...]]], spec: ModelSpec, kind: str, source: str,
                 parts_of: Callable[[str], tuple[str, ...] | None]) -> None:
    """Every tensor of ``found`` (its name in the file, the model parameter it fills, its shape with
    the slowest dimension first) has the shape its parameter has under ``spec`` (a fused tensor,
    ``parts_of`` its parts: their rows stacked), and every parameter has a tensor. ``kind`` names
    the tensors ("GGUF", "checkpoint"), ``source`` the file, in the messages."""
    want = parameter_shapes(spec)
    covered: set[str] = set()
    for file_name, name, shape in found:
        parts = (parts_of(name) or (name,)) if name is not None else ()
        if not parts or any(p not in want for p in parts):
            raise ModelFormatError(f"{kind} tensor {cut(file_name)} has no place in the model.")
        if covered.intersection(parts):  # two names for one parameter (a family's and the model's)
            twice = sorted(covered.intersection(parts))[0]
            raise ModelFormatError(f"{kind} tensor {cut(file_name)} fills {cut(twice)}, which another tensor of the "
                                   "file fills too.")
        expected = (sum(want[p][0] for p in parts), *want[parts[0]][1:])
        if tuple(shape) != expected:
            raise ModelFormatError(f"{kind} tensor {cut(file_name)} has shape {quoted(tuple(shape))}, expected "
                                   f"{expected} (from the model's sizes); the file is refused before it is loaded.")
        covered.update(parts)
    missing = sorted(set(want) - covered)
    if missing:
        raise ModelFormatError(f"{source} lacks tensors for {', '.join(missing[:3])}{'...' if len(missing) > 3 else ''}.")


def check_finite(values: torch.Tensor, what: str) -> None:
    """A weight tensor holds no infinity or NaN (a reinterpreted or corrupted tensor: every logit NaN):
    its float32 L2 norm is finite, so no value is past ~1.8e19 either (its square would overflow).
    One pass over the values (~0.05 s for 135M float32 parameters on a 2-core VM)."""
    if values.is_floating_point() and not bool(torch.isfinite(torch.linalg.vector_norm(values, dtype=torch.float32))):
        raise ModelFormatError(f"{what} holds values that are not finite or past 1e19 (infinity, NaN); the model is "
                               "refused rather than run to NaN logits.")


def check_token_ids(tokenizer: Tokenizer, spec: ModelSpec, source: str) -> None:
    """The tokenizer fits the model: no more tokens than embedding rows, and its BOS and stop tokens
    are rows of the embedding (a BOS beyond them would fail the first forward pass)."""
    if tokenizer.vocab_size > spec.vocab_size:
        raise ModelFormatError(f"{source}'s tokenizer has {tokenizer.vocab_size} tokens but its model only "
                               f"{spec.vocab_size} embedding rows.")
    ids = ([] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]) + sorted(tokenizer.eos_token_ids)
    bad = [i for i in ids if not 0 <= i < spec.vocab_size]
    if bad:
        raise ModelFormatError(f"{source}'s BOS or stop token id {quoted(bad[0])} is not a row of its "
                               f"{spec.vocab_size}-row embedding.")
