"""The multi-turn workload the hybrid-pool tests share: ``agents`` conversations over one shared head
on ``random:gemma-small`` (5 layers attending an 8-token window, 1 full layer), run greedily; the
exact settings they compare tokens under, a file store's, and a cold engine's outputs."""

from __future__ import annotations

import json

from hicache import Engine
from hicache.runtime.sampling import SamplingParams

MODEL = "random:gemma-small"
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
PS = 4  # tokens a page: the 8-token window spans two pages and reaches one more from a page boundary
EXACT = dict(dtype="float32", kv_cache_dtype="float32", page_size=PS, chunked_prefill_size=12, max_total_tokens=4096)
SYSTEM = [(7 * i + 3) % 200 + 20 for i in range(37)]  # a shared head, several windows long


def conversations(engine: Engine, agents: int = 3, turns: int = 3, together: bool = False,
                  keep: bool = False, final: list | None = None) -> tuple[list, list]:
    """``agents`` conversations of ``turns`` turns over SYSTEM, each turn its history + answer +
    a new message; returns every turn's output and cached tokens, in order (``final``, if given,
    receives each conversation's next prompt). The engine is shut down after, unless ``keep``."""
    histories = [SYSTEM + [(11 * a + i) % 200 + 20 for i in range(5 + 3 * a)] for a in range(agents)]
    outputs, cached = [], []
    try:
        for turn in range(turns):
            results = engine.generate(histories, GREEDY) if together else \
                [engine.generate([h], GREEDY)[0] for h in histories]
            for a, r in enumerate(results):
                outputs.append(r.output_ids)
                cached.append(r.cached_tokens)
                histories[a] = histories[a] + r.output_ids + [(13 * turn + a + i) % 200 + 20 for i in range(4 + turn)]
        if final is not None:
            final.extend(histories)
    finally:
        if not keep:
            engine.shutdown()
    return outputs, cached


def stored(path, **options) -> dict:
    """A small device pool over a host tier over a file store at ``path``."""
    return dict(EXACT, max_total_tokens=160, enable_hierarchical_cache=True, hicache_ratio=1.0,
                hicache_storage_backend="file", hicache_storage_backend_extra_config=json.dumps({"path": str(path)}),
                hicache_storage_prefetch_threshold=PS, **options)


def continue_from(path, prompts: list, **options) -> tuple[list, dict]:
    """A fresh engine over the store at ``path`` (room to prefetch a whole history, waiting for it) answers
    each of ``prompts``; the outputs and its stats."""
    engine = Engine(MODEL, **dict(stored(path, hicache_storage_prefetch_policy="wait_complete", **options),
                                  hicache_ratio=4.0))
    try:
        results = [engine.generate([p], GREEDY)[0] for p in prompts]
        return [r.output_ids for r in results], engine.stats()
    finally:
        engine.shutdown()


def cold_outputs(prompts: list) -> list:
    """Each prompt's output from an engine without prefix reuse."""
    engine = Engine(MODEL, disable_radix_cache=True, **EXACT)
    try:
        return [engine.generate([p], GREEDY)[0].output_ids for p in prompts]
    finally:
        engine.shutdown()


def check_host_blocks(engine: Engine) -> None:
    """A host pool of shared blocks: every block is free, a host full page, or one of a held host window
    page's (one per sliding group)."""
    cache = engine.backend.core.cache
    a, windows = cache.host_allocator, cache.host.windows.allocator
    held_windows = windows.ids.capacity - windows.ids.available
    assert a.capacity - a.available == cache.tree.host_pages_held + windows.groups * held_windows
