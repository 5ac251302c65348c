"""L2 host tier, measured side by side in one run:

1. page copy bandwidth device<->host for each host layout vs. one contiguous copy of the same
   bytes (SmolLM2-shaped pools: 30 layers, 3 KV heads x 64, bf16, page 16), for consecutive,
   mixed (short runs) and scattered page lists;
2. TTFT of a prompt whose first K tokens are served from L1 vs. L2 vs. L3 (file backend, warm
   page cache) vs. computed cold.

    python benchmarks/bench_hicache.py [--pages 512] [--prefix 4096] [--suffix 64] [--copies-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from hicache import Engine, SamplingParams  # noqa: E402
from hicache.cache.host_pool import HostKVPool  # noqa: E402
from hicache.cache.host_transfer import BACKUP, LOAD, TransferController  # noqa: E402
from hicache.cache.pools import DeviceKVPool  # noqa: E402


def best_of(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def page_placements(rng: np.random.Generator, num_pages: int, dev_total: int, host_total: int) -> dict:
    """Device and host page lists of ``num_pages`` pages for each placement the bench reports."""
    def blocks(total: int) -> np.ndarray:  # pages cut into blocks of 1-15 consecutive pages, shuffled
        cuts = np.cumsum(rng.integers(1, 16, total))
        parts = np.split(np.arange(1, total), cuts[cuts < total - 1])
        return np.concatenate([parts[i] for i in rng.permutation(len(parts))])[:num_pages]

    return {
        # what the allocators hand out in steady state: one consecutive run on each side
        "consecutive": (np.arange(1, num_pages + 1), np.arange(num_pages + 7, 2 * num_pages + 7)),
        "mixed": (blocks(dev_total), blocks(host_total)),  # short runs, mostly not aligned on both sides
        "scattered": (rng.permutation(np.arange(1, dev_total))[:num_pages],
                      rng.permutation(np.arange(1, host_total))[:num_pages]),
    }


def bench_copies(num_pages: int) -> None:
    rng = np.random.default_rng(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pool = DeviceKVPool(30, 3, 64, num_pages=4 * num_pages + 1, page_size=16, dtype=torch.bfloat16, device=device)
    nbytes = pool.bytes_per_page * num_pages
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=torch.cuda.is_available())
    # Write every buffer first: never-written memory reads as the kernel's shared zero page, which
    # made the memcpy reference ~1.4x faster than a real copy (and pool reads cheaper).
    for buf in [src, *pool.k_buffers, *pool.v_buffers]:
        buf.view(torch.int16).random_()
    print(f"copy of {num_pages} pages ({nbytes / 2**20:.0f} MiB), device={device}, "
          f"memcpy measured next to each row")
    print(f"{'layout':>12} {'pages':>11} {'direction':>9} {'GB/s':>7} {'memcpy GB/s':>11} {'ratio':>6}")
    host_total = 4 * num_pages + 1
    placements = page_placements(rng, num_pages, pool.num_pages, host_total)
    for layout in ("layer_first", "page_first"):
        host = HostKVPool(pool, host_total, layout)
        host.buffer.view(torch.int16).random_()
        ctl = TransferController(pool, host)
        for placement, (dev_pages, host_pages) in placements.items():
            for kind in (BACKUP, LOAD):
                memcpy = best_of(lambda: dst.copy_(src))
                t = best_of(lambda: ctl.submit(kind, dev_pages, host_pages, []).done.wait())
                print(f"{layout:>12} {placement:>11} {kind:>9} {nbytes / t / 1e9:>7.2f} "
                      f"{nbytes / memcpy / 1e9:>11.2f} {memcpy / t:>6.2f}")
        ctl.shutdown()


def bench_ttft(prefix: int, suffix: int, repeats: int) -> None:
    storage_dir = tempfile.mkdtemp(prefix="hicache-bench-kv-")
    engine = Engine("smollm2", max_total_tokens=3 * (prefix + suffix) + 256, enable_hierarchical_cache=True,
                    hicache_storage_backend="file",
                    hicache_storage_backend_extra_config=json.dumps({"path": storage_dir}),
                    hicache_storage_prefetch_policy="wait_complete")
    vocab = engine.loaded.spec.vocab_size
    rng = np.random.default_rng(1)
    one = SamplingParams(max_new_tokens=1, temperature=0.0)

    def run(ids):
        return engine.generate([ids], one)[0]

    run(rng.integers(100, vocab, 64).tolist())  # warm up
    cold, l1, l2, l3, alone = [], [], [], [], []
    def hit(ids, tier: str) -> float:
        """TTFT of ``ids`` whose first ``prefix`` tokens (no more) come from ``tier``."""
        res = run(ids)
        details = res.cached_tokens_details
        assert details[tier] == res.cached_tokens == prefix, (tier, details)
        return res.ttft_s

    for _ in range(repeats):
        head = rng.integers(100, vocab, prefix).tolist()
        # A fresh suffix for every run: a suffix seen before would be cached too (its pages are
        # inserted after the run), and the hit would then skip most of the 64 new tokens.
        tails = [rng.integers(100, vocab, suffix).tolist() for _ in range(5)]
        engine.flush_cache()
        cold.append(run(head + tails[0]).ttft_s)
        engine.flush_cache()
        run(head + [1])
        engine.cache.drain()  # backups acknowledged: the prefix is in both tiers
        l1.append(hit(head + tails[1], "device"))
        engine.cache.drain()
        engine.cache.tree.evict(10**9)  # drop the device copies: the prefix is host-only
        l2.append(hit(head + tails[2], "host"))
        engine.flush_cache()  # device and host tiers empty; storage (warm page cache) keeps the prefix
        l3.append(hit(head + tails[3], "storage"))
        engine.flush_cache()
        alone.append(run(tails[4]).ttft_s)
    c, a, b, d, s = (statistics.median(x) for x in (cold, l1, l2, l3, alone))
    print(f"\nTTFT on smollm2 ({engine.config.dtype}), {prefix}-token prefix + {suffix}-token suffix, "
          f"median of {repeats}")
    print(f"{'cold ms':>9} {'L1-hit ms':>9} {'L2-hit ms':>9} {'L3-hit ms':>9} {'suffix-only ms':>14} "
          f"{'L2/L1':>6} {'L3/L1':>6} {'cold/L3':>7}")
    print(f"{c * 1e3:>9.1f} {a * 1e3:>9.1f} {b * 1e3:>9.1f} {d * 1e3:>9.1f} {s * 1e3:>14.1f} "
          f"{b / a:>6.2f} {d / a:>6.2f} {c / d:>7.1f}")
    engine.shutdown()
    shutil.rmtree(storage_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--skip-ttft", "--copies-only", dest="skip_ttft", action="store_true",
                    help="only the page copy bandwidth section")
    args = ap.parse_args()
    bench_copies(args.pages)
    if not args.skip_ttft:
        bench_ttft(args.prefix, args.suffix, args.repeats)


if __name__ == "__main__":
    main()
