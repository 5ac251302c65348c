"""Precision per phase, side by side in one run: cold prefill time and batch-1 decode speed of
SmolLM2 under each precision choice -- everything bf16 (what ``--dtype auto`` chose on a CPU
with native bf16 before), the per-phase default (``--dtype auto``: prefill from a bf16 copy
where the CPU multiplies bf16 natively, decode from the GGUF's exact blocks in float32), and
everything float32.

    python benchmarks/bench_phases.py [--prompt 1024] [--decode 64] [--repeats 3] [--threads N]

Prints the CPU model and flags first (bf16 is native only with AVX512-BF16 or AMX).
Figures are medians of ``--repeats`` runs; ratios are against the all-bf16 row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from hicache import Engine, SamplingParams  # noqa: E402
from hicache.device import cpu_description  # noqa: E402

CHOICES = [  # (label, engine options)
    ("all bfloat16 (--dtype bfloat16)", dict(dtype="bfloat16")),
    ("per phase (--dtype auto)", dict(dtype="auto")),
    ("all float32 (--dtype float32)", dict(dtype="float32")),
]


def measure(opts: dict, prompt: list[int], decode: int, repeats: int) -> dict:
    engine = Engine("smollm2", max_total_tokens=4096, disable_radix_cache=True, **opts)
    try:
        one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        many = SamplingParams(max_new_tokens=decode + 1, temperature=0.0, ignore_eos=True)
        engine.generate([prompt[:64]], one)  # warm-up
        prefill, rate, tokens = [], [], None
        for _ in range(repeats):
            start = time.perf_counter()
            engine.generate([prompt], one)
            prefill.append(time.perf_counter() - start)
            res = engine.generate([prompt[:32]], many)[0]
            rate.append(decode / (res.e2e_s - res.ttft_s))
            tokens = res.output_ids
        cfg = engine.config
        return {"prefill_ms": statistics.median(prefill) * 1e3, "decode_tok_s": statistics.median(rate),
                "tokens": tokens, "what": f"dtype={cfg.dtype} prefill-weights={cfg.prefill_weight_dtype}",
                "weights_mib": engine.loaded.model.weight_bytes() / 2**20}
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=1024, help="cold prompt tokens")
    ap.add_argument("--decode", type=int, default=64, help="decode tokens (batch 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    print(f"# bench_phases: SmolLM2, cold prefill of {args.prompt} tokens, batch-1 decode of {args.decode} tokens, "
          f"median of {args.repeats}")
    print("# " + cpu_description())
    prompt = [(i * 7919) % 40000 + 100 for i in range(args.prompt)]
    rows = [(label, measure(opts, prompt, args.decode, args.repeats)) for label, opts in CHOICES]
    base = rows[0][1]
    print(f"{'choice':34} {'resolved':42} {'weights':>8} {'prefill ms':>11} {'x':>6} {'decode tok/s':>13} {'x':>6}")
    for label, r in rows:
        print(f"{label:34} {r['what']:42} {r['weights_mib']:6.0f}Mi {r['prefill_ms']:11.0f} "
              f"{r['prefill_ms'] / base['prefill_ms']:5.2f}x {r['decode_tok_s']:13.1f} "
              f"{r['decode_tok_s'] / base['decode_tok_s']:5.2f}x")
    f32 = rows[2][1]["tokens"]
    same = sum(a == b for a, b in zip(rows[1][1]["tokens"], f32))
    print(f"# per-phase vs float32 greedy decode tokens equal: {same}/{len(f32)} "
          "(decode runs the same float32 path; the prompt's KV came from bf16 weights)")


if __name__ == "__main__":
    main()
