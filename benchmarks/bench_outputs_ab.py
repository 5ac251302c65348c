"""Greedy outputs and speed of one checkout, to compare two checkouts side by side (issue 58:
a refactor keeps every greedy output byte-identical and the speed within noise).

Each workload is a multi-turn session of several agents over one shared system prompt, run
greedily through every tier (a device pool small enough to evict, a host tier, a file store),
then answered again by a fresh engine over the same store (storage hits). Printed per workload:
the SHA-256 of every output token, the hit tokens per tier, and the wall time of the session.

    # the same script against two source trees, alternating (a 2-core VM is noisy):
    PYTHONPATH=/tmp/base/src  .venv/bin/python benchmarks/bench_outputs_ab.py --json /tmp/a.json
    PYTHONPATH=src            .venv/bin/python benchmarks/bench_outputs_ab.py --json /tmp/b.json
    .venv/bin/python benchmarks/bench_outputs_ab.py --compare /tmp/a.json /tmp/b.json

It uses only the public ``Engine`` API, so it runs against an older checkout unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time

from hicache import Engine
from hicache.runtime.sampling import SamplingParams

# (name, model, engine options): the demo's model, the hybrid window family, a random hybrid stress
WORKLOADS = [
    ("smollm2", "smollm2", dict(max_total_tokens=256, page_size=16)),
    ("gemma3-270m", "gemma3-270m", dict(max_total_tokens=256, page_size=16)),
    ("random-hybrid", "random:gemma-small", dict(dtype="float32", kv_cache_dtype="float32", page_size=4,
                                                 chunked_prefill_size=12, max_total_tokens=160)),
]
SYSTEM = "You are a careful coding assistant. Answer briefly and show the code you would write. " * 3
QUESTIONS = ["How do I reverse a list in Python?", "Now do it in place.", "What is its complexity?",
             "Write a test for it."]


def tiers(store: str) -> dict:
    return dict(enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_storage_backend="file",
                hicache_storage_backend_extra_config=json.dumps({"path": store}),
                hicache_storage_prefetch_threshold=16)


def session(engine: Engine, agents: int, turns: int, max_new: int) -> tuple[list[list[int]], float]:
    """``agents`` conversations of ``turns`` turns over SYSTEM; every output, and the wall time."""
    greedy = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    tok = engine.tokenizer
    histories = [tok.encode(f"{SYSTEM}\nAgent {a}.") for a in range(agents)]
    outputs, start = [], time.perf_counter()
    for turn in range(turns):
        for a in range(agents):
            out = engine.generate([histories[a]], greedy)[0].output_ids
            outputs.append(out)
            histories[a] = histories[a] + out + tok.encode(f"\n{QUESTIONS[(turn + a) % len(QUESTIONS)]}\n")
    return outputs, time.perf_counter() - start


def run(name: str, model: str, options: dict, agents: int, turns: int, max_new: int) -> dict:
    with tempfile.TemporaryDirectory() as store:
        engine = Engine(model, **options, **tiers(store))
        try:
            outputs, wall = session(engine, agents, turns, max_new)
            hits = engine.stats()["hit_tokens"]
        finally:
            engine.shutdown()
        fresh = Engine(model, **options, **tiers(store), hicache_storage_prefetch_policy="wait_complete")
        try:
            again, wall_again = session(fresh, agents, 1, max_new)
            hits_again = fresh.stats()["hit_tokens"]
        finally:
            fresh.shutdown()
    digest = hashlib.sha256(json.dumps(outputs + again).encode()).hexdigest()
    return {"workload": name, "sha256": digest, "tokens": sum(map(len, outputs + again)), "hits": hits,
            "fresh_hits": hits_again, "wall_s": round(wall, 2), "fresh_wall_s": round(wall_again, 2)}


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    same = True
    print(f"{'workload':16} {'outputs':10} {'hits a -> b':44} {'wall s a / b':>14}")
    for x, y in zip(a, b):
        equal = x["sha256"] == y["sha256"]
        same &= equal
        print(f"{x['workload']:16} {'identical' if equal else 'DIFFER':10} "
              f"{str(x['hits']) + ' -> ' + str(y['hits']):44} {x['wall_s']:>6} / {y['wall_s']:<6}")
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --json files")
    ap.add_argument("--only", help="comma-separated workload names")
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    only = set(args.only.split(",")) if args.only else None
    results = []
    for name, model, options in WORKLOADS:
        if only is None or name in only:
            results.append(run(name, model, options, args.agents, args.turns, args.max_new_tokens))
            print(json.dumps(results[-1]), flush=True)
    if args.json:
        json.dump(results, open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
