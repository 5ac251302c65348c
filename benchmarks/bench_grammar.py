"""Grammar overhead per decode step, side by side in one run: the same greedy request plain, under a
JSON schema with its masks computed during the forward (overlap, the default), and after it.

    .venv/bin/python benchmarks/bench_grammar.py [--model smollm2] [--tokens 64] [--repeats 3]

Prints ms per output token (median of the repeats) and the ratio to plain, and each arm's TTFT with
its prompt cached (every run after the warm-up hits it); also checks that the schema request's
output parses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from hicache import Engine
from hicache.runtime.grammar import GrammarMode
from hicache.runtime.sampling import GrammarSpec, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
    "population": {"type": "integer"}, "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                                      "maxItems": 4}},
    "required": ["city", "country", "population", "landmarks"], "additionalProperties": False}


def per_token_ms(engine: Engine, prompt: str, sampling: SamplingParams) -> tuple[float, str, float]:
    """Decode ms per output token after the first, the text, and TTFT ms (the prompt is cached
    after the first run)."""
    res = engine.chat([{"role": "user", "content": prompt}], sampling)
    decode = res.e2e_s - res.ttft_s
    return 1000 * decode / max(1, res.completion_tokens - 1), res.text, 1000 * res.ttft_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    engine = Engine(args.model, max_total_tokens=4096)
    mode = next(m for m in engine.backend.core.scheduler.modes if isinstance(m, GrammarMode))
    prompt = "Describe Paris as JSON with the city, its country, its population and a few landmarks."
    plain = SamplingParams(max_new_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    schema = SamplingParams(max_new_tokens=args.tokens, temperature=0.0,
                            grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    runs: dict[str, list[float]] = {"plain": [], "schema, overlapped": [], "schema, after the forward": []}
    ttft: dict[str, list[float]] = {name: [] for name in runs}
    text = ""
    per_token_ms(engine, prompt, plain)  # warm-up: caches the prompt, compiles nothing yet
    t = time.perf_counter()
    per_token_ms(engine, prompt, schema)
    compile_s = time.perf_counter() - t
    for _ in range(args.repeats):
        for name, sampling, overlap in (("plain", plain, True), ("schema, overlapped", schema, True),
                                        ("schema, after the forward", schema, False)):
            mode.overlap = overlap
            ms, out, first = per_token_ms(engine, prompt, sampling)
            runs[name].append(ms)
            ttft[name].append(first)
            text = out if sampling is schema else text
    engine.shutdown()
    base = statistics.median(runs["plain"])
    print(f"model {args.model}, {args.tokens} tokens, median of {args.repeats}; first schema request "
          f"(compile + run) {compile_s:.2f} s")
    for name, values in runs.items():
        ms = statistics.median(values)
        print(f"  {name:28s} {ms:6.2f} ms/token  {ms / base:.2f}x plain   TTFT (prompt cached) "
              f"{statistics.median(ttft[name]):6.1f} ms")
    try:
        json.loads(text)
        print(f"  schema output parses: {text[:100]}")
    except json.JSONDecodeError:
        print(f"  schema output cut by --tokens (a prefix of valid JSON): {text[:100]}")


if __name__ == "__main__":
    main()
