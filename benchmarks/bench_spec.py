"""Speculative decoding on vs off, side by side in one run, on four workloads (SmolLM2, greedy).

    python benchmarks/bench_spec.py [--repeats 5] [--workloads copy,reuse,chat,prose] [--standalone-steps 3]
                                    [--max-new-tokens 160] [--model smollm2] [--dtype auto]

Workloads, each run plain, with NGRAM and (for reference) with the STANDALONE 4-bit draft:

- ``copy``: copy-heavy agent turns -- the prompt holds a file or a JSON tool result and the
  reply must repeat most of it ("return this JSON with one field changed", "repeat this function
  with the bug fixed"); the first reply is printed so that one can check the model copies;
- ``reuse``: cross-request reuse -- agent A writes some code; agent B, in a conversation of its
  own (another system prompt: no prefix shared), asks for the same thing: B's drafts can only come
  from A's answer in the radix tree, not from B's own text;
- ``chat``: the demo's coding agent (``hicache demo``: tool output every turn), plain chat whose
  replies copy little (SmolLM2 repeats its own earlier replies there, so NGRAM still gains);
- ``prose``: open questions answered in free text, each in a conversation of its own: little to
  copy from anywhere, the no-regression case.

Every repeat flushes the cache and runs every configuration on the same prompts, alternating, so
machine drift hits all alike; figures are medians over repeats. Printed per workload and
configuration: decode tok/s (tokens after the first / time after the first), the speedup over
plain (median of the per-repeat ratios), the accept length (tokens per verify pass, the target's
own included), the mean rows of a verify pass and its cost next to a plain decode step, and
whether the outputs equal the plain run's.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from hicache import Engine, SamplingParams  # noqa: E402
from hicache.frontend.demo import SYSTEM, TASK, tool_output  # noqa: E402

CONFIG_JSON = """{
  "service": "checkout-api",
  "version": "2.14.3",
  "replicas": 4,
  "port": 8080,
  "database": {"host": "db.internal", "port": 5432, "pool_size": 20, "timeout_s": 30},
  "cache": {"backend": "valkey", "ttl_s": 600, "max_items": 100000},
  "features": {"new_cart": true, "gift_cards": false, "express_checkout": true},
  "log_level": "info"
}"""
BUGGY_FUNCTION = '''def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window + 1]
        if i >= window - 1:
            out.append(total / window)
    return out'''
COPY_TASKS = [
    f"Here is our service configuration:\n\n{CONFIG_JSON}\n\nReturn this JSON with replicas set to 6. "
    "Output only the JSON.",
    f"This function has an off-by-one bug:\n\n{BUGGY_FUNCTION}\n\nRepeat the function with the bug fixed. "
    "Output only the code.",
]
REUSE_TASK = "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces."
PROSE_QUESTIONS = [
    "Why do leaves change colour in autumn?",
    "What should I pack for a week of hiking in the mountains?",
    "Explain how a bicycle stays upright while moving.",
]


@dataclass
class Timer:
    """Wraps a function; sums its seconds, calls and rows per kind (``kind_of(args, kwargs)``)."""

    fn: object
    kind_of: object = lambda args, kw: "all"
    seconds: dict = field(default_factory=dict)
    calls: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)

    def __call__(self, *args, **kw):
        kind = self.kind_of(args, kw)
        t0 = time.perf_counter()
        out = self.fn(*args, **kw)
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - t0
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.rows[kind] = self.rows.get(kind, 0) + sum(len(ids) for ids in args[0])
        return out


def pass_kind(args: tuple, kw: dict) -> str:
    """A target pass: one token per sequence (decode), every row's logits (verify), or prefill."""
    if kw.get("logits") == "all":
        return "verify"
    return "decode" if max(len(ids) for ids in args[0]) == 1 else "prefill"


def chat_ids(engine: Engine, messages: list[dict]) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))


def workloads(engine: Engine, names: list[str], max_new: int) -> dict[str, list[list[list[int]]]]:
    """Each workload as sessions of prompts (token ids) run in order; ``reuse`` is one session of
    two agents (A's answer in the tree when B asks)."""
    out: dict[str, list[list[list[int]]]] = {}
    if "copy" in names:
        out["copy"] = [[chat_ids(engine, [{"role": "user", "content": t}])] for t in COPY_TASKS]
    if "reuse" in names:
        a = chat_ids(engine, [{"role": "system", "content": "You are a helpful assistant."},
                              {"role": "user", "content": REUSE_TASK}])
        b = chat_ids(engine, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": REUSE_TASK}])
        out["reuse"] = [[a, b]]
    if "chat" in names:
        rng, prompts = random.Random(0), []
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        for turn in range(3):
            ids = chat_ids(engine, messages)
            prompts.append(ids)
            res = engine.generate([ids], SamplingParams(max_new_tokens=48, temperature=0.0))[0]
            messages += [{"role": "assistant", "content": res.text},
                         {"role": "user", "content": f"Tool output:\n{tool_output(turn, rng)}\nWhat next?"}]
        out["chat"] = [prompts]
    if "prose" in names:
        out["prose"] = [[chat_ids(engine, [{"role": "user", "content": q}])] for q in PROSE_QUESTIONS]
    engine.flush_cache()
    return out


def run(engine: Engine, sessions: list[list[list[int]]], max_new: int, measured: str) -> dict:
    """One repeat: the sessions in order, cache flushed first. Decode figures count the measured
    requests only (``reuse``: agent B, the last of its session)."""
    engine.flush_cache()
    driver = engine.scheduler.driver
    timer = driver.forward = Timer(driver.forward, pass_kind)
    spec = engine.stats().get("speculative")
    tokens, seconds, outputs, verify_steps, accepted = 0, 0.0, [], 0, 0
    try:
        for session in sessions:
            for i, ids in enumerate(session):
                res = engine.generate([ids], SamplingParams(max_new_tokens=max_new, temperature=0.0))[0]
                outputs.append(res.output_ids)
                if measured == "all" or i == len(session) - 1:
                    tokens += res.completion_tokens - 1
                    seconds += res.e2e_s - res.ttft_s
                    verify_steps += res.spec_verify_steps
                    accepted += round(res.spec_accept_length * res.spec_verify_steps)
    finally:
        driver.forward = timer.fn
    verify = max(timer.calls.get("verify", 0), 1)
    return {"outputs": outputs, "tok_s": tokens / seconds, "spec": spec is not None,
            "accept": accepted / verify_steps if verify_steps else 0.0,
            "decode_ms": 1e3 * timer.seconds.get("decode", 0.0) / max(timer.calls.get("decode", 0), 1),
            "verify_ms": 1e3 * timer.seconds.get("verify", 0.0) / verify,
            "verify_rows": timer.rows.get("verify", 0) / verify, "verify_passes": timer.calls.get("verify", 0)}


def cpu_flags() -> str:
    try:
        flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    line = next((ln for ln in flags.splitlines() if ln.startswith("Flags:")), "")
    keep = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "fma")
    return " ".join(f for f in line.split() if f in keep) or "unknown"


def report(name: str, results: dict[str, list[dict]], repeats: int) -> None:
    plain = results["plain"]
    print(f"\n== {name}: {repeats} repeats, medians ==")
    print(f"{'config':<16}{'decode tok/s':>13}{'speedup':>9}{'accept len':>11}{'verify rows':>12}"
          f"{'verify ms':>10}{'decode ms':>10}{'verify/decode':>14}{'same output':>12}")
    for config, runs in results.items():
        tok_s = statistics.median(r["tok_s"] for r in runs)
        speedup = statistics.median(r["tok_s"] / p["tok_s"] for r, p in zip(runs, plain))
        same = all(r["outputs"] == p["outputs"] for r, p in zip(runs, plain))
        decode_ms = statistics.median(r["decode_ms"] for r in runs if r["decode_ms"] > 0) \
            if any(r["decode_ms"] > 0 for r in runs) else 0.0
        if runs[0]["spec"] and any(r["verify_passes"] for r in runs):
            verify_ms = statistics.median(r["verify_ms"] for r in runs)
            ref = statistics.median(p["decode_ms"] for p in plain)
            spec_cols = (f"{statistics.median(r['accept'] for r in runs):>11.2f}"
                         f"{statistics.median(r['verify_rows'] for r in runs):>12.1f}{verify_ms:>10.1f}"
                         f"{decode_ms:>10.1f}{verify_ms / ref:>13.2f}x")
        else:
            spec_cols = f"{'-':>11}{'-':>12}{'-':>10}{decode_ms:>10.1f}{'-':>14}"
        print(f"{config:<16}{tok_s:>13.1f}{speedup:>8.2f}x{spec_cols}{str(same):>12}")
    print(f"{'':<16}speedup per repeat (NGRAM): "
          + " ".join(f"{r['tok_s'] / p['tok_s']:.2f}" for r, p in zip(results.get("NGRAM", []), plain)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--draft", default="smollm2:int4-g64")
    ap.add_argument("--standalone-steps", type=int, default=3, help="0: leave STANDALONE out")
    ap.add_argument("--workloads", default="copy,reuse,chat,prose")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    opts = dict(dtype=args.dtype, max_total_tokens=16384)
    print(f"bench_spec: {args.model}, --dtype {args.dtype}, {os.cpu_count()} CPUs (flags: {cpu_flags()}), "
          f"torch threads {torch.get_num_threads()}")
    configs = {"plain": {}, "NGRAM": {"speculative_algorithm": "NGRAM"}}
    if args.standalone_steps:
        configs[f"STANDALONE k={args.standalone_steps}"] = dict(
            speculative_algorithm="STANDALONE", speculative_draft_model_path=args.draft,
            speculative_num_steps=args.standalone_steps)
    engines = {name: Engine(args.model, **opts, **extra) for name, extra in configs.items()}
    try:
        loads = workloads(engines["plain"], args.workloads.split(","), args.max_new_tokens)
        for name, sessions in loads.items():
            results: dict[str, list[dict]] = {c: [] for c in configs}
            for _ in range(args.repeats):
                for config, engine in engines.items():
                    results[config].append(run(engine, sessions, args.max_new_tokens,
                                               "last" if name == "reuse" else "all"))
            first = engines["plain"].tokenizer.decode(results["plain"][0]["outputs"][-1])
            print(f"\n[{name}] the plain run's {'last' if name != 'copy' else 'last'} reply "
                  f"({len(results['plain'][0]['outputs'][-1])} tokens): {first[:400]!r}")
            report(name, results, args.repeats)
    finally:
        for engine in engines.values():
            engine.shutdown()


if __name__ == "__main__":
    main()
