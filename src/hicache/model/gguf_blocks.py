"""Weight matrices kept in a GGUF file's own quantized blocks, multiplied through the native kernels.

A GGUF file stores a quantized matrix of N rows (output features) by K columns (input features) as N rows
of ``K / block_size`` blocks of ``block_bytes`` bytes each: float16 scales and packed 4- to 8-bit values,
in llama.cpp's layouts (ggml-common.h; described in ``hicache/kernels/gguf_blocks.h``).
:class:`GGUFBlockWeight` holds those bytes as they are, ``uint8 [N, row_bytes]`` with ``row_bytes = K /
block_size * block_bytes``, and the ``gguf_linear`` / ``gguf_dequantize`` kernels
(``hicache/kernels/gguf_blocks.cpp``) decode each block in registers: a decode step reads 0.56 (Q4_0,
Q4_K) to 1.06 (Q8_0) bytes per weight where float32 weights take 4, and the weights it multiplies by are
exactly those ``gguf.quants.dequantize`` gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import torch


class BlockType(NamedTuple):
    name: str  # ggml's, e.g. "Q4_K"
    block_size: int  # weights per block, along K
    block_bytes: int  # bytes per block


# ggml type code (a GGUF tensor's type) -> its block layout, for the types the kernels read. The
# codes and sizes are the GGUF format's own (ggml-common.h; pinned against the ``gguf`` package's
# table by tests/test_gguf_blocks.py), written out so that importing the model does not import
# ``gguf`` (~0.4 s, paid by every rank process).
GGUF_BLOCK_TYPES: dict[int, BlockType] = {
    2: BlockType("Q4_0", 32, 18),
    3: BlockType("Q4_1", 32, 20),
    6: BlockType("Q5_0", 32, 22),
    7: BlockType("Q5_1", 32, 24),
    8: BlockType("Q8_0", 32, 34),
    12: BlockType("Q4_K", 256, 144),
    13: BlockType("Q5_K", 256, 176),
    14: BlockType("Q6_K", 256, 210),
}

# Types whose 8-bit-input GEMV reads rows packed 16 at a time (``kernels/gguf_x16.cpp``): Q4_0, Q4_1, Q5_0,
# Q5_1, Q8_0.
X16_TYPES = frozenset({2, 3, 6, 7, 8})


@dataclass
class GGUFBlockWeight:
    """A quantized ``[N, K]`` weight matrix as the GGUF file stores it (see the module docstring).

    ``qtype``: the ggml type code (a key of :data:`GGUF_BLOCK_TYPES`); ``data``: ``uint8 [N, row_bytes]``,
    row n holding output feature n's K weights; ``in_features``: K.
    """

    qtype: int
    data: torch.Tensor  # uint8 [N, row_bytes]
    in_features: int
    int8_activations: bool = False  # multiply with 8-bit inputs (``gguf_linear_int8``: lossy, faster)
    # With 8-bit inputs, the rows packed 16 at a time (:meth:`pack`), what the GEMV reads instead of ``data``.
    packed: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.qtype not in GGUF_BLOCK_TYPES:
            raise ValueError(f"ggml type {self.qtype} has no native kernel; supported: "
                             + ", ".join(f"{code} ({t.name})" for code, t in GGUF_BLOCK_TYPES.items()))
        block = GGUF_BLOCK_TYPES[self.qtype]
        if self.in_features <= 0 or self.in_features % block.block_size:
            raise ValueError(f"{block.name} needs K a multiple of {block.block_size}, got {self.in_features}")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != self.row_bytes:
            raise ValueError(f"{block.name} rows of K = {self.in_features} are uint8 [N, {self.row_bytes}], "
                             f"got {self.data.dtype} {list(self.data.shape)}")

    @property
    def kind(self) -> str:
        """The block type's name, lowercased: "q4_0" ... "q6_k"."""
        return GGUF_BLOCK_TYPES[self.qtype].name.lower()

    @property
    def out_features(self) -> int:
        """N, the matrix's rows."""
        return self.data.shape[0]

    @property
    def row_bytes(self) -> int:
        """Bytes per row (one output feature's K weights)."""
        block = GGUF_BLOCK_TYPES[self.qtype]
        return self.in_features // block.block_size * block.block_bytes

    @property
    def nbytes(self) -> int:
        """Bytes the matrix occupies (and a GEMV reads): N * row_bytes."""
        return self.data.numel()

    @property
    def resident_nbytes(self) -> int:
        """Bytes held: the blocks and the packed copy beside them (DESIGN invariant 6)."""
        return self.nbytes + (self.packed.numel() if self.packed is not None else 0)

    def rows(self, first: int, count: int) -> GGUFBlockWeight:
        """Rows ``[first, first + count)`` as a matrix of their own (a part of a fused tensor: blocks are
        per row, so a row range is exact)."""
        return GGUFBlockWeight(self.qtype, self.data[first:first + count].contiguous(), self.in_features,
                               self.int8_activations)

    def pack(self, ops) -> GGUFBlockWeight:
        """With 8-bit inputs, a Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 matrix of N % 16 == 0 rows gets the 16-row copy its
        GEMV reads (``kernels/gguf_x16.cpp``: integer dots of whole chunks, 1.3-2.5x faster than row by
        row; other products than ``gguf_linear_int8``'s, equally exact); a no-op otherwise. Returns self."""
        if self.packed is None and self.int8_activations and self.qtype in X16_TYPES and self.out_features % 16 == 0:
            self.packed = ops.gguf_pack_x16(self.data, self.qtype, self.in_features)
        return self

    def linear(self, x: torch.Tensor, ops) -> torch.Tensor:
        """``x @ W.T``: float32 ``[M, N]`` for a contiguous float32 ``x`` ``[M, K]`` (any M), through the
        native kernels ``ops`` (:func:`hicache.kernels.cpu_kernels`); with :attr:`int8_activations`, ``x``
        quantized to 8 bits per 32 inputs first (see ``kernels/gguf_int8.cpp``, ``gguf_x16.cpp``)."""
        if self.int8_activations:
            if self.pack(ops).packed is not None:
                return ops.gguf_linear_x16(x, self.packed, self.qtype, self.in_features)
            return ops.gguf_linear_int8(x, self.data, self.qtype, self.in_features)
        return ops.gguf_linear(x, self.data, self.qtype, self.in_features)

    def dequantize(self, ops) -> torch.Tensor:
        """W as float32 ``[N, K]``, bit for bit what ``gguf.quants.dequantize`` makes of the blocks."""
        return ops.gguf_dequantize(self.data, self.qtype, self.in_features)

    @staticmethod
    def cat(weights: Sequence[GGUFBlockWeight]) -> Optional[GGUFBlockWeight]:
        """The matrices' rows one after another (a fused q/k/v or gate/up projection: outputs of each in
        turn), or None when they differ in block type or K (or there are none)."""
        if not weights or any(w.qtype != weights[0].qtype or w.in_features != weights[0].in_features for w in weights):
            return None
        # one matrix: its own rows, no copy (a projection of one part would hold its blocks twice)
        data = weights[0].data if len(weights) == 1 else torch.cat([w.data for w in weights])
        return GGUFBlockWeight(weights[0].qtype, data, weights[0].in_features)
