"""Hybrid recurrent models (issue 59), measured side by side in one run:

1. **Parity**: float32 logits vs transformers' own implementation (LFM2, Qwen3.5, Granite 4.0-H; random weights at a
   tiny config and at the real layer shapes), max |diff| over the logits' spread, over 600 positions, in
   one pass and with the prompt split inside scan chunks (100 + 1 + 37 + rest).
2. **Multi-turn agents**: conversations sharing a system prompt, turn after turn, on tiny configs and
   an LFM2-350M-shaped model (random weights): hit ratio and mean TTFT with the cache off, with
   snapshots on the device (L1), from the host (L2: a device pool too small to keep them) and from
   storage (L3: a fresh engine over the file store the first one wrote); bytes per cached token per tier
   against an every-layer KV model of the same shape (the recurrent layers cost a snapshot per
   checkpoint, not per token).
3. **Decode tok/s** at 1K and 8K of context, LFM2-350M's shape beside an all-attention model of the
   same shape: the recurrent layers' cost does not grow with the context.
4. **Snapshot pool pressure**: the agents of 2 with fewer snapshot slots than conversations: hits drop
   gracefully, no request fails, the pool never holds more than it has.

    python benchmarks/bench_recurrent.py [--skip parity,decode] [--contexts 1024,8192] [--turns 4]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

import torch  # noqa: E402

from hicache import Engine, SamplingParams  # noqa: E402

# LFM2-350M's layers (10 short convs, attention at 2, 5, 8, 10, 12, 14), hidden 1024, 16 heads, 8 KV heads of 64
LFM2_350M = dict(preset="lfm2-tiny", num_layers=16, hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=64,
                 intermediate_size=4608, vocab_size=4096, max_position_embeddings=32768,
                 layer_kinds=["full" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)])
ALL_ATTENTION_350M = {**LFM2_350M, "preset": "small", "layer_kinds": []}
REPLY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def spec_arg(fields: dict) -> str:
    return "random:" + json.dumps(fields)


def parity() -> None:
    import test_gdn_parity as gdn
    import test_mamba2_parity as mamba2
    import test_recurrent_parity as lfm2
    from dense_forward import prefill_logits
    from recurrent_checks import hf_logits, random_ids, spread_error
    from hicache.model import load_model

    print("1. parity vs transformers (float32, 600 positions): max |diff| / logit spread")
    for name, mod, configs in (("LFM2", lfm2, ("tiny", "lfm2-350m-shapes")),
                               ("Qwen3.5", gdn, ("tiny", "qwen3.5-0.8b-shapes")),
                               ("Granite", mamba2, ("tiny", "granite-4.0-h-micro-shapes"))):
        for config in configs:
            with tempfile.TemporaryDirectory() as folder:
                hf = mod.write_hf_dir(Path(folder), config)
                ours = load_model(folder, dtype=torch.float32).model
            ids = random_ids(600, ours.spec.vocab_size)
            want = hf_logits(hf, ids)
            one = spread_error(prefill_logits(ours, ids), want)
            print(f"   {name:8} {config:22} one pass {one:.1e}   split mid-chunk {split_error(ours, ids, want):.1e}")


def split_error(model, ids: list[int], want: torch.Tensor) -> float:
    """The prompt in passes of 100, 1, 37 and the rest (scan chunks of 64: each split inside one)."""
    from recurrent_checks import prompt_in_chunks, spread_error
    from hicache.model import DenseKV

    kv = DenseKV(model.spec, len(ids) + 1, torch.float32)
    return spread_error(torch.cat(prompt_in_chunks(model, kv, ids, (100, 1, 37, len(ids) - 138))), want)


def conversations(agents: int, turns: int, system: int, vocab: int, seed: int = 0) -> list[list[list[int]]]:
    """Each agent's user messages, turn by turn, after a system prompt all of them share."""
    rng = random.Random(seed)
    head = [rng.randrange(5, vocab) for _ in range(system)]
    return [[head + [rng.randrange(5, vocab) for _ in range(96)]] + [[rng.randrange(5, vocab) for _ in range(rng.randrange(40, 160))]
                                                                     for _ in range(turns - 1)] for _ in range(agents)]


def run_agents(engine: Engine, convs: list[list[list[int]]]) -> dict:
    """Round robin over the agents, turn by turn; hit ratio and mean TTFT over every request."""
    histories = [[] for _ in convs]
    prompt = cached = failed = 0
    ttfts = []
    for turn in range(len(convs[0])):
        for i, conv in enumerate(convs):
            histories[i] += conv[turn]
            out = engine.generate([histories[i]], REPLY)[0]
            failed += out.finish_reason not in ("length", "stop")
            histories[i] += out.output_ids
            prompt, cached = prompt + out.prompt_tokens, cached + out.cached_tokens
            ttfts.append(out.ttft_s)
    return {"hit_ratio": cached / prompt, "ttft_ms": 1e3 * statistics.mean(ttfts), "failed": failed,
            "requests": len(ttfts)}


def tier_bytes(engine: Engine, every_layer_row: int) -> str:
    """Bytes per cached token in each tier: the attention layers' KV pages and the snapshots held,
    over the tokens the tier holds, beside an every-layer KV model's."""
    s, page = engine.stats(), engine.config.page_size
    out = []
    for tier in ("device_pool", "host_pool"):
        pool = s.get(tier)
        if not pool or not pool.get("cached_pages"):
            continue
        tokens = pool["cached_pages"] * page
        kv = engine.loaded.spec.kv_bytes_per_token(engine.cache.pool.k_buffers[0].dtype) * tokens
        state = pool["recurrent_state"]
        out.append(f"{tier.split('_')[0]} {(kv + state['snapshots_cached'] * state['slot_bytes']) / tokens:,.0f} B")
    return ", ".join(out) + f" (every-layer model: {every_layer_row:,} B)"


def agents(turns: int, models: list[tuple[str, str]]) -> None:
    print(f"2. multi-turn agents (4 agents x {turns} turns, a shared 512-token system prompt): hit ratio, mean TTFT")
    for label, model in models:
        convs = conversations(4, turns, 512, 250)
        base = dict(dtype="float32", page_size=16, chunked_prefill_size=2048)
        with tempfile.TemporaryDirectory() as store:
            layouts = {
                "cache off": dict(disable_radix_cache=True, max_total_tokens=16384),
                "L1": dict(max_total_tokens=16384),
                "L2": dict(max_total_tokens=1024, enable_hierarchical_cache=True, hicache_ratio=16.0),
                "L3": dict(max_total_tokens=1024, enable_hierarchical_cache=True, hicache_ratio=1.0,
                           hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete",
                           hicache_storage_prefetch_threshold=64,
                           hicache_storage_backend_extra_config=json.dumps({"path": store})),
            }
            for name, opts in layouts.items():
                engine = Engine(model, **base, **opts)
                if name == "L3":  # a writer fills the store, a fresh engine (nothing on device or host) reads it
                    run_agents(engine, convs)
                    engine.shutdown()
                    engine = Engine(model, **base, **opts)
                r = run_agents(engine, convs)
                spec = engine.loaded.spec
                row = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * engine.cache.pool.k_buffers[0].element_size()
                extra = f"   bytes/token: {tier_bytes(engine, row)}" if name in ("L1", "L2") else ""
                print(f"   {label:14} {name:9} hits {r['hit_ratio']:6.1%}  TTFT {r['ttft_ms']:8.1f} ms  "
                      f"failed {r['failed']}/{r['requests']}{extra}")
                engine.shutdown()


def decode(contexts: list[int]) -> None:
    print("3. decode tok/s (32 tokens, batch 1, float32) at each context: LFM2-350M's shape vs all attention")
    for label, fields in (("LFM2-350M shape", LFM2_350M), ("all-attention", ALL_ATTENTION_350M)):
        engine = Engine(spec_arg(fields), dtype="float32", max_total_tokens=max(contexts) + 256,
                        chunked_prefill_size=2048, disable_radix_cache=True)
        rates = []
        for n in contexts:
            prompt = [random.Random(n).randrange(5, 250) for _ in range(n)]
            out = engine.generate([prompt], SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))[0]
            rates.append(31 / (out.e2e_s - out.ttft_s))
        print(f"   {label:16} " + "  ".join(f"{n:>5}: {r:6.1f} tok/s" for n, r in zip(contexts, rates))
              + f"   ({rates[-1] / rates[0]:.2f}x from {contexts[0]} to {contexts[-1]})")
        engine.shutdown()


def pressure(turns: int) -> None:
    print(f"4. snapshot pool pressure: 12 agents x {turns} turns on lfm2-tiny, a 32K-token KV pool")
    convs = conversations(12, turns, 256, 250, seed=1)
    for ratio in (0.25, 0.5, 1.0, 4.0):
        engine = Engine("random:lfm2-tiny", dtype="float32", page_size=16, max_total_tokens=32768,
                        recurrent_snapshot_ratio=ratio)
        slots = engine.stats()["device_pool"]["recurrent_state"]["snapshot_slots"]
        r = run_agents(engine, convs)
        state = engine.stats()["device_pool"]["recurrent_state"]
        print(f"   ratio {ratio:4} ({slots:3} snapshot slots): hits {r['hit_ratio']:6.1%}  failed {r['failed']}/"
              f"{r['requests']}  cached {state['snapshots_cached']}/{slots}  evicted {state['snapshots_evicted']}")
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: parity,agents,decode,pressure")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--big", action="store_true", help="also run the agents on the LFM2-350M shape (slow)")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    flags = sorted(f for f in Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()
                   if f.startswith(("avx", "amx"))) if Path("/proc/cpuinfo").exists() else []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU flags: {' '.join(flags)}")
    if "parity" not in skip:
        parity()
    if "agents" not in skip:
        models = [(name, f"random:{name}") for name in ("lfm2-tiny", "gdn-tiny", "mamba2-tiny")]
        agents(args.turns, models + ([("LFM2-350M shape", spec_arg(LFM2_350M))] if args.big else []))
    if "decode" not in skip:
        decode([int(n) for n in args.contexts.split(",")])
    if "pressure" not in skip:
        pressure(args.turns)


if __name__ == "__main__":
    main()
