"""Where a CPU step goes, side by side in one run: weight formats for decode GEMVs, a decode
step split into its matmuls and the rest, and a cached turn against its new tokens alone, each
next to the limit the machine sets (memory bandwidth for decode, FLOPs for attention).

    python benchmarks/bench_cpu.py [--context 4096] [--suffix 64] [--repeats 5]

Prints the CPU model and flags first: every figure depends on them (bf16 is native only with
AVX512-BF16 or AMX; elsewhere it is emulated).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from hicache.config import PassPrecision  # noqa: E402
from hicache.device import cpu_description, resolve_decode_activations  # noqa: E402
from hicache.kernels import cpu_kernels, loaded_isa, unavailable_reason  # noqa: E402
from hicache.model import DenseKV, load_model, make_forward_batch, paged  # noqa: E402
from hicache.model.block_quant import BlockQuantWeight, pack_exact  # noqa: E402
from hicache.model.gguf_blocks import GGUF_BLOCK_TYPES, GGUFBlockWeight  # noqa: E402
from hicache.model.projection import DECODE_ACTIVATIONS, DECODE_WEIGHTS  # noqa: E402


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def read_bandwidth(repeats: int) -> float:
    """GB/s of a plain reduction over 256 MiB: the rate a bandwidth-bound GEMV can approach."""
    data = torch.randn(64 * 1024 * 1024)
    return data.numel() * 4 / median_ms(data.sum, repeats) / 1e6


def _int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights with one scale per output row (torch's ``_weight_int8pack_mm`` layout)."""
    scale = w.abs().amax(1).clamp_min(1e-8) / 127
    return (w / scale[:, None]).round().to(torch.int8), scale


def _int4_g32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU int4 layout, groups of 32 along K (scale and zero per group), as a Q4_1 file holds."""
    out_f, in_f = w.shape
    groups = w.view(out_f, in_f // 32, 32)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low).clamp_min(1e-8) / 15
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(out_f, in_f)
    scales_zeros = torch.stack([scale.t(), (low + 8 * scale).t()], -1).contiguous()
    return torch._convert_weight_to_int4pack_for_cpu(q, 1), scales_zeros


def _gguf_blocks(w: torch.Tensor) -> BlockQuantWeight:
    packed = pack_exact(w)
    if packed is None or cpu_kernels() is None:
        raise RuntimeError(f"no exact block copy ({unavailable_reason() or 'weights not block-exact'})")
    return packed


def bench_formats(model, repeats: int, bandwidth: float) -> None:
    """One decode step's matmuls over the real weight shapes, every layer (so weights come from
    memory, not cache), in each format torch offers on CPU, and the native kernels'; then GGUF's
    block types as the file stores them (:func:`bench_gguf_blocks`)."""
    mats = [w for name, w in model.named_parameters() if w.dim() == 2 and "embed" not in name]
    mats.append(model.head.parts[0].weight)
    formats: dict[str, tuple[Callable, Callable, float]] = {
        "float32 (exact)": (lambda w: w, lambda a, w: F.linear(a, w), 4),
        "bfloat16 (lossy)": (lambda w: w.bfloat16(), lambda a, w: F.linear(a.bfloat16(), w), 2),
        "int8 per-channel (lossy)": (_int8_per_channel, lambda a, w: torch._weight_int8pack_mm(a, w[0], w[1]), 1),
        "int4 g32 (= Q4_1)": (_int4_g32, lambda a, w: torch._weight_int4pack_mm_for_cpu(a, w[0], 32, w[1]), 0.5625),
        # The GGUF's own Q4_1/Q8_0 blocks through hicache's AVX2 kernels (what decode uses).
        "GGUF blocks, native (exact)": (_gguf_blocks, lambda a, w: w.linear(a, cpu_kernels()), 0.0),
    }
    params = sum(w.numel() for w in mats)
    print(f"\n== decode GEMVs, batch 1: {len(mats)} matrices, {params / 1e6:.0f} M weights ==")
    _format_table(formats, mats, repeats, bandwidth)
    bench_gguf_blocks(repeats, bandwidth)
    bench_int8_layouts(repeats)


def _format_table(formats: dict[str, tuple[Callable, Callable, float]], mats: list[torch.Tensor], repeats: int,
                  bandwidth: float) -> None:
    """One row per format: every matrix once at batch 1 (bytes_per weight, or 0: the copies' nbytes)."""
    x = {w.shape[1]: torch.randn(1, w.shape[1]) for w in mats}
    params = sum(w.numel() for w in mats)
    print(f"{'format':>26} {'ms/step':>8} {'MB read':>8} {'GB/s':>6} {'floor ms':>9} {'vs float32':>10}")
    base = None
    for name, (make, run, bytes_per) in formats.items():
        try:
            packed = [make(w.float()) for w in mats]
        except RuntimeError as e:  # a kernel this build lacks
            print(f"{name:>26}  unavailable: {str(e).splitlines()[0][:60]}")
            continue
        ms = median_ms(lambda: [run(x[w.shape[1]], p) for w, p in zip(mats, packed)], repeats)
        base = base or ms
        mb = (params * bytes_per if bytes_per else sum(p.nbytes for p in packed)) / 1e6
        print(f"{name:>26} {ms:>8.1f} {mb:>8.0f} {mb / ms:>6.1f} {mb / bandwidth:>9.1f} {base / ms:>9.2f}x")


GGUF_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
K_QUANT_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # their float16 d / dmin, bytes into a block


def _gguf_raw(name: str, int8_activations: bool = False) -> Callable[[torch.Tensor], GGUFBlockWeight]:
    """Makes w's blocks in GGUF type ``name``: gguf.quants.quantize's where it writes the type, else
    random bytes with finite scales (it writes no K-quants; the GEMV's speed does not depend on values);
    ``int8_activations``: multiplied with 8-bit inputs (``--decode-activations int8``)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[name]

    def make(w: torch.Tensor) -> GGUFBlockWeight:
        if cpu_kernels() is None:
            raise RuntimeError(f"no native kernels ({unavailable_reason()})")
        if name not in K_QUANT_SCALES:
            data = torch.from_numpy(gguf.quants.quantize(w.numpy(), qtype))
        else:
            _, size, nbytes = GGUF_BLOCK_TYPES[int(qtype)]
            data = torch.randint(0, 256, (w.shape[0], w.shape[1] // size, nbytes), dtype=torch.uint8)
            for offset in K_QUANT_SCALES[name]:
                data[..., offset:offset + 2] = torch.tensor([0x00, 0x20], dtype=torch.uint8)  # float16 2**-7
        return GGUFBlockWeight(int(qtype), data.view(w.shape[0], -1), w.shape[1], int8_activations)

    return make


def bench_gguf_blocks(repeats: int, bandwidth: float, count: int = 48, size: int = 1536) -> None:
    """GGUF's block types read as the file stores them (``gguf_linear``), batch 1, beside float32
    and bfloat16, over ``count`` size x size matrices: the K-quants need K % 256 == 0 (SmolLM2's 576
    is not), and 48 of them outgrow a 32 MiB L3 in every type, so the blocks come from memory."""
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(size, size, generator=g) * 0.02 for _ in range(count)]
    formats: dict[str, tuple[Callable, Callable, float]] = {
        "float32 (exact)": (lambda w: w, lambda a, w: F.linear(a, w), 4),
        "bfloat16 (lossy)": (lambda w: w.bfloat16(), lambda a, w: F.linear(a.bfloat16(), w), 2),
        **{f"GGUF {name}{inputs}": (_gguf_raw(name, int8), lambda a, w: w.linear(a, cpu_kernels()), 0.0)
           for name in GGUF_TYPES for int8, inputs in ((False, " (as stored)"), (True, " x int8 inputs"))},
    }
    print(f"\n== GGUF blocks as stored, batch 1: {count} matrices {size}x{size}, {count * size * size / 1e6:.0f} M "
          f"weights, kernels: {loaded_isa() or 'off'} ==")
    _format_table(formats, mats, repeats, bandwidth)


def bench_int8_layouts(repeats: int, count: int = 64, shape: tuple[int, int] = (576, 1536)) -> None:
    """8-bit-input GEMVs of the types packed 16 rows at a time (``kernels/gguf_x16.cpp``) against the
    row-by-row kernel (``gguf_int8.cpp``) on the same blocks, at the row counts of a decode step, a batch
    of 4 and a verify pass; ``count`` SmolLM2-sized matrices, so the blocks come from memory."""
    import gguf

    ops = cpu_kernels()
    if ops is None:
        print(f"\n== 8-bit GEMV layouts: no native kernels ({unavailable_reason()}) ==")
        return
    n, k = shape
    print(f"\n== 8-bit-input GEMVs, {count} matrices {n}x{k}, kernels: {loaded_isa()}: row by row vs 16 rows packed ==")
    print(f"{'type':>6} {'rows':>4} {'row by row ms':>14} {'GB/s':>6} {'packed ms':>10} {'GB/s':>6} {'speed-up':>8}")
    rng = torch.Generator().manual_seed(0)
    for name in ("Q4_0", "Q4_1", "Q8_0"):
        qtype = gguf.GGMLQuantizationType[name]
        mats = [torch.from_numpy(gguf.quants.quantize((torch.randn(n, k, generator=rng) * 0.02).numpy(), qtype))
                for _ in range(count)]
        packs = [ops.gguf_pack_x16(m, int(qtype), k) for m in mats]
        gb = sum(m.numel() for m in mats) / 1e9
        for rows in (1, 4, 8):
            x = torch.randn(rows, k, generator=rng)
            old = median_ms(lambda: [ops.gguf_linear_int8(x, m, int(qtype), k) for m in mats], repeats)
            new = median_ms(lambda: [ops.gguf_linear_x16(x, p, int(qtype), k) for p in packs], repeats)
            print(f"{name:>6} {rows:>4} {old:>14.2f} {gb / old * 1e3:>6.1f} {new:>10.2f} {gb / new * 1e3:>6.1f} "
                  f"{old / new:>7.2f}x")


MATMUL_OPS = {"hicache::gguf_linear", "hicache::gguf_linear_int8", "hicache::gguf_linear_x16", "hicache::q4_linear",
              "hicache::q8_linear", "hicache::quantize_int8_rows", "aten::mm", "aten::addmm", "aten::bmm"}


def bench_steps(loaded, context: int, suffix: int, repeats: int) -> None:
    model, spec = loaded.model, loaded.spec
    kv = DenseKV(spec, context + 2 * suffix + 8, model.dtype)
    slots = torch.arange(1, context + 2 * suffix + 2)
    ids = torch.randint(1000, 30000, (context + suffix,), generator=torch.Generator().manual_seed(0)).tolist()

    def forward(new, prefix, ctx_slots):
        with torch.inference_mode():
            return model(make_forward_batch([new], [prefix], [ctx_slots]), kv)

    forward(ids[:context], 0, slots[:context])
    alone = median_ms(lambda: forward(ids[context:], 0, slots[context + 1: context + 1 + suffix]), repeats)
    cached = median_ms(lambda: forward(ids[context:], context, slots[: context + suffix]), repeats)
    weight_macs = sum(w.numel() for n, w in model.named_parameters() if w.dim() == 2 and "embed" not in n)
    attn_macs = 2 * spec.num_heads * spec.head_dim * context  # QK^T and PV, per new token per layer
    floor = 1 + attn_macs * spec.num_layers / weight_macs
    print(f"\n== cached turn: {suffix} new tokens after {context} cached vs the {suffix} alone ==")
    print(f"  alone {alone:.0f} ms, cached {cached:.0f} ms: {cached / alone:.2f}x "
          f"(FLOP floor {floor:.2f}x at equal efficiency: attention to {context} keys is {floor - 1:.2f}x "
          "the weights' MACs)")

    decode = median_ms(lambda: forward([ids[context]], context, slots[: context + 1]), repeats)
    # Split by the profiler's shares of op time: the layers of a decode step run inside one native call
    # (model/decode_stack.py), which calls the same matmul and attention ops through the dispatcher.
    steps = max(3, repeats)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            forward([ids[context]], context, slots[: context + 1])
    self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    share = decode / max(1e-9, sum(self_us.values()))  # the profiled step's op times, scaled to the step's time
    matmul = share * sum(us for op, us in self_us.items() if op in MATMUL_OPS)
    attention = share * self_us.get("hicache::paged_decode_attention", 0.0)
    formats = ", ".join(f"{fmt} x{n}" for fmt, n in sorted(model.decode_formats().items()))
    print(f"\n== decode step, batch 1, context {context} (decode weights: {formats}) ==")
    print(f"  {decode:.1f} ms/token ({1e3 / decode:.1f} tok/s), split by the profiler's shares: "
          f"weight matmuls {matmul:.1f} ms, decode attention {attention:.1f} ms, the rest (norms, RoPE, KV writes, dispatch) "
          f"{max(0.0, decode - matmul - attention):.1f} ms")


def bench_verify(loaded, context: int, repeats: int, rows: tuple[int, ...] = (2, 4, 8)) -> None:
    """A verify pass (the last token + drafts, logits at every row) vs a decode step at ``context``:
    row by row through the decode path (every row a decode row over its own causal context), and as
    the causal span a prompt chunk takes (what verify passes ran before)."""
    model, spec = loaded.model, loaded.spec
    kv = DenseKV(spec, context + 16, model.dtype)
    slots = torch.arange(1, context + 16)
    ids = torch.randint(1000, 30000, (context + 16,), generator=torch.Generator().manual_seed(1)).tolist()

    def forward(n):
        with torch.inference_mode():
            return model(make_forward_batch([ids[context:context + n]], [context], [slots[: context + n]],
                                            logits="all"), kv)

    forward(1)
    with torch.inference_mode():
        model(make_forward_batch([ids[:context]], [0], [slots[:context]]), kv)
    decode = median_ms(lambda: forward(1), repeats)
    print(f"\n== verify pass vs decode step, batch 1, context {context}: decode step {decode:.1f} ms ==")
    for n in rows:
        rowwise = median_ms(lambda: forward(n), repeats)
        saved, paged.ROWWISE_MAX_NEW = paged.ROWWISE_MAX_NEW, 0
        try:
            spans = median_ms(lambda: forward(n), repeats)
        finally:
            paged.ROWWISE_MAX_NEW = saved
        print(f"  {n} tokens: row by row {rowwise:.1f} ms ({rowwise / decode:.2f}x a decode step), "
              f"as a causal span {spans:.1f} ms ({spans / decode:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--verify-context", type=int, default=1024, help="context of the verify-pass part")
    ap.add_argument("--only", choices=("formats", "steps", "verify"), default=None, help="run one part")
    ap.add_argument("--decode-weights", default="auto", choices=DECODE_WEIGHTS,
                    help="what the decode-step part reads (the engine's --decode-weight-dtype)")
    ap.add_argument("--decode-activations", default="auto", choices=("auto", *DECODE_ACTIVATIONS),
                    help="what GGUF blocks meet in decode and verify passes (the engine's --decode-activations; "
                         "auto: what the engine picks here for float32 weights)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    activations, why = resolve_decode_activations(args.decode_activations, "auto", args.dtype, torch.device("cpu"))
    print(cpu_description(), f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"decode activations {activations} ({why})")
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype),
                        precision=PassPrecision(decode_weights=args.decode_weights, decode_activations=activations))
    if args.only in (None, "formats"):
        bandwidth = read_bandwidth(args.repeats)
        print(f"read bandwidth (sum over 256 MiB): {bandwidth:.1f} GB/s")
        bench_formats(loaded.model, args.repeats, bandwidth)
    if args.only in (None, "steps"):
        bench_steps(loaded, args.context, args.suffix, args.repeats)
    if args.only in (None, "verify"):
        bench_verify(loaded, args.verify_context, args.repeats)


if __name__ == "__main__":
    main()
