"""Deterministic inference on a real model, side by side in one run: for the default engine and
``--enable-deterministic-inference``, how many of N greedy prompts give the bytes of the cold
one-at-a-time run when sent all at once, again with their prefixes cached, with chunked prefill
of 64, and with NGRAM speculation; and what the mode costs (prefill and decode tokens/s).

    .venv/bin/python benchmarks/bench_deterministic.py [--model smollm2] [--prompts 20] [--tokens 48]

"Identical" compares output token ids (and, with --logprobs, every token's log-probability: the
logits' bits).
"""

from __future__ import annotations

import argparse
import time

from hicache import Engine
from hicache.runtime.sampling import SamplingParams

TOPICS = ["the radix tree", "page eviction", "a host memory pool", "tensor parallelism", "speculative decoding",
          "prefill and decode disaggregation", "a storage backend", "chunked prefill", "KV cache layouts",
          "consistent hashing"]


def prompts(n: int) -> list[str]:
    system = "You are a helpful assistant who explains systems concepts clearly and briefly. " * 3
    return [f"{system}\nUser: In two sentences, what is {TOPICS[i % len(TOPICS)]}? (question {i})\nAssistant:"
            for i in range(n)]


def key(results, logprobs: bool) -> list[tuple]:
    return [(tuple(r.output_ids), tuple(e.logprob for e in r.logprobs) if logprobs else ()) for r in results]


def matrix(model: str, deterministic: bool, texts: list[str], sampling: SamplingParams, logprobs: bool) -> dict:
    """Identical outputs per scenario (of len(texts)) and the engine's speed."""
    opts = dict(enable_deterministic_inference=deterministic)
    out: dict = {}
    engine = Engine(model, disable_radix_cache=True, **opts)
    engine.generate(texts[0], sampling)  # warm-up
    t0 = time.perf_counter()
    results = [engine.generate(t, sampling)[0] for t in texts]
    elapsed = time.perf_counter() - t0
    cold = key(results, logprobs)
    prompt_tokens = sum(r.prompt_tokens for r in results)
    prefill_s = sum(r.ttft_s for r in results)
    decode_s = sum(r.e2e_s - r.ttft_s for r in results)
    decode_tokens = sum(r.completion_tokens - 1 for r in results)
    out["speed"] = (prompt_tokens / prefill_s, decode_tokens / decode_s, elapsed)
    engine.shutdown()
    for name, extra, runs in (("all at once", {}, 1), ("cached, all at once", {}, 2),
                              ("chunked prefill 64", {"chunked_prefill_size": 64}, 1),
                              ("NGRAM, all at once", {"speculative_algorithm": "NGRAM"}, 1)):
        engine = Engine(model, **opts, **extra)
        for _ in range(runs):
            got = key(engine.generate(texts, sampling), logprobs)
        engine.shutdown()
        out[name] = sum(a == b for a, b in zip(got, cold))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--logprobs", action="store_true", help="compare every token's log-probability too")
    args = ap.parse_args()
    texts = prompts(args.prompts)
    sampling = SamplingParams(max_new_tokens=args.tokens, temperature=0.0, ignore_eos=True,
                              logprobs=0 if args.logprobs else None)
    rows = {mode: matrix(args.model, mode, texts, sampling, args.logprobs) for mode in (False, True)}
    print(f"{args.model}: {args.prompts} greedy prompts x {args.tokens} tokens; identical to the cold one-at-a-time "
          f"run{' (tokens and logprobs)' if args.logprobs else ' (tokens)'}")
    print(f"{'scenario':<24} {'default':>8} {'deterministic':>14}")
    for name in ("all at once", "cached, all at once", "chunked prefill 64", "NGRAM, all at once"):
        print(f"{name:<24} {rows[False][name]:>5}/{args.prompts} {rows[True][name]:>11}/{args.prompts}")
    (p0, d0, _), (p1, d1, _) = rows[False]["speed"], rows[True]["speed"]
    print(f"prefill tok/s (cold, one at a time): default {p0:.0f}, deterministic {p1:.0f} ({p1 / p0:.2f}x)")
    print(f"decode tok/s (batch 1): default {d0:.1f}, deterministic {d1:.1f} ({d1 / d0:.2f}x)")


if __name__ == "__main__":
    main()
