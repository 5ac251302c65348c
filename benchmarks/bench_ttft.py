"""TTFT with vs. without an L1 prefix hit, decode throughput, and scheduler overhead, on the
embedded SmolLM2 (bf16), all measured side by side in one run.

    python benchmarks/bench_ttft.py [--prefix 1024 4096] [--suffix 64] [--repeats 2]

For each K: cold TTFT of K+S tokens, warm TTFT with the first K tokens cached, the model's own
time for that warm forward (the S new tokens attending to all K+S), and the TTFT of the S tokens
as a prompt of their own (no prefix to attend to). Then decode tokens/s at batch 1 and 16,
and the share of a batch-16 decode step spent outside the model forward (scheduler overhead).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from hicache import Engine, SamplingParams  # noqa: E402

ONE = SamplingParams(max_new_tokens=1, temperature=0.0)


def ttft(engine: Engine, ids: list[int]) -> float:
    return engine.generate([ids], ONE)[0].ttft_s


def timed_model(engine: Engine) -> list[float]:
    """Wrap the model so each forward's wall time is appended to the returned list."""
    times: list[float] = []
    model = engine.runner.model

    def run(*a):
        t = time.perf_counter()
        out = model(*a)
        times.append(time.perf_counter() - t)
        return out

    engine.runner.model = run
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefix", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    args = ap.parse_args()

    engine = Engine(args.model, max_total_tokens=max(args.prefix) * 4 + 16 * 256, page_size=16)
    rng = np.random.default_rng(0)
    vocab = engine.loaded.spec.vocab_size
    print(f"model={args.model} dtype={engine.config.dtype} threads={__import__('torch').get_num_threads()} "
          f"page={engine.config.page_size}")
    # warm/model: the warm TTFT over the model's own time for that suffix (attention over the
    # cached prefix included) - what the cache machinery adds on top of the unavoidable compute.
    print(f"{'cached K':>9} {'suffix':>6} {'cold ms':>9} {'warm ms':>9} {'model ms':>9} {'suffix-only ms':>14} "
          f"{'cold/warm':>9} {'warm/model':>10}")
    ttft(engine, rng.integers(100, vocab, 64).tolist())  # warm up kernels
    model_times = timed_model(engine)
    for k in args.prefix:
        cold, warm, model, alone = [], [], [], []
        for _ in range(args.repeats):
            prefix = rng.integers(100, vocab, k).tolist()
            suffix = rng.integers(100, vocab, args.suffix).tolist()
            engine.flush_cache()
            cold.append(ttft(engine, prefix + suffix))
            engine.flush_cache()
            engine.generate([prefix + [1]], ONE)  # caches the K-token prefix (whole pages)
            model_times.clear()
            warm.append(ttft(engine, prefix + suffix))
            model.append(model_times[0])
            engine.flush_cache()
            alone.append(ttft(engine, suffix))
        c, w, m, a = (statistics.median(x) for x in (cold, warm, model, alone))
        print(f"{k:>9} {args.suffix:>6} {c * 1e3:>9.1f} {w * 1e3:>9.1f} {m * 1e3:>9.1f} {a * 1e3:>14.1f} "
              f"{c / w:>9.1f} {w / m:>10.2f}")
    engine.runner.model = engine.loaded.model

    print(f"\n{'batch':>5} {'decode tok/s':>12} {'step ms':>8} {'model ms':>10} {'scheduler overhead':>18}")
    for bsz in (1, 16):
        engine.flush_cache()
        prompts = [rng.integers(100, vocab, 128).tolist() for _ in range(bsz)]
        sp = SamplingParams(max_new_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
        forward_time = [0.0]
        model = engine.runner.model

        def model_only(*a, _model=model):  # the model alone: batch building and sampling are overhead
            t = time.perf_counter()
            out = _model(*a)
            forward_time[0] += time.perf_counter() - t
            return out

        engine.runner.model = model_only
        for req in prompts:  # prefill outside the measured window
            engine.scheduler.add(engine._make_request(req, sp, None))
        while any(r.status.value != "decode" for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.scheduler.step()
        forward_time[0] = 0.0
        steps, t0 = 0, time.perf_counter()
        while engine.scheduler.has_work():
            engine.scheduler.step()
            steps += 1
        wall = time.perf_counter() - t0
        engine.runner.model = model
        tokens = bsz * (args.decode_tokens - 1)
        print(f"{bsz:>5} {tokens / wall:>12.1f} {wall / steps * 1e3:>8.1f} {forward_time[0] / steps * 1e3:>10.1f} "
              f"{(wall - forward_time[0]) / wall:>17.1%}")


if __name__ == "__main__":
    main()
