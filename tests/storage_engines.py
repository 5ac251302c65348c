"""Engines over an L3 file store for the storage tests (test_hicache_l3, test_storage_resilience)."""

from __future__ import annotations

import json
from pathlib import Path

from hicache import Engine, SamplingParams

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
PROMPT = [(i * 37 + 11) % 240 + 5 for i in range(400)]  # 24 whole pages (of 16) before its last token


def storage_engine(path: Path, **kw) -> Engine:
    """A tiny random engine with L2 and a file store at ``path``, waiting for its prefetches;
    ``kw`` overrides any option (``model`` too)."""
    opts = dict(dtype="float32", page_size=16, max_total_tokens=2048, enable_hierarchical_cache=True,
                hicache_storage_backend="file",
                hicache_storage_backend_extra_config=json.dumps({"path": str(path)}),
                hicache_storage_prefetch_threshold=64, hicache_storage_prefetch_policy="wait_complete")
    opts.update(kw)
    return Engine(opts.pop("model", "random:tiny"), **opts)


def write_history(path: Path) -> None:
    """One engine computes PROMPT and, on shutdown, has flushed its pages down to storage."""
    engine = storage_engine(path)
    engine.generate([PROMPT], GREEDY)
    engine.shutdown()
