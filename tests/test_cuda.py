"""The CUDA path (issue 50): tests that need a GPU are marked ``cuda`` and skipped without one;
``tools/gpu_check.sh`` runs them on a device machine. Each also runs on the CPU here, so its logic
(what it compares, what it counts) is checked on every machine before GPU time is spent on it.

Hits from each tier give the cold run's greedy tokens: the device tier (L1), the host tier (L2,
pinned host memory and side-stream copies on a GPU), the storage tier (L3, a fresh engine over a
file store), in float32, every page accounted for after each run. In bfloat16 the three tiers give
one another's tokens (they hand the forward the same KV bits and the same matmul shapes); against
the cold run they are not asserted equal -- a hit and a cold pass round differently (the same KV,
other matmul shapes), on the CPU too, and a near-tie flips a token -- and the rate is printed.

On a GPU: the load-back hidden behind compute on a model large enough for it (>= 50%, measured by
``benchmarks/bench_gpu.py``'s L2 hit: layer-wise against load-all-then-compute); here on the CPU:
the GPU's attention path (one SDPA call over joined key blocks) gives the CPU path's tokens.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch

from hicache import Engine
from hicache.device import resident_bytes
from hicache.runtime.sampling import SamplingParams

pytestmark = pytest.mark.cache

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU")])]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
HEAD = [(13 * i + 5) % 200 + 20 for i in range(40)]
PROMPTS = [HEAD + [(7 * a + i) % 200 + 20 for i in range(9 + 4 * a)] for a in range(3)]


def engine(device: str, dtype: str, **options) -> Engine:
    return Engine("random:small", device=device, dtype=dtype, kv_cache_dtype=dtype, page_size=4, **options)


def turns(e: Engine, keep: bool = False) -> tuple[list, list]:
    """Each prompt, then each prompt again (a hit); outputs and per-tier hits of the second round.
    Every device and host page is accounted for at the end."""
    try:
        first = [e.generate([p], GREEDY)[0].output_ids for p in PROMPTS]
        again = [e.generate([p], GREEDY)[0] for p in PROMPTS]
        assert_balanced(e)
        return first + [r.output_ids for r in again], [r.cached_tokens_details for r in again]
    finally:
        if not keep:
            e.shutdown()


def assert_balanced(e: Engine) -> None:
    """Page ownership once every request has finished and every transfer is acknowledged: no request
    or transfer holds a page or a lock; every device and host page is free or in the tree; the
    tree's counters match its nodes."""
    e.cache.drain()  # backups still in flight lock their nodes until acknowledged
    u = e.cache.usage()
    assert u["request_pages"] == 0 and u["locked_pages"] == 0, u  # every request has finished
    assert u["free_pages"] + u["cached_pages"] == u["capacity_pages"], u
    if e.cache.host is not None:
        h = e.cache.host_usage()
        assert h["free_pages"] + h["cached_pages"] == h["capacity_pages"], h
    if e.cache.tree is not None:  # no radix cache: nothing cached
        e.cache.tree.check_invariants()


def storage_options(path: Path) -> dict:
    return dict(max_total_tokens=80, enable_hierarchical_cache=True, hicache_ratio=4.0,
                hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete",
                hicache_storage_prefetch_threshold=4,
                hicache_storage_backend_extra_config=json.dumps({"path": str(path)}))


def tier_runs(device: str, dtype: str, store: Path) -> dict[str, tuple[list, list]]:
    """Outputs and second-round hits with no cache, L1 hits, L2 hits (a device pool of 80 tokens holds
    the shared head and one prompt's rest: the others come back from host memory) and L3 hits (a fresh
    engine over a file store the first one wrote through to; its host pool holds a whole prompt: a
    prefetch may take at most half of it)."""
    runs = {"cold": turns(engine(device, dtype, disable_radix_cache=True)),
            "l1": turns(engine(device, dtype, max_total_tokens=4096)),
            "l2": turns(engine(device, dtype, max_total_tokens=80, enable_hierarchical_cache=True, hicache_ratio=8.0))}
    turns(engine(device, dtype, **storage_options(store)))  # writes them through to the store
    fresh = engine(device, dtype, **storage_options(store))
    try:
        outputs = [fresh.generate([p], GREEDY)[0] for p in PROMPTS]
        assert_balanced(fresh)
    finally:
        fresh.shutdown()
    runs["l3"] = ([r.output_ids for r in outputs], [r.cached_tokens_details for r in outputs])
    return runs


@pytest.mark.parametrize("device", DEVICES)
def test_hits_from_each_tier_give_the_cold_tokens(device, tmp_path) -> None:
    runs = tier_runs(device, "float32", tmp_path)
    cold = runs["cold"][0]
    assert runs["l1"][0] == cold and all(h["device"] > 0 for h in runs["l1"][1])
    assert runs["l2"][0] == cold and sum(h["host"] for h in runs["l2"][1]) > 0
    assert runs["l3"][0] == cold[:3] and sum(h["storage"] for h in runs["l3"][1]) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_hits_from_each_tier_agree(device, tmp_path, monkeypatch) -> None:
    """Bit for bit with the GPU's attention path (joined key blocks: the runs a prefix is stored in
    do not change the sum; the CPU's merged partials round per run, so there it is forced)."""
    if device == "cpu":
        force_joined_attention(monkeypatch)
    runs = tier_runs(device, "bfloat16", tmp_path)
    hits = {tier: runs[tier][0][3:] if tier != "l3" else runs[tier][0] for tier in ("l1", "l2", "l3")}
    cached = {tier: [sum(h.values()) for h in runs[tier][1]] for tier in hits}
    assert cached["l1"] == cached["l2"] == cached["l3"], cached  # the same prefix from each tier
    assert hits["l1"] == hits["l2"] == hits["l3"]
    cold = runs["cold"][0][3:]
    same = sum(a == b for h, c in zip(hits["l1"], cold) for a, b in zip(h, c))
    print(f"bfloat16 on {device}: hits give the cold run's token at {same} of {sum(map(len, cold))} positions")


def test_the_gpu_attention_path_gives_the_cpu_paths_tokens(monkeypatch) -> None:
    """Off the CPU a prefill over cached blocks is one SDPA call over the joined blocks, causal to
    the lower right (model/attention.py); forced here on the CPU, prompt chunks of 32 over cached
    chunks and turns extending a cached history by 24-40 tokens (wider than the row layout's 16)
    give the merged-partials path's greedy tokens in float32."""
    from hicache.model import attention

    history = [(17 * i + 3) % 280 + 20 for i in range(70)]
    turns_ = [history[:40], history[:40] + history[40:64], history, history + HEAD[:40]]

    def run() -> list:
        e = engine("cpu", "float32", chunked_prefill_size=32, max_total_tokens=4096)
        try:
            return [e.generate([p], GREEDY)[0].output_ids for p in turns_]
        finally:
            e.shutdown()

    merged = run()
    joined_calls = []
    real = attention.joined_attention
    monkeypatch.setattr(attention, "joined_attention",
                        lambda q, full, new, kv_map: joined_calls.append(len(q)) or real(q, full, new, kv_map))
    force_joined_attention(monkeypatch)
    assert run() == merged
    assert max(joined_calls) > 16  # prompt chunks and turns over cached blocks took the joined path


def force_joined_attention(monkeypatch) -> None:
    """The model's prefills over cached blocks take the GPU's joined path on any device."""
    from hicache.model import attention, paged

    monkeypatch.setattr(paged, "sequence_attention", functools.partial(attention.sequence_attention, joined=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_load_back_hides_behind_compute_on_a_large_model() -> None:
    """Llama-3-8B's layer shape (8 of its 32 layers), bf16: an 8K-token prefix from host memory plus 2K
    new tokens. Loading layer by layer, with layer i's forward waiting for layer i only, hides at least
    half the load-back time that load-all-then-compute adds (the compute of 2K tokens per layer
    outlasts the copy of 8K tokens' KV per layer on an H200, so nearly all of it can be hidden)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_gpu import LLAMA3_8B, l2_hit_ttft

    model = "random:" + json.dumps({**LLAMA3_8B, "num_layers": 8, "vocab_size": 32000})
    r = l2_hit_ttft(model, torch.device("cuda"), 8192, 2048, "bfloat16", reps=3)
    print(json.dumps(r))
    assert r["host_hit_tokens"] >= 8192 - 16
    assert r["hidden_fraction"] >= 0.5, r


@pytest.mark.parametrize("device", DEVICES)
def test_a_thousand_backup_and_load_cycles_hold_no_more_memory(device) -> None:
    """Page copies through the transfer controller, both ways, 1,000 times over shuffled pages: the
    staging buffers are reused, pinned host memory is not allocated per copy (on a GPU: the device's
    allocated bytes and the process's resident memory stay where the first cycles left them)."""
    import numpy as np

    from hicache.cache.host_pool import HostKVPool
    from hicache.cache.host_transfer import BACKUP, LOAD, TransferController
    from hicache.cache.pools import DeviceKVPool

    pool = DeviceKVPool(4, 2, 64, 65, 16, torch.bfloat16, device)
    ctrl = TransferController(pool, HostKVPool(pool, 65, "page_first"))
    rng = np.random.default_rng(0)

    def cycles(n: int) -> None:
        for _ in range(n):
            pages = rng.permutation(np.arange(1, 65))[:48]
            for kind in (BACKUP, LOAD):
                ctrl.submit(kind, pages, rng.permutation(pages), [])
                ctrl.pop(kind, 1)

    try:
        cycles(20)  # staging buffers and allocator caches reach their size
        rss, allocated = resident_bytes(), torch.cuda.memory_allocated() if device == "cuda" else 0
        cycles(1000)
        grown = resident_bytes() - rss
        assert grown < 16 * 2**20, f"resident memory grew {grown / 2**20:.1f} MiB over 1,000 cycles"
        if device == "cuda":
            assert torch.cuda.memory_allocated() == allocated
    finally:
        ctrl.shutdown()


def test_the_gpu_copy_staging_is_budgeted() -> None:
    """On a GPU the host tier's copy workers stage through fixed buffers (a longer op goes through in
    chunks), whose bytes the KV budget sets aside first (DESIGN invariant 6): for Llama-3-8B's rows
    of 16 tokens in bf16, two buffers of 256 pages of 32 KiB; a hybrid pool's window rows double
    it; a CPU, or no host tier, none."""
    from hicache.config import EngineConfig
    from hicache.runtime.rank_plan import _transfer_staging

    cfg = EngineConfig(model="random:small", enable_hierarchical_cache=True)
    cuda, layer_page = torch.device("cuda"), 2 * 16 * 8 * 128 * 2  # K and V of one layer's page, bf16
    assert _transfer_staging(cfg, cuda, layer_page, 2, False, None) == 2 * 256 * 16 * 8 * 128 * 2
    assert _transfer_staging(cfg, cuda, layer_page, 2, True, None) == 2 * 2 * 256 * 16 * 8 * 128 * 2
    assert _transfer_staging(cfg, torch.device("cpu"), layer_page, 2, False, None) == 0
    assert _transfer_staging(EngineConfig(model="random:small"), cuda, layer_page, 2, False, None) == 0
