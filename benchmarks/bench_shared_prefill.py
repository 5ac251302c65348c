"""Agents fanned out on shared system prompts, arriving together: the shared-prefill wait on vs off,
side by side in one run (runtime/shared_prefill.py).

    python benchmarks/bench_shared_prefill.py [--groups 2] [--per-group 2] [--system 1024] [--question 64]
                                              [--output 32] [--repeats 3] [--model smollm2]

Each repeat flushes both engines' caches and submits every prompt at once (``groups`` system prompts,
``per-group`` agents each with its own question). Printed per engine: mean TTFT, mean end-to-end
time and the prompt tokens the forward computed (``/stats prefill_computed_tokens``), medians over
repeats, and the ratios.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from hicache import Engine, SamplingParams  # noqa: E402
from hicache.device import cpu_description  # noqa: E402


def fanned_out(rng: random.Random, groups: int, per_group: int, system: int, question: int) -> list[list[int]]:
    heads = [[rng.randrange(100, 40000) for _ in range(system)] for _ in range(groups)]
    return [head + [rng.randrange(100, 40000) for _ in range(question)] for head in heads for _ in range(per_group)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--per-group", type=int, default=2)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"bench_shared_prefill: {args.model}, {args.groups} system prompts of {args.system} tokens x "
          f"{args.per_group} agents (+{args.question} tokens each), {args.output} output tokens, all at once; "
          f"{cpu_description()}")
    sampling = SamplingParams(max_new_tokens=args.output, temperature=0.0, ignore_eos=True)
    engines = {"wait (default)": Engine(args.model, max_total_tokens=16384),
               "no wait": Engine(args.model, max_total_tokens=16384, disable_shared_prefill_wait=True)}
    rows: dict[str, list[tuple[float, float, int]]] = {name: [] for name in engines}
    try:
        for rep in range(args.repeats):
            prompts = fanned_out(random.Random(rep), args.groups, args.per_group, args.system, args.question)
            for name, engine in engines.items():  # alternating: drift hits both alike
                engine.flush_cache()
                before = engine.stats()["prefill_computed_tokens"]
                results = engine.generate(prompts, sampling)
                rows[name].append((statistics.mean(r.ttft_s for r in results), statistics.mean(r.e2e_s for r in results),
                                   engine.stats()["prefill_computed_tokens"] - before))
    finally:
        for engine in engines.values():
            engine.shutdown()
    med = {name: [statistics.median(r[i] for r in runs) for i in range(3)] for name, runs in rows.items()}
    print(f"{'engine':<16}{'mean TTFT s':>12}{'mean E2E s':>12}{'prompt tokens computed':>24}   per repeat TTFT")
    for name, (ttft, e2e, computed) in med.items():
        print(f"{name:<16}{ttft:>12.2f}{e2e:>12.2f}{computed:>24.0f}   "
              + " ".join(f"{r[0]:.2f}" for r in rows[name]))
    (wt, we, wc), (nt, ne, nc) = med["wait (default)"], med["no wait"]
    print(f"wait / no wait: TTFT {wt / nt:.2f}x, E2E {we / ne:.2f}x, tokens computed {wc / nc:.2f}x")


if __name__ == "__main__":
    main()
