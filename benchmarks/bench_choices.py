"""``n`` choices of one prompt vs the same number of separate requests, side by side in one run:
prompt tokens the forward computed and wall time, each on a fresh prompt (a new cache salt).

    .venv/bin/python benchmarks/bench_choices.py [--model smollm2] [--prompt-tokens 1024] [--n 4]

``n`` choices share the prompt's pages (one prefill, then each sibling computes the last partial
page); separate requests arriving together each compute the whole prompt.
"""

from __future__ import annotations

import argparse
import time
import uuid

from hicache import Engine
from hicache.runtime.sampling import SamplingParams


def run(engine: Engine, prompt: list[int], sampling: SamplingParams, n: int, shared: bool) -> tuple[int, float]:
    """(prompt tokens computed, seconds) for ``n`` completions of ``prompt``."""
    before = engine.stats()["prefill_computed_tokens"]
    salt = uuid.uuid4().hex  # a namespace no earlier run filled: both arms start cold
    t0 = time.perf_counter()
    if shared:
        engine.generate(prompt, sampling, cache_salt=salt, n=n)
    else:
        engine.generate([prompt] * n, [sampling.for_choice(i) for i in range(n)], cache_salt=salt)
    return engine.stats()["prefill_computed_tokens"] - before, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    engine = Engine(args.model)
    words = " ".join(f"w{i}" for i in range(args.prompt_tokens))
    prompt = engine.tokenizer.encode(words)[: args.prompt_tokens]
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.8, seed=1, ignore_eos=True)
    run(engine, prompt[:64], sampling, 2, True)  # warm-up: kernels, allocator
    print(f"{args.model}: prompt {len(prompt)} tokens, {args.n} completions of {args.max_new_tokens} tokens, "
          f"page {engine.config.page_size}")
    print(f"{'arm':<22} {'computed':>9} {'seconds':>8}")
    best: dict[str, tuple[int, float]] = {}
    for _ in range(args.repeats):
        for name, shared in ((f"n={args.n}", True), (f"{args.n} separate requests", False)):
            tokens, secs = run(engine, prompt, sampling, args.n, shared)
            if name not in best or secs < best[name][1]:
                best[name] = (tokens, secs)
    for name, (tokens, secs) in best.items():
        print(f"{name:<22} {tokens:>9} {secs:>8.2f}")
    (a_tok, a_s), (b_tok, b_s) = best.values()
    print(f"n={args.n}: {b_tok / a_tok:.2f}x fewer prompt tokens computed, {b_s / a_s:.2f}x faster "
          f"(best of {args.repeats})")
    engine.shutdown()


if __name__ == "__main__":
    main()
