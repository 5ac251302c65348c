"""The NGRAM token index at scale: lookup time and memory with 1M tokens in the radix tree.

    python benchmarks/bench_ngram_index.py [--tokens 1000000] [--seq-len 1000] [--lookups 20000]

Fills a radix tree (no KV: the index only reads token ids) with ``--tokens`` tokens in sequences
of ``--seq-len``, drawn from a Zipf distribution over SmolLM2's 49,152-token vocabulary (text-like:
a few tokens are very common, so common n-grams have many places), each sequence sharing a
prefix with an earlier one half the time (as agents on one system prompt do). Prints: insert cost
per token, the resident memory the tree and its index add (RSS), lookup time (median and p99) for tails cut from
cached sequences (a match) and for random tails (mostly none), and eviction of half the tree
with the index checked afterwards (no place left pointing at dropped tokens).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from array import array

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from hicache.cache.pools import PageAllocator  # noqa: E402
from hicache.device import resident_bytes  # noqa: E402
from hicache.cache.radix import RadixCache  # noqa: E402
from hicache.cache.tree_tokens import TreeTokenIndex  # noqa: E402
from hicache.runtime.ngram import NgramSettings, pick_draft  # noqa: E402

VOCAB = 49152


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--seq-len", type=int, default=1000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--lookups", type=int, default=20000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    pages = args.tokens // args.page_size + 2
    tree = RadixCache(args.page_size, PageAllocator(pages + 1))
    settings = NgramSettings(max_drafts=7, min_window=1, max_window=12, match_type="BFS", levels=(1, 3))
    index = TreeTokenIndex(settings.levels, per_key=8)
    tree.observer = index
    seqs: list[np.ndarray] = []
    rss0 = resident_bytes()
    t0 = time.perf_counter()
    inserted = 0
    while inserted < args.tokens:
        fresh = (rng.zipf(1.3, args.seq_len) % VOCAB).astype(np.int32)
        if seqs and rng.random() < 0.5:  # shares a prefix with an earlier sequence
            base = seqs[rng.integers(len(seqs))]
            cut = int(rng.integers(1, len(base) // args.page_size)) * args.page_size
            fresh[:cut] = base[:cut]
        seqs.append(fresh)
        need = args.seq_len // args.page_size
        pages_now = tree.allocator.alloc(need)
        done = tree.insert("ns", fresh, pages_now)
        tree.allocator.free(pages_now[: done // args.page_size])  # pages the tree had already
        inserted += args.seq_len - done
    build = time.perf_counter() - t0
    current = resident_bytes() - rss0
    print(f"tree: {index.tokens_held:,} tokens indexed in {len(seqs)} sequences, {tree.num_nodes()} nodes; "
          f"insert {build / index.tokens_held * 1e6:.2f} us/token (tree + index); resident memory +{current / 2**20:.0f} MiB "
          f"({current / index.tokens_held:.0f} B/token, tree keys included)")

    def lookup(tail: list[int]) -> float:
        seq = array("i", tail)
        t = time.perf_counter()
        pick_draft(seq, [lambda n, key: index.occurrences("ns", n, key)], settings, 7)
        return (time.perf_counter() - t) * 1e6

    hits = []
    for _ in range(args.lookups):
        s = seqs[rng.integers(len(seqs))]
        end = int(rng.integers(20, len(s) - 8))
        hits.append(lookup(s[end - 16:end].tolist()))
    misses = [lookup((rng.integers(0, VOCAB, 16)).tolist()) for _ in range(args.lookups)]
    for name, times in (("tail of a cached sequence", hits), ("random tail", misses)):
        times.sort()
        print(f"lookup, {name}: median {statistics.median(times):.1f} us, p99 {times[int(0.99 * len(times))]:.1f} us")

    t0 = time.perf_counter()
    freed = tree.evict(tree.evictable_pages // 2)
    evict = time.perf_counter() - t0
    index.check()
    print(f"evicted {freed * args.page_size:,} tokens in {evict:.2f} s ({evict / (freed * args.page_size) * 1e6:.2f} "
          f"us/token, index included); index checked: every place in live tokens, {index.tokens_held:,} held")


if __name__ == "__main__":
    main()
