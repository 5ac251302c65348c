"""Quantized weights for the kernel tests (test_gguf_blocks, test_kernels), importable by their
subprocess scripts too (``from tests.quant_blocks import ...`` with the repository as cwd)."""

from __future__ import annotations

import numpy as np
import torch

from hicache.model.block_quant import GROUP
from hicache.model.gguf_blocks import GGUF_BLOCK_TYPES

# Byte offsets of each type's float16 scales (d, and m or dmin) within a block: random bytes there could
# be inf or NaN, which no quantizer writes; they get N(0, 0.01) values instead.
SCALE_OFFSETS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row_bytes] of random bytes, the float16 scales overwritten by sane finite values."""
    _, size, nbytes = GGUF_BLOCK_TYPES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scale = (rng.standard_normal((n, k // size, 1)) * 0.01).astype(np.float16)
        blocks[..., offset:offset + 2] = scale.view(np.uint8)
    return blocks.reshape(n, -1)


def quantized_blocks(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    import gguf

    weights = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.quantize(weights, gguf.GGMLQuantizationType(qtype))


def reference(blocks: np.ndarray, qtype: int) -> torch.Tensor:
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)).copy())


def linear_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """Largest |got - x @ W.T| (float64) relative to sum_k |x_k w_k|, the scale float32 rounds at."""
    want = x.double() @ w.double().T
    return ((got.double() - want).abs() / (x.double().abs() @ w.double().abs().T)).max().item()


def q4_1_matrix(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A float32 matrix as the GGUF loader makes it from Q4_1 blocks: d * q + m, d and m float16."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // GROUP, 1, generator=g) * 0.02).half().float()
    m = (-torch.rand(n, k // GROUP, 1, generator=g) * 0.1).half().float()
    q = torch.randint(0, 16, (n, k // GROUP, GROUP), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # the quantizer maps each block's minimum to 0, its maximum to 15
    return (d * q + m).reshape(n, k)


def q8_0_matrix(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // GROUP, 1, generator=g) * 0.01).half().float()
    q = torch.randint(-127, 128, (n, k // GROUP, GROUP), generator=g).float()
    q[..., 0] = 127
    return (d * q).reshape(n, k)
