"""Micro-benchmark of the L1 prefix cache (RadixCache) against a naive per-page hash manager.

    python benchmarks/bench_radix.py [--tokens 1000000] [--page-size 64] [--repeat 7]

Measures, for one long prompt (1M tokens at page size 64 by default):
  * match_prefix of a full hit,
  * insert into an empty tree (cold) and insert of a prompt sharing 99% with a cached one,
  * tree memory (tracemalloc) for the prompt cached as one conversation and for 1000
    conversations of 1000 tokens that share a 500-token prefix,
and the same operations on a naive block manager: a dict from a per-page chained hash
(hash of the previous page's hash and the page's token tuple) to a page id, as a
hash-per-block cache does it. Token ids reach both as an int32 numpy array (the engine
converts once on arrival); the naive manager pays its own conversion to Python ints.

Targets (from the issue): match <= 5 ms, insert <= 20 ms, tree memory < 50 MB.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import tracemalloc

import numpy as np

try:
    from hicache.cache.pools import PageAllocator
    from hicache.cache.radix import RadixCache
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from hicache.cache.pools import PageAllocator
    from hicache.cache.radix import RadixCache

NS = "bench"
MS = 1e3
MB = 1 / 2**20


# ---- naive reference: per-page chained hashes ------------------------------------------------
class NaiveBlockManager:
    """dict: chained page hash -> page id. Match walks the pages until the first miss."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.blocks: dict[int, int] = {}

    def _hashes(self, tokens):
        ps = self.page_size
        ids = tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)
        h = None
        for i in range(0, len(ids) - len(ids) % ps, ps):
            h = hash((h, tuple(ids[i : i + ps])))
            yield h

    def match_prefix(self, tokens) -> list[int]:
        out = []
        blocks = self.blocks
        for h in self._hashes(tokens):
            page = blocks.get(h)
            if page is None:
                break
            out.append(page)
        return out

    def insert(self, tokens, pages) -> int:
        cached = 0
        blocks = self.blocks
        pages = pages.tolist()
        for i, h in enumerate(self._hashes(tokens)):
            if h in blocks:
                cached += 1
            else:
                blocks[h] = pages[i]
        return cached * self.page_size


# ---- helpers ---------------------------------------------------------------------------------
def timed(fn, setup=None, repeat=7):
    """Median and best wall time (seconds) of ``fn(state)``; ``setup()`` is untimed."""
    times = []
    for _ in range(repeat):
        state = setup() if setup else None
        gc.collect()
        gc.disable()
        t0 = time.perf_counter()
        fn(state)
        times.append(time.perf_counter() - t0)
        gc.enable()
    return statistics.median(times), min(times)


def traced_bytes(build):
    """Bytes still allocated (tracemalloc) by the object ``build()`` returns."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    obj = build()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del obj
    return after - before


def new_tree(ps, num_pages):
    return RadixCache(ps, PageAllocator(num_pages))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--conversations", type=int, default=1000)
    ap.add_argument("--conv-tokens", type=int, default=1000)
    ap.add_argument("--shared-tokens", type=int, default=500)
    args = ap.parse_args()

    ps, n_tok, rep = args.page_size, args.tokens, args.repeat
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 128_000, n_tok, dtype=np.int32)
    n_pages = n_tok // ps
    shared = int(n_tok * 0.99) // ps * ps
    prompt2 = np.concatenate([prompt[:shared], rng.integers(0, 128_000, n_tok - shared, dtype=np.int32)])
    pool = 2 * n_pages + 8
    pages = np.arange(1, n_pages + 1, dtype=np.int64)
    pages2 = np.arange(n_pages + 1, 2 * n_pages + 1, dtype=np.int64)

    def cached_tree():
        t = new_tree(ps, pool)
        t.insert(NS, prompt, pages)
        return t

    def cached_naive():
        m = NaiveBlockManager(ps)
        m.insert(prompt, pages)
        return m

    rows = []  # (label, radix seconds or bytes, naive, target, unit)

    # match, full hit (the tree is one node: no split on this path)
    tree, naive = cached_tree(), cached_naive()
    assert tree.match_prefix(NS, prompt).device_hit_tokens == n_pages * ps
    assert len(naive.match_prefix(prompt)) == n_pages
    r = timed(lambda _: tree.match_prefix(NS, prompt), repeat=rep)
    v = timed(lambda _: naive.match_prefix(prompt), repeat=rep)
    rows.append(("match_prefix, full hit", r, v, 5e-3, "time"))

    # match that ends inside the cached node (splits it: the first request of a new branch)
    r = timed(lambda t: t.match_prefix(NS, prompt2), setup=cached_tree, repeat=rep)
    v = timed(lambda m: m.match_prefix(prompt2), setup=cached_naive, repeat=rep)
    rows.append(("match_prefix, 99% hit (split)", r, v, 5e-3, "time"))

    # cold insert
    r = timed(lambda t: t.insert(NS, prompt, pages), setup=lambda: new_tree(ps, pool), repeat=rep)
    v = timed(lambda m: m.insert(prompt, pages), setup=lambda: NaiveBlockManager(ps), repeat=rep)
    rows.append(("insert, cold (empty tree)", r, v, 20e-3, "time"))

    # insert sharing 99% with a cached prompt
    check = cached_tree()
    assert check.insert(NS, prompt2, pages2) == shared
    r = timed(lambda t: t.insert(NS, prompt2, pages2), setup=cached_tree, repeat=rep)
    v = timed(lambda m: m.insert(prompt2, pages2), setup=cached_naive, repeat=rep)
    rows.append(("insert, 99% shared", r, v, 20e-3, "time"))

    # memory: one conversation of n_tok tokens
    r_mem = traced_bytes(cached_tree)
    v_mem = traced_bytes(cached_naive)
    rows.append((f"memory, 1 x {n_tok:,} tok", r_mem, v_mem, 50 * 2**20, "bytes"))

    # memory: many conversations sharing a prefix
    nc, ct, st = args.conversations, args.conv_tokens, args.shared_tokens
    prefix = rng.integers(0, 128_000, st, dtype=np.int32)
    convs = [np.concatenate([prefix, rng.integers(0, 128_000, ct - st, dtype=np.int32)]) for _ in range(nc)]
    cp = ct // ps
    conv_pool = nc * cp + 8

    def many_tree():
        t = new_tree(ps, conv_pool)
        for i, c in enumerate(convs):
            pg = np.arange(1 + i * cp, 1 + (i + 1) * cp, dtype=np.int64)
            t.insert(NS, c, pg)
        return t

    def many_naive():
        m = NaiveBlockManager(ps)
        for i, c in enumerate(convs):
            pg = np.arange(1 + i * cp, 1 + (i + 1) * cp, dtype=np.int64)
            m.insert(c, pg)
        return m

    r_mem = traced_bytes(many_tree)
    v_mem = traced_bytes(many_naive)
    rows.append((f"memory, {nc} x {ct} tok, {st} shared", r_mem, v_mem, 50 * 2**20, "bytes"))
    mt, mn = many_tree(), many_naive()
    n_nodes = mt.num_nodes()
    r = timed(lambda _: [mt.match_prefix(NS, c) for c in convs[:100]], repeat=rep)
    v = timed(lambda _: [mn.match_prefix(c) for c in convs[:100]], repeat=rep)
    rows.append((f"match x100, {nc}-conv tree", r, v, None, "time"))

    # ---- table -------------------------------------------------------------------------------
    print(f"RadixCache vs naive per-page hash manager: {n_tok:,}-token prompt, page size {ps}, "
          f"{n_pages:,} pages, median of {rep} (best in brackets); {nc}-conv tree has {n_nodes} nodes")
    print(f"{'operation':<36} {'radix':>20} {'naive':>20} {'naive/radix':>11} {'target':>9}  ok")
    print("-" * 104)
    for label, r, v, target, unit in rows:
        if unit == "time":
            (rm, rb), (vm, vb) = r, v
            rs, vs = f"{rm * MS:8.3f} ms ({rb * MS:.3f})", f"{vm * MS:8.2f} ms ({vb * MS:.2f})"
            ratio = vm / rm
            tgt = f"<={target * MS:g} ms" if target else "-"
            ok = "" if target is None else ("yes" if rm <= target else "NO")
        else:
            rs, vs = f"{r * MB:8.2f} MiB", f"{v * MB:8.2f} MiB"
            ratio = v / r
            tgt = f"<{target * MB:g} MiB"
            ok = "yes" if r < target else "NO"
        print(f"{label:<36} {rs:>20} {vs:>20} {ratio:>10.1f}x {tgt:>9}  {ok}")


if __name__ == "__main__":
    main()
