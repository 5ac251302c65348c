"""The quantized blocks a projection's decode passes read, and how the native kernels take them.

In order of preference: the GGUF file's own blocks where the loader kept them (every type the
kernels read: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K, at the file's own bytes per weight), else
exact Q4_1/Q8_0 blocks recovered from the float32 matrix (:func:`~hicache.model.block_quant.pack_exact`:
a requantized draft model), else none (the float32 matrix). File blocks are used only where they
rebuild the matrix as it is now bit for bit: a TP shard, an in-place requantization or a new load
leaves a module's ``gguf_blocks`` stale, and a stale copy is never read. The parts of one
projection may come in different types (llama.cpp's Q4_K_M keeps ``attn_v`` in Q6_K beside
``attn_q`` in Q4_K): one block matrix per run of parts of the same type, outputs side by side.
"""

from __future__ import annotations

import dataclasses
from itertools import groupby
from typing import Optional, Sequence, Union

import torch
from torch import nn

from hicache.model.block_quant import BlockQuantWeight, pack_exact
from hicache.model.gguf_blocks import GGUFBlockWeight

Block = Union[BlockQuantWeight, GGUFBlockWeight]

# How kernels/decode_layer.cpp names a projection part's operands.
KIND_DENSE, KIND_Q4, KIND_Q8, KIND_GGUF, KIND_GGUF_INT8, KIND_GGUF_X16 = 0, 1, 2, 3, 4, 5


def decode_blocks(parts: Sequence[nn.Module], weight: torch.Tensor, ops, int8_activations: bool = False) -> list[Block]:
    """The blocks decode passes of a projection over ``parts`` (fused ``weight``: their rows one
    after another) read, or [] when they read ``weight`` itself. ``int8_activations``: file
    blocks multiply 8-bit inputs (``--decode-activations int8``)."""
    found = file_blocks(parts, weight, ops)
    if found:
        return [dataclasses.replace(b, int8_activations=int8_activations).pack(ops) for b in found]
    packed = pack_exact(weight)
    return [packed] if packed is not None else []


def file_blocks(parts: Sequence[nn.Module], weight: torch.Tensor, ops) -> list[GGUFBlockWeight]:
    """The parts' ``gguf_blocks`` (set by the GGUF loader), one matrix per run of parts of one
    type, if together they rebuild ``weight`` exactly; each part's then becomes a row view of its
    run (memory is not doubled). [] otherwise."""
    blocks: list[Optional[GGUFBlockWeight]] = [getattr(p, "gguf_blocks", None) for p in parts]
    if any(b is None for b in blocks):
        return []
    if (weight.dtype != torch.float32 or sum(b.out_features for b in blocks) != weight.shape[0]
            or any(b.in_features != weight.shape[1] for b in blocks)):
        return _drop_stale(parts)
    groups = [list(members) for _, members in groupby(zip(parts, blocks), key=lambda pb: pb[1].qtype)]
    runs = [(GGUFBlockWeight.cat([b for _, b in group]), [p for p, _ in group]) for group in groups]
    # run by run against its rows: no second float32 copy of the whole matrix
    for (run, _), rows in zip(runs, weight.split([run.out_features for run, _ in runs])):
        if not torch.equal(run.dequantize(ops), rows):
            return _drop_stale(parts)
    for run, members in runs:
        if len(members) > 1:
            rows = run.data.split([p.gguf_blocks.out_features for p in members])
            for part, view in zip(members, rows):
                part.gguf_blocks = GGUFBlockWeight(run.qtype, view, run.in_features)
    return [run for run, _ in runs]


def _drop_stale(parts: Sequence[nn.Module]) -> list:
    """The weights are no longer the file's (a TP shard, a requantized copy, another dtype): the
    blocks can never be read again, so they stop taking memory."""
    for part in parts:
        del part.gguf_blocks
    return []


def blocks_linear(blocks: Sequence[Block], x: torch.Tensor, ops) -> torch.Tensor:
    """``x @ W.T`` over the blocks' rows side by side, ``x`` contiguous float32."""
    if len(blocks) == 1:
        return blocks[0].linear(x, ops)
    return torch.cat([b.linear(x, ops) for b in blocks], dim=-1)


def native_operands(block: Block) -> tuple[int, int, tuple[torch.Tensor, ...]]:
    """``(kind, ggml type, tensors)`` of one block matrix for ``kernels/decode_layer.cpp``."""
    if isinstance(block, GGUFBlockWeight):
        if block.packed is not None:
            return KIND_GGUF_X16, block.qtype, (block.packed,)
        return (KIND_GGUF_INT8 if block.int8_activations else KIND_GGUF), block.qtype, (block.data,)
    if block.kind == "q4":
        return KIND_Q4, 0, (block.qs, block.scale, block.minv)
    return KIND_Q8, 0, (block.qs, block.scale)
