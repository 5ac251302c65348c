"""Context parallelism with page-sharded KV vs replicated KV, measured side by side in one run.

    python benchmarks/bench_cp.py [--requests 1000] [--pool-tokens 32768] [--host-ratio 6] [--block-tokens 8]
                                  [--history 1024] [--decode-tokens 32] [--skip-hits] [--skip-latency]

1. Hit shares (the seed's Figure 1d, at our scale): the first ``--requests`` requests of the
   Mooncake conversation trace (shipped with hicache; each 512-token prefix block becomes
   ``--block-tokens`` token ids, equal block ids equal tokens), replayed in order on CP2 with the
   same per-rank budget (``--pool-tokens`` device tokens per rank, a host pool ``--host-ratio``
   times that, large enough to hold the working set either way),
   replicated vs sharded KV. Sharding doubles the logical device pool, so the device tier's
   share of the hits rises, the host tier's falls, and the combined hit rate stays put.
   Also printed: pages held per rank, and the prefix gathers' time per (layer, sequence) and the
   share of it hidden behind attention (1 - waited / gather time).
2. Latency on SmolLM2 (float32): TTFT of a cached turn (``--history`` tokens cached, 32 new)
   and the decode inter-token latency at that context, TP1 vs CP2 replicated vs CP2 sharded.
   Sharded decode merges per-rank partial attention by log-sum-exp (a [B, H, D+1] all-gather per
   layer); the alternative, gathering every context per layer, is priced from the measured
   gather bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from hicache import Engine, SamplingParams  # noqa: E402

from hicache.sim.trace import SHIPPED_TRACE as TRACE  # noqa: E402  (the Mooncake conversation trace)
HIT_MODEL = "random:small"  # hit shares depend on the cache, not the weights: a fast model
CP2 = dict(tp_size=2, attn_cp_size=2)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def trace_prompts(path: str, n: int, block_tokens: int, vocab: int, max_tokens: int) -> list[list[int]]:
    """The first ``n`` trace requests as token ids: block id b -> ``block_tokens`` ids drawn from
    a generator seeded by b, so requests sharing a block share its tokens; each cut to its
    first ``max_tokens`` (shared prefixes are leading blocks, so reuse is kept)."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if len(prompts) == n:
                break
            blocks = json.loads(line)["hash_ids"]
            tokens = [t for b in blocks for t in random.Random(b).choices(range(5, vocab), k=block_tokens)]
            prompts.append(tokens[:max_tokens])
    return prompts


def replay(layout: dict, prompts: list[list[int]], pool_tokens: int, host_ratio: float) -> dict:
    engine = Engine(HIT_MODEL, dtype="float32", page_size=16, max_total_tokens=pool_tokens,
                    enable_hierarchical_cache=True, hicache_ratio=host_ratio, **layout)
    try:
        one = SamplingParams(max_new_tokens=1, temperature=0.0)
        t0 = time.perf_counter()
        for i in range(0, len(prompts), 4):  # four requests in flight at a time
            engine.generate(prompts[i:i + 4], one)
        elapsed = time.perf_counter() - t0
        stats = engine.stats()
    finally:
        engine.shutdown()
    hits, total = stats["hit_tokens"], stats["prompt_tokens"]
    return {"hits": hits, "prompt": total, "elapsed": elapsed, "sharding": stats["kv_sharding"],
            "share": {tier: hits[tier] / total for tier in hits}, "rate": sum(hits.values()) / total}


def bench_hits(args: argparse.Namespace) -> None:
    prompts = trace_prompts(args.trace, args.requests, args.block_tokens, 300, args.pool_tokens // 2)
    log(f"hit shares: {len(prompts)} Mooncake conversation requests, {sum(map(len, prompts))} prompt tokens "
        f"({args.block_tokens} tokens per 512-token block, at most {args.pool_tokens // 2} per prompt), "
        f"{args.pool_tokens} device tokens per rank, host pool {args.host_ratio:g}x that")
    runs = {name: replay(dict(CP2, enable_kv_cache_sharding=name == "sharded"), prompts, args.pool_tokens,
                         args.host_ratio)
            for name in ("replicated", "sharded")}
    print(f"{'CP2 KV':<12}{'device':>9}{'host':>9}{'combined':>10}{'device/hits':>13}{'pages held per rank':>22}"
          f"{'wall s':>8}")
    for name, r in runs.items():
        s = r["share"]
        print(f"{name:<12}{s['device']:>9.1%}{s['host']:>9.1%}{r['rate']:>10.1%}{s['device'] / max(r['rate'], 1e-12):>13.0%}"
              f"{str(r['sharding']['owned_pages']):>22}{r['elapsed']:>8.1f}")
    rep, sh = runs["replicated"], runs["sharded"]
    print(f"device share {sh['share']['device'] - rep['share']['device']:+.1%} points, host share "
          f"{sh['share']['host'] - rep['share']['host']:+.1%}, combined {sh['rate'] - rep['rate']:+.1%} "
          "(sharded - replicated)")
    for rank, g in enumerate(sh["sharding"]["per_rank"]):
        if g["gathers"]:
            print(f"rank {rank}: {g['gathers']} prefix gathers, {g['gather_time_s'] / g['gathers'] * 1e3:.2f} ms each "
                  f"(per layer and sequence), {g['gathered_bytes'] / g['gathers'] / 2**10:.0f} KiB, "
                  f"{1 - g['gather_wait_s'] / max(g['gather_time_s'], 1e-12):.0%} hidden behind attention")


def latency(layout: dict, history: list[int], decode_tokens: int, repeats: int) -> dict:
    engine = Engine("smollm2", dtype="float32", page_size=16, max_total_tokens=4096, **layout)
    try:
        first = SamplingParams(max_new_tokens=1, temperature=0.0)
        engine.generate([history], first)  # the history is cached from here on
        rng = random.Random(0)
        ttft = []
        for _ in range(repeats):
            res = engine.generate([history + [rng.randrange(100, 40000) for _ in range(32)]], first)[0]
            assert res.cached_tokens >= len(history) - 16, res.cached_tokens
            ttft.append(res.ttft_s)
        res = engine.generate([history + [7] * 32], SamplingParams(max_new_tokens=decode_tokens, temperature=0.0,
                                                                   ignore_eos=True))[0]
        itl = (res.e2e_s - res.ttft_s) / (res.completion_tokens - 1)
        stats = engine.stats()
    finally:
        engine.shutdown()
    return {"ttft": statistics.median(ttft), "itl": itl, "sharding": stats.get("kv_sharding")}


def bench_latency(args: argparse.Namespace) -> None:
    history = [random.Random(1).randrange(100, 40000) for _ in range(args.history)]
    log(f"latency: SmolLM2 float32, {args.history} cached tokens + 32 new, decode {args.decode_tokens} tokens")
    runs = {"TP1": latency({}, history, args.decode_tokens, args.repeats),
            "CP2 replicated": latency(CP2, history, args.decode_tokens, args.repeats),
            "CP2 sharded": latency(dict(CP2, enable_kv_cache_sharding=True), history, args.decode_tokens, args.repeats)}
    base = runs["TP1"]
    print(f"{'layout':<16}{'cached TTFT ms':>15}{'vs TP1':>8}{'decode ITL ms':>15}{'vs TP1':>8}")
    for name, r in runs.items():
        print(f"{name:<16}{r['ttft'] * 1e3:>15.1f}{r['ttft'] / base['ttft']:>8.2f}"
              f"{r['itl'] * 1e3:>15.1f}{r['itl'] / base['itl']:>8.2f}")
    g = runs["CP2 sharded"]["sharding"]["per_rank"][0]
    if g["gathers"]:
        bandwidth = g["gathered_bytes"] / g["gather_time_s"]
        layers, kv_heads, head_dim = 30, 3, 64  # SmolLM2
        context_bytes = (args.history + 32) * 2 * kv_heads * head_dim * 4 * layers
        merge_bytes = 2 * 9 * (head_dim + 1) * 4 * layers  # [B=1, H, D+1] from each of 2 ranks, every layer
        print(f"sharded decode step: partial attention + LSE merge moves {merge_bytes / 2**10:.0f} KiB; gathering the "
              f"context instead would move {context_bytes / 2**20:.1f} MiB, ~{context_bytes / bandwidth * 1e3:.0f} ms "
              f"at the measured gather bandwidth ({bandwidth / 2**20:.0f} MiB/s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--block-tokens", type=int, default=8)
    p.add_argument("--pool-tokens", type=int, default=32768, help="device KV tokens per rank")
    p.add_argument("--host-ratio", type=float, default=6.0, help="host pool / device pool, per rank")
    p.add_argument("--history", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-hits", action="store_true")
    p.add_argument("--skip-latency", action="store_true")
    args = p.parse_args()
    print(f"cpu threads {os.cpu_count()}; run `lscpu` for the flags to quote with these figures")
    if not args.skip_hits:
        bench_hits(args)
    if not args.skip_latency:
        bench_latency(args)


if __name__ == "__main__":
    main()
