"""Speculative decoding on vs off, side by side in one run, on the agent demo workload.

    python benchmarks/bench_spec.py [--model smollm2] [--draft smollm2:int4-g64] [--steps 1,3,5]
                                    [--turns 4] [--max-new-tokens 48] [--dtype float32]

The demo's coding agent (``hicache demo``: a system prompt, a task, tool output every turn, its
growing history resent each turn) runs once without speculation, then again with each number of
draft steps in ``--steps``, on the same prompts. Printed per configuration: decode tokens/s
(output tokens after the first / time after the first token), the acceptance length (tokens
per verify pass, the target's own included), what one verify round costs (k draft passes + one
target pass of k + 1 tokens) next to a plain decode step, and whether the greedy outputs equal
the plain run's. Speculation pays when accept_length x (plain step) > (draft passes + verify);
"free draft" is the speedup a draft of negligible cost would give (accept_length x plain step /
verify), the ceiling a draft much smaller than the target approaches.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from hicache import Engine, SamplingParams  # noqa: E402
from hicache.frontend.demo import SYSTEM, TASK, _tool_output  # noqa: E402


@dataclass
class Timer:
    """Wraps a function; sums its seconds and calls per kind (``kind_of(args, kwargs)``)."""

    fn: object
    kind_of: object = lambda args, kw: "all"
    seconds: dict = field(default_factory=dict)
    calls: dict = field(default_factory=dict)

    def __call__(self, *args, **kw):
        kind = self.kind_of(args, kw)
        t0 = time.perf_counter()
        out = self.fn(*args, **kw)
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - t0
        self.calls[kind] = self.calls.get(kind, 0) + 1
        return out


def agent_prompts(engine: Engine, turns: int, max_new: int) -> list[list[int]]:
    """The demo session's prompts (token ids), turn by turn, grown with the plain engine's replies."""
    rng = random.Random(0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    prompts = []
    for turn in range(turns):
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
        prompts.append(ids)
        res = engine.generate([ids], SamplingParams(max_new_tokens=max_new, temperature=0.0))[0]
        messages += [{"role": "assistant", "content": res.text},
                     {"role": "user", "content": f"Tool output:\n{_tool_output(turn, rng)}\nWhat next?"}]
    return prompts


def run(engine: Engine, prompts: list[list[int]], max_new: int) -> dict:
    target = Timer(engine.scheduler.driver.forward, pass_kind)
    engine.scheduler.driver.forward = target
    spec = next((m for m in engine.scheduler.runtime.modes if m.name == "speculative"), None)
    propose = None
    if spec is not None:  # the k draft passes of each round, timed as one
        propose = spec.propose = Timer(spec.propose)
    outputs, decode_tokens, decode_s, accept = [], 0, 0.0, []
    for ids in prompts:
        res = engine.generate([ids], SamplingParams(max_new_tokens=max_new, temperature=0.0))[0]
        outputs.append(res.output_ids)
        decode_tokens += res.completion_tokens - 1
        decode_s += res.e2e_s - res.ttft_s
        accept.append(res.spec_accept_length)
    out = {"outputs": outputs, "tokens_per_s": decode_tokens / decode_s, "accept": accept,
           "decode_ms": 1e3 * target.seconds.get("decode", 0.0) / max(target.calls.get("decode", 0), 1)}
    if spec is not None:
        rounds = max(target.calls.get("verify", 0), 1)
        out["verify_ms"] = 1e3 * target.seconds.get("verify", 0.0) / rounds
        out["draft_ms"] = 1e3 * propose.seconds.get("all", 0.0) / rounds
        out["accept_length"] = engine.stats()["speculative"]["accept_length"]
    return out


def pass_kind(args: tuple, kw: dict) -> str:
    """A target pass: one token per sequence (decode), every row's logits (verify), or prefill."""
    if kw.get("logits") == "all":
        return "verify"
    return "decode" if max(len(ids) for ids in args[0]) == 1 else "prefill"


def cpu_flags() -> str:
    try:
        flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    line = next((ln for ln in flags.splitlines() if ln.startswith("Flags:")), "")
    keep = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma", "f16c")
    return " ".join(f for f in line.split() if f in keep) or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--draft", default="smollm2:int4-g64")
    ap.add_argument("--steps", default="1,3,5", help="draft steps per verify pass, comma separated")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    opts = dict(dtype=args.dtype, max_total_tokens=8192)
    print(f"bench_spec: {args.model}, draft {args.draft}, {args.dtype}, {os.cpu_count()} CPUs "
          f"(flags: {cpu_flags()}), torch threads {__import__('torch').get_num_threads()}")
    plain_engine = Engine(args.model, **opts)
    prompts = agent_prompts(plain_engine, args.turns, args.max_new_tokens)
    plain_engine.flush_cache()
    plain = run(plain_engine, prompts, args.max_new_tokens)
    plain_engine.shutdown()
    print(f"agent workload: {len(prompts)} turns, prompts {[len(p) for p in prompts]} tokens, "
          f"up to {args.max_new_tokens} new tokens each\n")
    print(f"{'config':<16}{'decode tok/s':>13}{'speedup':>9}{'accept len':>11}{'round ms':>10}"
          f"{'(draft':>8}{'+ verify)':>10}{'plain step ms':>14}{'same output':>12}{'free draft':>11}")
    print(f"{'off':<16}{plain['tokens_per_s']:>13.1f}{1.0:>9.2f}{'-':>11}{'-':>10}{'':>8}{'':>10}"
          f"{plain['decode_ms']:>14.1f}{'-':>12}{'-':>11}")
    for k in [int(x) for x in args.steps.split(",")]:
        engine = Engine(args.model, **opts, speculative_algorithm="STANDALONE",
                        speculative_draft_model_path=args.draft, speculative_num_steps=k)
        r = run(engine, prompts, args.max_new_tokens)
        engine.shutdown()
        same = r["outputs"] == plain["outputs"]
        print(f"{'k=' + str(k):<16}{r['tokens_per_s']:>13.1f}{r['tokens_per_s'] / plain['tokens_per_s']:>9.2f}"
              f"{r['accept_length']:>11.2f}{r['draft_ms'] + r['verify_ms']:>10.1f}{r['draft_ms']:>8.1f}"
              f"{r['verify_ms']:>10.1f}{plain['decode_ms']:>14.1f}{str(same):>12}"
              f"{r['accept_length'] * plain['decode_ms'] / r['verify_ms']:>10.2f}x")
        print(f"{'':<16}per turn accept length: {' '.join(f'{a:.2f}' for a in r['accept'])}")
    print("\nA round pays when accept length x plain step > round time. 'free draft': the speedup if draft "
          "passes cost nothing (accept length x plain step / verify), the ceiling a much smaller draft approaches.")


if __name__ == "__main__":
    main()
