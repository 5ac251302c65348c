"""Native GEMVs over GGUF's quantized blocks as the file stores them: ``gguf_dequantize`` is
``gguf.quants.dequantize`` bit for bit, ``gguf_linear`` is ``x @ W.T`` up to float32 rounding, for every
supported type, on random blocks and on blocks ``gguf.quants.quantize`` made, in each instruction set."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hicache.kernels import cpu_kernels, unavailable_reason
from hicache.model.gguf_blocks import GGUF_BLOCK_TYPES, X16_TYPES, GGUFBlockWeight
from quant_blocks import linear_error, quantized_blocks, random_blocks, reference

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("machine_threads"),  # their splits over threads
              pytest.mark.skipif(unavailable_reason() is not None, reason=f"no native kernels: {unavailable_reason()}")]

QUANTIZABLE = (2, 3, 6, 7, 8)  # the types gguf.quants.quantize writes (not the K-quants)
ROWS = (1, 2, 3, 5, 8, 13, 20)  # one chunk of up to 8 rows, and several
# Float32 sums of K products round to within ~1e-7 of sum |x_k w_k|; one wrong weight of K = 256..1536
# moves a result by ~1/K of it. 1e-5 tells them apart.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def ops():
    ops = cpu_kernels()
    assert ops is not None, "the CPU can run the kernels but they did not build (see the log)"
    return ops


def shapes(qtype: int) -> list[tuple[int, int]]:
    """[N, K] pairs: SmolLM2's 576 and 1536 where the block size allows (K-quants need K % 256 == 0)."""
    return [(576, 1536), (1536, 576)] if GGUF_BLOCK_TYPES[qtype].block_size == 32 else [(576, 1536), (1536, 256)]


@functools.lru_cache(maxsize=None)
def cases(qtype: int) -> list[tuple[str, GGUFBlockWeight, torch.Tensor]]:
    """(what, the weight, gguf's dequantization of it) for each shape and source of blocks."""
    out = []
    for n, k in shapes(qtype):
        sources = {"random": random_blocks(qtype, n, k)}
        if qtype in QUANTIZABLE:
            sources["quantized"] = quantized_blocks(qtype, n, k)
        for source, blocks in sources.items():
            weight = GGUFBlockWeight(qtype, torch.from_numpy(blocks), k)
            out.append((f"{source} {n}x{k}", weight, reference(blocks, qtype)))
    return out


@pytest.mark.parametrize("qtype", list(GGUF_BLOCK_TYPES))
def test_dequantize_is_the_reference_bit_for_bit(ops, qtype):
    for what, weight, want in cases(qtype):
        got = weight.dequantize(ops)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), what


@pytest.mark.parametrize("qtype", list(GGUF_BLOCK_TYPES))
def test_linear_matches_float64_matmul_of_the_reference(ops, qtype):
    g = torch.Generator().manual_seed(qtype)
    for what, weight, w in cases(qtype):
        for m in ROWS:
            x = torch.randn(m, weight.in_features, generator=g)
            got = weight.linear(x, ops)
            assert got.shape == (m, weight.out_features)
            error = linear_error(got, x, w)
            assert error < TOLERANCE, f"{what}, {m} rows: relative error {error:.1e}"


def test_bad_operands_are_refused_with_the_reason(ops):
    blocks = torch.from_numpy(random_blocks(12, 8, 512))  # Q4_K: 2 blocks of 144 bytes per row
    x = torch.randn(2, 512)
    with pytest.raises(RuntimeError, match="unsupported ggml quantization type 10"):
        ops.gguf_linear(x, blocks, 10, 512)  # Q2_K
    with pytest.raises(RuntimeError, match="blocks must be a contiguous uint8"):
        ops.gguf_linear(x, blocks.view(torch.int8), 12, 512)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        ops.gguf_linear(x.double(), blocks, 12, 512)
    with pytest.raises(RuntimeError, match="multiple of Q4_K's block size 256, got 576"):
        ops.gguf_dequantize(blocks, 12, 576)
    with pytest.raises(RuntimeError, match="row_bytes mismatch: Q4_K rows of K = 256 take 144 bytes"):
        ops.gguf_linear(torch.randn(2, 256), blocks, 12, 256)
    with pytest.raises(RuntimeError, match="x has 256 columns, in_features"):
        ops.gguf_linear(torch.randn(2, 256), blocks, 12, 512)
    with pytest.raises(ValueError, match="uint8 \\[N, 288\\]"):
        GGUFBlockWeight(12, blocks[:, :200], 512)


def test_block_layouts_are_the_gguf_formats_own():
    """The table written out in gguf_blocks.py (so the model does not import ``gguf``) is the
    ``gguf`` package's: type codes, weights per block, bytes per block."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for code, (name, size, nbytes) in GGUF_BLOCK_TYPES.items():
        assert GGMLQuantizationType(code).name == name
        assert GGML_QUANT_SIZES[GGMLQuantizationType(code)] == (size, nbytes)


def test_weights_report_their_layout_and_fuse_by_whole_rows(ops):
    q, k = (GGUFBlockWeight(14, torch.from_numpy(random_blocks(14, n, 512, seed=n)), 512) for n in (64, 32))
    assert GGUF_BLOCK_TYPES[14] == ("Q6_K", 256, 210)
    assert (q.kind, q.out_features, q.row_bytes, q.nbytes) == ("q6_k", 64, 420, 64 * 420)
    fused = GGUFBlockWeight.cat([q, k])
    assert fused.out_features == 96
    assert torch.equal(fused.dequantize(ops), torch.cat([q.dequantize(ops), k.dequantize(ops)]))
    x = torch.randn(3, 512)
    assert torch.equal(fused.linear(x, ops), torch.cat([q.linear(x, ops), k.linear(x, ops)], dim=1))
    other = GGUFBlockWeight(12, torch.from_numpy(random_blocks(12, 8, 512)), 512)
    assert GGUFBlockWeight.cat([q, other]) is None and GGUFBlockWeight.cat([]) is None


EACH_TYPE = """
import json, torch
from hicache.kernels import cpu_kernels, loaded_isa
from hicache.model.gguf_blocks import GGUF_BLOCK_TYPES, GGUFBlockWeight
from tests.quant_blocks import linear_error, random_blocks, reference
ops, out = cpu_kernels(), {}
for qtype in GGUF_BLOCK_TYPES:
    blocks = random_blocks(qtype, 64, 1536, seed=qtype)
    weight, w = GGUFBlockWeight(qtype, torch.from_numpy(blocks), 1536), reference(blocks, qtype)
    x = torch.randn(13, 1536, generator=torch.Generator().manual_seed(qtype))
    exact = torch.equal(weight.dequantize(ops).view(torch.int32), w.view(torch.int32))
    # every row the same bits alone or in a pass of 13, float32 and 8-bit inputs
    int8 = GGUFBlockWeight(qtype, weight.data, 1536, int8_activations=True)
    alone = all(torch.equal(b.linear(x, ops), torch.cat([b.linear(x[i:i + 1], ops) for i in range(13)]))
                for b in (weight, int8))
    out[qtype] = [exact, max(linear_error(weight.linear(x[:m].contiguous(), ops), x[:m], w) for m in (1, 3, 8, 13)),
                  alone]
print(json.dumps({"isa": loaded_isa(), "out": out}))
"""


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_each_instruction_set_decodes_every_type_exactly(isa):
    """``HICACHE_KERNEL_ISA`` picks the build; both dequantize bit for bit, multiply within float32
    rounding, and give each row the same bits alone or beside others. The AVX-512 build runs only
    where the CPU has it."""
    if isa == "avx512" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip(f"this CPU lacks AVX-512 F/BW/VL/DQ (torch sees {torch.backends.cpu.get_cpu_capability()})")
    run = isa_run(isa)[0]
    assert run["isa"] == isa
    for qtype, (exact, error, alone) in run["out"].items():
        name = GGUF_BLOCK_TYPES[int(qtype)].name
        assert exact, f"{isa} {name}: dequantized weights differ from gguf's"
        assert error < TOLERANCE, f"{isa} {name}: relative error {error:.1e}"
        assert alone, f"{isa} {name}: a row's result depends on the rows beside it"


# 8-bit activations (kernels/gguf_int8.cpp): lossy by design, so checked against what they compute --
# the float64 product of the quantized inputs and the exact weights -- not against x @ W.T.
def int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x quantized per 32 values as the kernel does: int8 q, scale d = max |x| / 127, and per chunk
    d * the sum of its q, then of each half's."""
    m, k = x.shape
    chunks = x.view(m, k // 32, 32)
    top = chunks.abs().amax(-1)
    inverse = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros(()))
    q = torch.round(chunks * inverse[..., None])  # to nearest even, as the CPU rounds
    halves = q.view(m, k // 32, 2, 16).sum(-1)
    sums = torch.stack([halves.sum(-1), halves[..., 0], halves[..., 1]], -1) * (top / 127.0)[..., None]
    return q.to(torch.int8).view(m, k), top / 127.0, sums.view(m, -1)


def test_int8_inputs_are_quantized_per_32_to_nearest_even(ops):
    x = torch.randn(5, 1536, generator=torch.Generator().manual_seed(1)) * 3
    x[1, :32] = 0.0  # an all-zero chunk: scale 0, q 0
    x[2, 40] = 1e4  # an outlier takes only its own chunk's precision
    for got, want in zip(ops.quantize_int8_rows(x), int8_reference(x)):
        assert torch.equal(got, want)
    q, d, _ = ops.quantize_int8_rows(x)
    assert q.abs().max() == 127 and d[1, 0] == 0 and (q[1, :32] == 0).all()
    assert ((q.view(5, -1, 32).float() * d[..., None]).view(5, -1) - x).abs().max() <= d.max() / 2 + 1e-3


@pytest.mark.parametrize("qtype", list(GGUF_BLOCK_TYPES))
def test_int8_linear_is_the_quantized_inputs_times_the_exact_weights(ops, qtype):
    g = torch.Generator().manual_seed(100 + qtype)
    for what, weight, w in cases(qtype):
        int8 = GGUFBlockWeight(qtype, weight.data, weight.in_features, int8_activations=True)
        for m in ROWS:
            x = torch.randn(m, weight.in_features, generator=g)
            q, d, _ = int8_reference(x)
            seen = (q.view(m, -1, 32).double() * d.double()[..., None]).view(m, -1)
            got = int8.linear(x, ops)
            assert got.shape == (m, weight.out_features)
            error = linear_error(got, seen, w)
            assert error < TOLERANCE, f"{what}, {m} rows: relative error {error:.1e}"
            # and what 8-bit inputs cost against the exact product: ~1e-3 of sum |x_k w_k|
            assert 1e-5 < linear_error(got, x, w) < 1e-2



@pytest.mark.parametrize("qtype", list(GGUF_BLOCK_TYPES))
def test_each_row_is_the_same_bits_alone_or_beside_others(ops, qtype):
    """A decode step multiplies one row, a speculative verify pass several (the last token and the
    drafts, each a decode row): every row's result is the same bits either way -- float32 and 8-bit
    inputs alike, in passes of any size (chains, K segments and tiles never depend on the rows)."""
    for what, weight, _ in cases(qtype):
        x = torch.randn(13, weight.in_features, generator=torch.Generator().manual_seed(qtype))
        for int8 in (False, True):
            w = GGUFBlockWeight(qtype, weight.data, weight.in_features, int8_activations=int8)
            alone = torch.cat([w.linear(x[i:i + 1], ops) for i in range(13)])
            for m in (2, 3, 4, 5, 8, 9, 13):
                got = w.linear(x[:m].contiguous(), ops)
                assert torch.equal(got.view(torch.int32), alone[:m].view(torch.int32)), f"{what}, int8 {int8}, {m} rows"

def block_integers(blocks: np.ndarray, qtype: int, k: int) -> tuple[torch.Tensor, ...]:
    """A Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 matrix's integer weights [N, K / 32, 32], scales d [N, K / 32]
    and (Q4_1, Q5_1) offsets m, read from the bytes: Q4_0's w = d * (u - 8), Q5_0's d * (u - 16), Q4_1's and
    Q5_1's d * u + m, Q8_0's d * q."""
    b = blocks.reshape(blocks.shape[0], k // 32, -1)
    d = torch.from_numpy(b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    m = torch.from_numpy(b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    if qtype == 8:
        return torch.from_numpy(b[..., 2:].view(np.int8).astype(np.int64)), d, None
    minimum, fifth = qtype in (3, 7), qtype in (6, 7)
    qh_at = 4 if minimum else 2
    qs = b[..., qh_at + 4 * fifth:]
    u = torch.from_numpy(np.concatenate([qs & 15, qs >> 4], -1).astype(np.int64))
    if fifth:
        qh = torch.from_numpy(b[..., qh_at:qh_at + 4].copy().view(np.uint32)[..., 0].astype(np.int64))
        u = u | ((qh[..., None] >> torch.arange(32)) & 1) << 4
    return (u, d, m) if minimum else (u - (16 if fifth else 8), d, None)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c rounded once (a float64 product of float32s is exact; the float64 sum rounds to
    float32 differently from one rounding only when it lands on a float32 midpoint: ~2^-29 a time)."""
    return (a.double() * b.double() + c.double()).float()


@pytest.mark.parametrize("qtype", sorted(X16_TYPES))
def test_packed_int8_gemv_is_its_documented_arithmetic_bit_for_bit(ops, qtype):
    """kernels/gguf_x16.cpp: per chunk of 32 an exact integer dot s, then acc = fma(float(s) * d_x, d_w, acc)
    and, for Q4_1 / Q5_1, off = fma(m_w, d_x * sum q, off); out = acc + off. Pinned because the cache namespace
    (``:decode-int8v2``) promises these bits."""
    n, k = 48, 512
    blocks = random_blocks(qtype, n, k, seed=7 + qtype)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(qtype)) * 2
    got = ops.gguf_linear_x16(x, ops.gguf_pack_x16(torch.from_numpy(blocks), qtype, k), qtype, k)
    q, d_x, sums = ops.quantize_int8_rows(x)
    w, d_w, m_w = block_integers(blocks, qtype, k)
    q = q.view(5, k // 32, 32).long()
    acc = off = torch.zeros(5, n)
    for c in range(k // 32):
        s = (q[:, c] @ w[:, c].T).float()  # exact: |s| < 2^24
        acc = fma32(s * d_x[:, c:c + 1], d_w[None, :, c], acc)
        if m_w is not None:
            off = fma32(m_w[None, :, c], sums[:, 3 * c:3 * c + 1], off)
    want = acc + off if m_w is not None else acc
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_packing_refuses_what_it_cannot_pack(ops):
    blocks = torch.from_numpy(random_blocks(3, 24, 64))
    with pytest.raises(RuntimeError, match="N a multiple of 16"):
        ops.gguf_pack_x16(blocks, 3, 64)
    with pytest.raises(RuntimeError, match="16-row packing takes ggml types 2 \\(Q4_0\\)"):
        ops.gguf_pack_x16(torch.from_numpy(random_blocks(12, 16, 256)), 12, 256)
    odd = GGUFBlockWeight(3, blocks, 64, int8_activations=True).pack(ops)  # 24 rows: row by row instead
    assert odd.packed is None and odd.resident_nbytes == odd.nbytes
    even = GGUFBlockWeight(3, blocks[:16].contiguous(), 64, int8_activations=True).pack(ops)
    assert even.packed is not None and even.resident_nbytes == 2 * even.nbytes


INT8_BITS = """
import hashlib, json, torch
from hicache.kernels import cpu_kernels, loaded_isa
from hicache.model.gguf_blocks import GGUF_BLOCK_TYPES, X16_TYPES
from tests.quant_blocks import random_blocks
ops, out = cpu_kernels(), {}
for qtype in GGUF_BLOCK_TYPES:
    blocks = torch.from_numpy(random_blocks(qtype, 64, 1536, seed=qtype))
    x = torch.randn(13, 1536, generator=torch.Generator().manual_seed(qtype))
    got = [ops.gguf_linear_int8(x[:m].contiguous(), blocks, qtype, 1536) for m in (1, 3, 8, 13)]
    if qtype in X16_TYPES:  # kernels/gguf_x16.cpp: 16 lanes with VNNI, two halves of 8 without
        packed = ops.gguf_pack_x16(blocks, qtype, 1536)
        got += [ops.gguf_linear_x16(x[:m].contiguous(), packed, qtype, 1536) for m in (1, 3, 5, 13)]
    out[qtype] = hashlib.sha256(b"".join(t.numpy().tobytes() for t in got)).hexdigest()
print(json.dumps({"isa": loaded_isa(), "out": out}))
"""


@pytest.mark.slow  # a process per kernel build (shared with test_each_instruction_set_decodes_every_type_exactly)
def test_int8_products_are_the_same_bits_on_every_instruction_set():
    """The integer dots are exact and the float code after them is the same on every build, so a
    cache namespace need not name the ISA (docs/precision.md)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("one instruction set here (no AVX-512 F/BW/VL/DQ): nothing to compare")
    runs = {}
    for isa in ("avx2", "avx512"):
        runs[isa] = isa_run(isa)[1]
        assert runs[isa]["isa"] == isa
    assert runs["avx2"]["out"] == runs["avx512"]["out"]


@functools.lru_cache(maxsize=None)
def isa_run(isa: str) -> tuple[dict, dict]:
    """What EACH_TYPE and INT8_BITS print, both run by one process whose kernels are ``isa``'s build
    (each process start is seconds of imports)."""
    root = os.path.dirname(os.path.dirname(__file__))
    got = subprocess.run([sys.executable, "-c", EACH_TYPE + INT8_BITS], env={**os.environ, "HICACHE_KERNEL_ISA": isa},
                         cwd=root, capture_output=True, text=True, check=True).stdout
    each_type, int8 = (json.loads(line) for line in got.splitlines()[-2:])
    return each_type, int8
