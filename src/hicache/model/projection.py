"""The model's weight matrices as runnable projections: fused where they share an input, with a
second copy of the weights for decode steps where one reads fewer bytes."""

from __future__ import annotations

import functools
import sys
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from hicache.kernels import cpu_kernels
from hicache.model.decode_blocks import KIND_DENSE, Block, blocks_linear, decode_blocks, native_operands

# A pass of generated tokens with at most this many rows is a decode step: its matmuls are
# matrix-vector products bound by how many weight bytes they read. (Prompt tokens never take the
# decode path, however few: see Projection.)
DECODE_ROWS = 8
# Without a prefill copy, passes up to this many rows read the decode weights too: a speculative
# verify batch (4 sequences x 5 tokens = 20 rows) or a short chunk reads the blocks in passes of
# 8 rows, which beats one float32 GEMM up to ~24 rows (SmolLM2's layer at 20 rows: 1.41 vs 1.55
# ms, AVX-512 VM). Where a native bf16 prefill copy exists its GEMM wins beyond 8 rows (0.79 ms).
VERIFY_ROWS = 24

# What decode steps read (``--decode-weight-dtype``). "auto": exact 4/8-bit blocks through the
# native kernels where a matrix is block-exact (GGUF Q4_1/Q8_0 values in float32), else the
# loaded weights; "same": the loaded weights through torch; a dtype name: a (lossy) copy.
DECODE_WEIGHTS = ("auto", "same", "bfloat16")
# What decode passes multiply GGUF blocks with (``--decode-activations``, resolved by
# :func:`hicache.device.resolve_decode_activations`): exact float32 inputs, or inputs quantized
# to 8 bits per 32 (``kernels/gguf_int8.cpp``).
DECODE_ACTIVATIONS = ("float32", "int8")
# What passes of more than DECODE_ROWS rows (prefill) read (``--prefill-weight-dtype``,
# resolved by :func:`hicache.device.resolve_prefill_weights`): the loaded weights, or a (lossy)
# bf16 copy where the CPU multiplies bf16 natively and the model is float32.
PREFILL_WEIGHTS = ("same", "bfloat16")
# A prompt pass (and, under deterministic inference, any dense float32 pass) of fewer rows runs as
# a GEMM of this many (zero rows added). BLAS picks its kernel by the number of rows -- one row is
# a matrix-vector product, a few rows another kernel -- but from 16 rows on, every row of MKL's sgemm gets the same bits
# whatever the row count and its place in the batch (:func:`dense_rows_invariant` checks this
# CPU's BLAS at start-up).
INVARIANT_MIN_ROWS = 16


class Projection:
    """One or more weight matrices that read the same input (``q_proj``/``k_proj``/``v_proj``,
    ``gate_proj``/``up_proj``), run as one GEMM: one kernel and one pass over the input.

    The parts (``nn.Linear``, or the tied embedding as LM head) stay the model's parameters, so
    loaders, TP sharding and checkpoints see them by name. On first use -- and again whenever a
    part's weight was replaced or moved (a TP shard, ``.to(device)``) -- several parts are
    concatenated once and each part's weight becomes a view of the concatenation: memory is not
    doubled, and an in-place load reaches both.

    ``decode_weights`` (one of :data:`DECODE_WEIGHTS`, set by
    :meth:`LlamaForCausalLM.set_weights`): passes of generated tokens (decode, verify) of
    at most :attr:`decode_rows` rows read exact blocks or a dtype copy when there is one.
    ``prefill_weights`` (one of :data:`PREFILL_WEIGHTS`): every other pass -- prompt tokens
    whatever their count, larger decode batches -- reads the fused originals, or a dtype copy
    (inputs cast to it, outputs back to the input's dtype). A prompt row never meets the decode
    arithmetic (issue 57: a hit leaving a few tokens to compute must compute them as the cold
    prompt did), except under ``row_invariant``, where every row takes the one decode path.
    """

    def __init__(self, *parts: Union[nn.Linear, nn.Embedding]) -> None:
        self.parts = parts
        self.decode_weights = "same"
        # deterministic inference: every pass, whatever its rows, reads one path whose per-row
        # result does not depend on the row count (blocks, or dense GEMMs of >= 16 rows)
        self.row_invariant = False
        self.decode_activations = "float32"  # or "int8": GGUF blocks multiply 8-bit inputs
        self.prefill_weights = "same"
        self._weight: Optional[torch.Tensor] = None
        self._prefill_weight: Optional[torch.Tensor] = None  # a dtype copy for large passes
        self._bias: Optional[torch.Tensor] = None
        self._decode_weight: Optional[torch.Tensor] = None  # a dtype copy
        self._blocks: list[Block] = []  # exact blocks, run by the native kernels (model/decode_blocks.py)
        self._sizes: list[int] = []
        self._key: tuple = ()

    def __call__(self, x: torch.Tensor, generated: bool) -> Union[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``x @ W.T (+ b)``; split per part when there are several. ``generated``: the rows are
        generated tokens (``ForwardBatch.generated``), which may read the decode weights."""
        out = self.whole(x, generated)
        return out if len(self.parts) == 1 else out.split(self._sizes, dim=-1)

    def whole(self, x: torch.Tensor, generated: bool) -> torch.Tensor:
        """``x @ W.T (+ b)`` with the parts' outputs side by side (not split); ``generated`` as in
        :meth:`__call__`."""
        self.prepare()
        if (generated or self.row_invariant) and 0 < x.shape[0] <= self._decode_rows():
            if self._blocks:
                out = blocks_linear(self._blocks, x.contiguous(), cpu_kernels())
                return out if self._bias is None else out + self._bias
            if self._decode_weight is not None:
                return _linear_in(self._decode_weight, x, self._bias)
        elif self._prefill_weight is not None:
            return _linear_in(self._prefill_weight, x, self._bias)
        if self.row_invariant or not generated:
            # A prompt pass of a few rows (a hit leaving a few tokens) gets the bits the cold
            # prompt's longer pass gave those rows (issue 57); a large decode batch needs no padding.
            return invariant_linear(x, self._weight, self._bias)
        return F.linear(x, self._weight, self._bias)

    @property
    def decode_rows(self) -> int:
        """Passes of generated tokens of at most this many rows read the decode weights (see
        :data:`VERIFY_ROWS`)."""
        self.prepare()
        return self._decode_rows()

    def _decode_rows(self) -> int:  # once prepared: every pass asks, so no second freshness check
        if self.row_invariant:
            return sys.maxsize  # one path for a row whatever shares its pass
        return DECODE_ROWS if self._prefill_weight is not None else VERIFY_ROWS

    def native_decode(self) -> Optional[list[tuple[int, int, tuple[torch.Tensor, ...]]]]:
        """What a decode pass reads, for the fused native layer (``kernels/decode_layer.cpp``): per
        block matrix (outputs side by side) ``(kind, ggml type, tensors)``, or the float32 matrix
        as kind 0; None where a decode pass here is not a native kernel (a dtype copy, not a
        float32 CPU matrix)."""
        self.prepare()
        if self._blocks:
            return [native_operands(b) for b in self._blocks]
        if (self._decode_weight is None and self._weight.dtype == torch.float32 and self._weight.device.type == "cpu"
                and not self.row_invariant):  # the fused layer's GEMM is not padded (invariant_linear)
            return [(KIND_DENSE, 0, (self._weight,))]
        return None

    @property
    def bias(self) -> Optional[torch.Tensor]:
        """The fused bias (the parts' side by side), or None."""
        self.prepare()
        return self._bias

    @property
    def decode_format(self) -> str:
        """What decode passes read: block types ("q4"/"q8" exact blocks, "q5_0", "q4_k+q6_k" file
        blocks of parts in two types...), a dtype copy's name, or "same"."""
        self.prepare()
        if self._blocks:
            int8 = any(getattr(b, "int8_activations", False) for b in self._blocks)
            return "+".join(dict.fromkeys(b.kind for b in self._blocks)) + ("@int8" if int8 else "")
        if self._decode_weight is not None:
            return str(self._decode_weight.dtype).removeprefix("torch.")
        return "same"

    @property
    def prefill_format(self) -> str:
        """What prefill passes read: a dtype copy's name, or "same"."""
        return "same" if self._prefill_weight is None else str(self._prefill_weight.dtype).removeprefix("torch.")

    def copies_nbytes(self) -> int:
        """Bytes of the decode and prefill copies (beside the loaded weights)."""
        copies = [c.nbytes for c in (self._decode_weight, self._prefill_weight) if c is not None]
        return sum(copies) + sum(b.resident_nbytes for b in self._blocks)

    @property
    def prepared(self) -> bool:
        """Whether the fused matrix (and decode copy) match the parts as they are now."""
        return self._key == self._current_key()

    def prepare(self) -> tuple:
        """Fuse now if the parts changed (a load, a shard, a move, a new decode dtype); a model
        does it before its KV pool is sized, so the decode copy is counted in the budget.
        Returns a key that changes whenever the fused weights are rebuilt."""
        if not self.prepared:
            self._fuse()
        return self._key

    def settings(self) -> tuple:
        """What decides the decode and prefill copies besides the weights (part of the fused key)."""
        return self.decode_weights, self.decode_activations, self.prefill_weights, self.row_invariant

    def _current_key(self) -> tuple:
        # Every pass asks (a decode step: 121 projections): read the parameters straight from the
        # modules' tables, not through nn.Module.__getattr__ (half of this check's cost).
        return (*self.settings(), *(p._parameters["weight"].data_ptr() for p in self.parts))

    def _fuse(self) -> None:
        with torch.inference_mode(False), torch.no_grad():  # real tensors: a later load may write them
            self._sizes = [p.weight.shape[0] for p in self.parts]
            for attr in ("weight", "bias"):  # (an embedding part has no bias)
                tensors = [getattr(p, attr, None) for p in self.parts]
                fused = tensors[0] if len(tensors) == 1 or tensors[0] is None else torch.cat(tensors)
                if len(tensors) > 1 and fused is not None:
                    for p, view in zip(self.parts, fused.split(self._sizes)):
                        setattr(p, attr, nn.Parameter(view, requires_grad=False))
                setattr(self, f"_{attr}", fused)
            self._decode_weight, self._prefill_weight = self._copy(self.decode_weights), self._copy(self.prefill_weights)
            native = self.decode_weights == "auto" and self._weight.device.type == "cpu" and cpu_kernels() is not None
            self._blocks = decode_blocks(self.parts, self._weight, cpu_kernels(),
                                         int8_activations=self.decode_activations == "int8") if native else []
        self._key = self._current_key()

    def _copy(self, mode: str) -> Optional[torch.Tensor]:
        """The fused weight as a copy in dtype ``mode``; None for "same", "auto" and the weight's own dtype."""
        dtype = self._weight.dtype if mode in ("same", "auto") else getattr(torch, mode)
        return None if dtype == self._weight.dtype else self._weight.to(dtype)


def _linear_in(weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in ``weight``'s dtype, returned in ``x``'s."""
    dtype = weight.dtype
    return F.linear(x.to(dtype), weight, None if bias is None else bias.to(dtype)).to(x.dtype)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear`` whose every row has the same bits whatever the number of rows: fewer than
    :data:`INVARIANT_MIN_ROWS` rows are padded with zero rows to that many."""
    rows = x.shape[0]
    if rows >= INVARIANT_MIN_ROWS:
        return F.linear(x, weight, bias)
    return F.linear(F.pad(x, (0, 0, 0, INVARIANT_MIN_ROWS - rows)), weight, bias)[:rows]  # zero rows below x's


@functools.lru_cache(maxsize=1)
def dense_rows_invariant() -> bool:
    """Whether this CPU's BLAS gives :func:`invariant_linear` the same bits for a row at any row
    count and place (the premise of deterministic inference on dense float32 weights)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 320, generator=gen)
    x = torch.randn(80, 320, generator=gen)
    reference = invariant_linear(x, weight, None)
    return all(torch.equal(invariant_linear(x[start:start + rows], weight, None), reference[start:start + rows])
               for start, rows in ((0, 1), (3, 1), (5, 7), (0, 16), (9, 17), (2, 63)))
