"""The CUDA path (issue 50): tests that need a GPU are marked ``cuda`` and skipped without one;
``tools/gpu_check.sh`` runs them on a device machine. Each also runs on the CPU here, so its logic
(what it compares, what it counts) is checked on every machine before GPU time is spent on it.

Hits from each tier give the cold run's greedy tokens: the device tier (L1), the host tier (L2,
pinned host memory and side-stream copies on a GPU), the storage tier (L3, a fresh engine over a
file store), in float32. (bfloat16 is not asserted token-equal: on the CPU too a hit and a cold
pass round differently -- the same KV, other matmul shapes -- and a near-tie flips a token; the
GPU session should measure how often rather than assert it.)
"""

from __future__ import annotations

import json

import pytest
import torch

from hicache import Engine
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
    """Each prompt, then each prompt again (a hit); outputs and per-tier hits of the second round."""
    try:
        first = [e.generate([p], GREEDY)[0].output_ids for p in PROMPTS]
        again = [e.generate([p], GREEDY)[0] for p in PROMPTS]
        return first + [r.output_ids for r in again], [r.cached_tokens_details for r in again]
    finally:
        if not keep:
            e.shutdown()


@pytest.mark.parametrize("dtype", ["float32"])
@pytest.mark.parametrize("device", DEVICES)
def test_hits_from_each_tier_give_the_cold_tokens(device, dtype, tmp_path) -> None:
    cold, _ = turns(engine(device, dtype, disable_radix_cache=True))
    l1, hits = turns(engine(device, dtype, max_total_tokens=4096))
    assert l1 == cold and all(h["device"] > 0 for h in hits)
    # a device pool of 80 tokens holds the shared head and one prompt's rest: the others' come back from host memory
    l2, hits = turns(engine(device, dtype, max_total_tokens=80, enable_hierarchical_cache=True, hicache_ratio=8.0))
    assert l2 == cold and sum(h["host"] for h in hits) > 0
    store = dict(max_total_tokens=80, enable_hierarchical_cache=True, hicache_ratio=1.0,
                 hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete",
                 hicache_storage_prefetch_threshold=4,
                 hicache_storage_backend_extra_config=json.dumps({"path": str(tmp_path)}))
    turns(engine(device, dtype, **store))  # writes them through to the store
    fresh = engine(device, dtype, **store)
    outputs = [fresh.generate([p], GREEDY)[0] for p in PROMPTS]
    fresh.shutdown()
    assert [r.output_ids for r in outputs] == cold[:3] and sum(r.cached_tokens_details["storage"] for r in outputs) > 0


def resident_bytes() -> int:
    """This process's resident memory (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


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
