"""A hybrid model's window-aware KV pool against keeping every layer's KV, at the same pool bytes, side
by side in one run (issue 48). Gemma 3 270M's geometry: 18 layers (15 attend a 512-token window), one
KV head of 256, float16 KV, pages of 16 tokens.

    python benchmarks/bench_hybrid.py [--pool-mib 256] [--ttft] [--agents 4 --turns 5]

1. **Memory**: cached tokens held per GiB of device pool with 4K- and 8K-token contexts. Distinct
   contexts are served (prefill + one token) until the pool has overflowed twice; then each is probed
   (``peek_prefix``: what a next turn would hit, window cut-back included). The window-aware pool gets
   the ratio such contexts need (a checkpoint window per context); the automatic pool (the default:
   full and window pages share one pool of blocks, issue 56) no ratio at all.
2. **Hit ratio vs pool use**: agents whose conversations grow past 4K tokens, turn by turn, round
   robin, in a pool that cannot hold them all: the hit ratio of each slice of requests beside how full
   the pool's full-layer pages are (the shape of vLLM #48435: does it collapse as the pool fills?).
Both run the engine's real cache manager and scheduler (the model's forward replaced by a no-op:
capacity and hits do not depend on the numbers it computes).
3. ``--ttft``: the same conversations on the real Gemma 3 270M (a smaller pool), mean TTFT and hit
   ratio per layout; 4. then, in float32, whether window-aware hits give the cold run's tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

import numpy as np  # noqa: E402

from cache_only import AUTO, GEMMA3_270M, CacheOnly  # noqa: E402
from hicache.cache.device_window import window_footprint  # noqa: E402
from hicache.runtime.sampling import SamplingParams  # noqa: E402

G = GEMMA3_270M
LAYERS, WINDOW_LAYERS, PAGE, WINDOW = G.layers, G.window_layers, G.page, G.window
ROW = G.row_bytes
CHUNK = 2048


def memory(pool_mib: int, contexts: tuple[int, ...]) -> None:
    print(f"1. cached tokens held per GiB of device pool ({pool_mib} MiB pools, Gemma 3 270M geometry)")
    print(f"   {'context':>8} {'every layer':>12} {'tuned ratio':>12} {'ratio':>6} {'swa/full':>9} "
          f"{'automatic':>10} {'ratio':>6} {'checkpoints only':>17}")
    rng = np.random.default_rng(0)
    full, window = ROW * (LAYERS - len(WINDOW_LAYERS)), ROW * len(WINDOW_LAYERS)
    checkpoint = (-(-(WINDOW - 1) // PAGE) + 2) * PAGE  # the window pages a finished context keeps
    for length in contexts:
        # window tokens per full token: a checkpoint per context, and one running request's working set
        # (its prefill chunk's window pages) on top
        full_tokens = pool_mib * 2**20 / (full + window * checkpoint / length)
        working = window_footprint(WINDOW, PAGE, CHUNK) * PAGE
        ratio = checkpoint / length + working / full_tokens
        per_gib = []
        for r in (None, ratio, AUTO):  # AUTO: the default, no ratio (shared blocks, issue 56)
            engine = CacheOnly(pool_mib * 2**20, r)
            capacity_tokens = (engine.pool.num_pages - 1) * PAGE
            served = [rng.integers(10, 50_000, size=length).tolist()
                      for _ in range(2 * capacity_tokens // length + 2)]
            for tokens in served:
                engine.serve(tokens)
            held = sum(engine.held(t) for t in served)
            per_gib.append(held / (engine.pool.total_bytes / 2**30))
        expected = (full + window) / (full + window * checkpoint / length)
        print(f"   {length:>8} {per_gib[0]:>12,.0f} {per_gib[1]:>12,.0f} {per_gib[1] / per_gib[0]:>5.2f}x "
              f"{ratio:>9.3f} {per_gib[2]:>10,.0f} {per_gib[2] / per_gib[0]:>5.2f}x {expected:>16.2f}x")


def agent_prompts(agents: int, turns: int, start: int, growth: int, seed: int = 1) -> list[tuple[int, list[int]]]:
    """Round robin over ``agents`` conversations: each turn the history + an answer + a new message
    (``growth`` tokens in all), from ``start`` tokens. Returns (agent, prompt) in arrival order."""
    rng = np.random.default_rng(seed)
    histories = [rng.integers(10, 50_000, size=start).tolist() for _ in range(agents)]
    out = []
    for _ in range(turns):
        for a in range(agents):
            out.append((a, list(histories[a])))
            histories[a] = histories[a] + rng.integers(10, 50_000, size=growth).tolist()
    return out


def hit_vs_use(pool_mib: int, agents: int, turns: int, ratio: float) -> None:
    prompts = agent_prompts(agents, turns, start=2048, growth=512)
    print(f"\n2. hit ratio vs pool use: {agents} agents x {turns} turns (2K -> {2048 + 512 * (turns - 1)} tokens), "
          f"{pool_mib} MiB pools, window-aware at --swa-full-tokens-ratio {ratio}")
    rows = {}
    for name, r in (("every layer", None), ("window-aware", ratio), ("automatic", AUTO)):
        engine = CacheOnly(pool_mib * 2**20, r)
        rows[name] = []
        for _, tokens in prompts:
            use = engine.full_use()
            rows[name].append((use, engine.serve(tokens), len(tokens)))
    size = max(1, len(prompts) // 8)
    print(f"   {'requests':>9} | {'every layer: pool use, hits':>28} | {'window-aware: pool use, hits':>29} | "
          f"{'automatic: pool use, hits':>26}")
    for i in range(0, len(prompts), size):
        cells = []
        for name in rows:
            part = rows[name][i:i + size]
            cells.append(f"{statistics.mean(u for u, _, _ in part):>6.0%} {sum(h for _, h, _ in part) / sum(n for _, _, n in part):>6.0%}")
        print(f"   {i + 1:>4}-{min(i + size, len(prompts)):<4} | {cells[0]:>28} | {cells[1]:>29} | {cells[2]:>26}")
    for name, data in rows.items():
        print(f"   {name}: hit ratio {sum(h for _, h, _ in data) / sum(n for _, _, n in data):.1%}")


def ttft(agents: int, turns: int, pool_mib: int, ratio: float) -> None:
    from hicache import Engine

    prompts = agent_prompts(agents, turns, start=2560, growth=512, seed=2)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    every_tokens = pool_mib * 2**20 // (ROW * LAYERS)
    print(f"\n3. TTFT on Gemma 3 270M: {agents} agents x {turns} turns (2.5K -> {2560 + 512 * (turns - 1)} tokens), "
          f"{pool_mib} MiB pools ({every_tokens} tokens keeping every layer)")
    results = {}
    for name, opts in (("every layer", dict(disable_hybrid_swa_memory=True, max_total_tokens=every_tokens)),
                       ("window-aware", dict(swa_full_tokens_ratio=ratio, max_total_tokens=int(
                           pool_mib * 2**20 // (ROW * (LAYERS - len(WINDOW_LAYERS)) + ratio * ROW * len(WINDOW_LAYERS))
                       )))):
        engine = Engine("gemma3-270m", **opts)
        results[name] = [engine.generate([tokens], greedy)[0] for _, tokens in prompts]
        pool = engine.stats()["device_pool"]
        engine.shutdown()
        rs = results[name]
        print(f"   {name:>12}: pool {pool['device_pool_bytes'] / 2**20:.0f} MiB, hit ratio "
              f"{sum(r.cached_tokens for r in rs) / sum(r.prompt_tokens for r in rs):.1%}, mean TTFT "
              f"{statistics.mean(r.ttft_s for r in rs):.3f} s, median {statistics.median(r.ttft_s for r in rs):.3f} s")
    same = sum(a.output_ids == b.output_ids for a, b in zip(results["every layer"], results["window-aware"]))
    print(f"   outputs alike: {same} of {len(prompts)} (default precision: bf16 prefill weights and int8 decode "
          "activations round a hit and a recompute differently; part 4 compares in float32)")


def exact(agents: int = 2, turns: int = 3) -> None:
    """Token equality in float32 (every phase exact): window-aware hits, every-layer hits, cold."""
    from hicache import Engine

    prompts = agent_prompts(agents, turns, start=700, growth=300, seed=3)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    f32 = dict(dtype="float32", kv_cache_dtype="float32", prefill_weight_dtype="same", decode_activations="float32",
               decode_weight_dtype="same")
    print(f"\n4. float32 on Gemma 3 270M, {agents} agents x {turns} turns (700 -> {700 + 300 * (turns - 1)} tokens): "
          "greedy outputs")
    outputs = {}
    for name, opts in (("cold", dict(disable_radix_cache=True, max_total_tokens=4096)),
                       ("every layer", dict(disable_hybrid_swa_memory=True, max_total_tokens=2048)),
                       ("window-aware", dict(swa_full_tokens_ratio=0.5, max_total_tokens=3000))):
        engine = Engine("gemma3-270m", **f32, **opts)
        rs = [engine.generate([tokens], greedy)[0] for _, tokens in prompts]
        engine.shutdown()
        outputs[name] = [r.output_ids for r in rs]
        print(f"   {name:>12}: cached tokens per turn {[r.cached_tokens for r in rs]}")
    print(f"   token-equal to cold: every layer {outputs['every layer'] == outputs['cold']}, "
          f"window-aware {outputs['window-aware'] == outputs['cold']}")


# Gemma 3 270M's KV geometry (18 layers, 15 of them a 512-token window, one KV head of 256, float16 KV) on a
# random model of small hidden width: what each tier holds does not depend on the numbers computed.
GEMMA_KV = ('random:{"preset": "gemma-small", "num_layers": 18, "hidden_size": 64, "num_heads": 1, "head_dim": 256, '
            '"intermediate_size": 64, "vocab_size": 50000, "sliding_window": 512, "max_position_embeddings": 16384, "layer_kinds": '
            '["sliding", "sliding", "sliding", "sliding", "sliding", "full", "sliding", "sliding", "sliding", "sliding", '
            '"sliding", "full", "sliding", "sliding", "sliding", "sliding", "sliding", "full"]}')


def tier_bytes(contexts: tuple[int, ...], agents: int, turns: int, growth: int, ratio: float | None) -> None:
    """5. Bytes each tier spends per cached token, window-aware vs every layer, with the tiers the
    default settings give (a storage backend written through), agents whose conversations end near
    each context length."""
    import json
    import tempfile

    from hicache import Engine

    label = "default settings" if ratio is None else f"--swa-full-tokens-ratio {ratio}"
    print(f"\n5. bytes per cached token in each tier, {agents} agents x {turns} turns of +{growth} tokens, {label} "
          "(Gemma 3 270M's KV geometry on a random model; device pool: two conversations' full-layer tokens)")
    print(f"   {'context':>8} {'layout':>13} {'pool':>9} {'device':>9} {'host pool':>9} {'host':>9} {'storage':>9} "
          f"{'hit ratio':>10}   (pool, host pool: the device and host pools' bytes per full-layer token they can hold; "
          "the others: bytes held per cached token)")
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    row = 2 * 256 * 2  # K and V of one token in one layer, float16
    for length in contexts:
        prompts = agent_prompts(agents, turns, start=length - (turns - 1) * growth, growth=growth, seed=5)
        device_tokens = 2 * (length + 512)
        figures, pool_bytes = {}, 0
        for name in ("window-aware", "every layer"):
            with tempfile.TemporaryDirectory() as store:
                opts = dict(kv_cache_dtype="float16", dtype="float32", max_total_tokens=device_tokens,
                            enable_hierarchical_cache=True, hicache_ratio=3.0, hicache_storage_backend="file",
                            hicache_storage_backend_extra_config=json.dumps({"path": store}))
                if name == "every layer":  # the window-aware pool's bytes, every layer's KV in them
                    opts.update(disable_hybrid_swa_memory=True, max_total_tokens=pool_bytes // (18 * row))
                elif ratio is not None:
                    opts.update(swa_full_tokens_ratio=ratio)
                engine = Engine(GEMMA_KV, **opts)
                results = [engine.generate([tokens], greedy)[0] for _, tokens in prompts]
                engine.backend.core.cache.drain()
                stats = engine.stats()
                pool, host_pool = stats["device_pool"], stats["host_pool"]
                pool_bytes = pool["device_pool_bytes"]
                device, host, storage = _held_bytes(engine, row)
                figures[name] = (pool_bytes / (pool["capacity_pages"] * engine.config.page_size), device,
                                 host_pool["host_pool_bytes"] / (host_pool["capacity_pages"] * engine.config.page_size),
                                 host, storage,
                                 sum(r.cached_tokens for r in results) / sum(r.prompt_tokens for r in results))
                engine.shutdown()
        for name in ("every layer", "window-aware"):
            pool, dev, host_pool, host, storage, hits = figures[name]
            print(f"   {length:>8} {name:>13} {pool:>9,.0f} {dev:>9,.0f} {host_pool:>9,.0f} {host:>9,.0f} {storage:>9,.0f} "
                  f"{hits:>10.1%}")
        every, aware = figures["every layer"], figures["window-aware"]
        print(f"   {length:>8} {'saves':>13} " + " ".join(f"{e / a:>8.2f}x" if a else f"{'-':>9}" for e, a in
                                                      zip(every[:5], aware[:5])))


def _held_bytes(engine, row: int) -> tuple[float, float, float]:
    """Bytes per cached token the device, host and storage tiers hold (page ids counted, objects sized)."""
    import json

    core = engine.backend.core
    tree, pool, ps = core.cache.tree, core.pool, core.pool.page_size
    window_layers = len(pool.windows.layers)
    full_page, window_page = row * ps * (len(pool.k_buffers) - window_layers), row * ps * window_layers
    device = tree.cached_pages * full_page + (tree.windows.held_pages * window_page if pool.hybrid else 0)
    host_stats = engine.stats()["host_pool"]
    host = tree.host_pages_held * full_page + host_stats.get("window", {}).get("cached_pages", 0) * window_page
    store = Path(json.loads(engine.config.hicache_storage_backend_extra_config)["path"])
    files = [f for f in store.rglob("*") if f.is_file()]
    pages = sum(1 for f in files if not f.name.endswith("-window"))
    return (device / max(tree.cached_pages * ps, 1), host / max(tree.host_pages_held * ps, 1),
            sum(f.stat().st_size for f in files) / max(pages * ps, 1))


def short_agents(pool_mib: int = 512, agents: int = 32, turns: int = 4) -> None:
    """Agents of 0.5-1K tokens (+50 a turn), round robin: a ratio tuned for long contexts (0.15)
    collapses here; the automatic pool needs none."""
    print(f"\n2b. hit ratio of {agents} agents with 0.5-1K-token contexts, {turns} turns, {pool_mib} MiB pools")
    for name, r in (("every layer", None), ("ratio 0.15", 0.15), ("ratio 0.8", 0.8), ("automatic", AUTO)):
        engine = CacheOnly(pool_mib * 2**20, r)
        rng = np.random.default_rng(0)
        convs = [rng.integers(1, 30_000, size=int(rng.integers(500, 1000))).tolist() for _ in range(agents)]
        hit = total = 0
        for _ in range(turns):
            for conv in convs:
                conv += rng.integers(1, 30_000, size=50).tolist()
                hit += engine.serve(conv)
                total += len(conv)
        print(f"   {name:>12}: hit ratio {hit / total:.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool-mib", type=int, default=1024)
    ap.add_argument("--agent-pool-mib", type=int, default=256)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--ratio", type=float, default=0.25, help="--swa-full-tokens-ratio of parts 2 and 3")
    ap.add_argument("--ttft", action="store_true", help="also part 3 (the real model; minutes on a CPU)")
    ap.add_argument("--ttft-pool-mib", type=int, default=160)
    ap.add_argument("--tiers", action="store_true", help="only part 5: bytes per cached token in every tier")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.tiers:
        tier_bytes((1024, 4096, 8192), agents=4, turns=4, growth=256, ratio=None)
        print(f"\n({time.perf_counter() - t0:.0f} s)")
        return
    memory(args.pool_mib, (1024, 4096, 8192))
    hit_vs_use(args.agent_pool_mib, args.agents, args.turns, args.ratio)
    short_agents()
    if args.ttft:
        ttft(4, 5, args.ttft_pool_mib, args.ratio)
        exact()
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
