"""The split between full and window pages follows demand (issue 56): by default a hybrid pool's
full pages and window pages draw from one pool of blocks (:class:`hicache.cache.pools.
SharedWindowAllocator`), so short contexts (windows are most of what they need) and long ones
(a checkpoint window each) both get what keeping every layer gets, or more, from the same bytes,
with no ratio to tune. Measured on the cache-only harness at Gemma 3 270M's geometry; exact on
``random:gemma-small`` (1 full layer, 5 sliding: five sliding groups of one layer)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cache_only import AUTO, CacheOnly, Geometry
from hicache import Engine
from hicache.runtime.request import Status
from hybrid_conversations import MODEL, check_host_blocks, conversations

pytestmark = pytest.mark.cache

MIB = 2**20


def agent_hits(ratio, agents: int = 32, turns: int = 4, pool_bytes: int = 512 * MIB) -> float:
    """Hit ratio of ``agents`` conversations of 0.5-1K tokens, each turn +50 tokens, round robin."""
    engine = CacheOnly(pool_bytes, ratio)
    rng = random.Random(0)
    convs = [[rng.randrange(1, 30000) for _ in range(rng.randrange(500, 1000))] for _ in range(agents)]
    hit = total = 0
    for _ in range(turns):
        for conv in convs:
            conv += [rng.randrange(1, 30000) for _ in range(50)]
            hit += engine.serve(conv)
            total += len(conv)
    return hit / total


def held_per_gib(ratio, length: int, pool_bytes: int = 256 * MIB) -> float:
    """Cached tokens a next request would hit, per GiB of pool, after serving twice what it holds."""
    engine = CacheOnly(pool_bytes, ratio)
    rng = np.random.default_rng(0)
    capacity = (engine.pool.num_pages - 1) * engine.geometry.page
    served = [rng.integers(10, 50_000, size=length).tolist() for _ in range(2 * capacity // length + 2)]
    for tokens in served:
        engine.serve(tokens)
    return sum(engine.held(t) for t in served) / (engine.pool.total_bytes / 2**30)


def test_short_contexts_hit_at_least_what_every_layer_hits_in_the_same_bytes() -> None:
    every, shared = agent_hits(None), agent_hits(AUTO)
    assert shared >= every > 0


@pytest.mark.parametrize("length", [4096, 8192])
def test_long_contexts_hold_three_times_the_tokens_per_gib(length) -> None:
    assert held_per_gib(AUTO, length) >= 3 * held_per_gib(None, length)


def test_a_shared_pool_maps_each_window_page_to_one_block_per_group() -> None:
    engine = CacheOnly(64 * MIB, AUTO)
    pool = engine.pool
    assert pool.windows.shared and pool.windows.groups == 5  # 15 sliding layers in groups of the 3 full layers
    assert len({t.data_ptr() for t in pool.k_buffers}) == 3
    assert pool.windows.pages - 1 == (pool.num_pages - 1) // 5
    engine.serve(list(range(1, 2000)))
    held = engine.cache.device.tree.windows.held_pages
    a = engine.cache.allocator
    # every block is free, a full page, or one of a held window page's five
    assert a.capacity - a.available == engine.cache.device.tree.cached_pages + 5 * held
    stats = engine.cache.device.usage()["window"]
    assert stats["shared_blocks"] and stats["cached_pages"] == held


PS = 4
BASE = dict(dtype="float32", kv_cache_dtype="float32", page_size=PS, chunked_prefill_size=12)


@pytest.mark.engine
@pytest.mark.parametrize("together, max_total_tokens", [(False, 4096), (True, 4096), (True, 200)])
def test_the_automatic_pool_gives_every_layers_tokens(together, max_total_tokens) -> None:
    """Multi-turn conversations, one at a time and batched, in a roomy pool and in one so small that
    windows and nodes are evicted while requests run."""
    every = conversations(Engine(MODEL, disable_hybrid_swa_memory=True, max_total_tokens=4096, **BASE),
                          together=together)
    engine = Engine(MODEL, max_total_tokens=max_total_tokens, **BASE)
    pool = engine.backend.core.pool
    assert pool.windows.shared and pool.windows.groups == 5
    outputs, cached = conversations(engine, together=together)
    assert outputs == every[0]
    if max_total_tokens == 4096:
        assert cached == every[1]


SMALL = Geometry(head_dim=8)  # Gemma 3 270M's layers, window and pages; small rows


def prompts(n: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 50_000, size=int(rng.integers(low, high))).tolist() for _ in range(n)]


def check_blocks(engine: CacheOnly) -> None:
    """Every block is free, a full page (the tree's or a request's own) or one of a window page's;
    the running requests' pages and budgets fit in the blocks."""
    windows, a = engine.cache.device.windows, engine.cache.allocator
    own = sum(len(r.kv.pages) - r.kv.cached_pages for r in engine.scheduler.running if r.kv is not None)
    window_ids = windows.allocator.ids.capacity - windows.allocator.ids.available
    assert a.capacity - a.available == engine.cache.tree.cached_pages + own + 5 * window_ids
    assert windows.held_pages + 5 * windows.reserved <= a.capacity
    engine.cache.tree.check_invariants()


@pytest.mark.engine
@pytest.mark.parametrize("blocks", [3000, 6000])
def test_long_prompts_admitted_together_in_a_tight_shared_pool_all_finish(blocks) -> None:
    """Eight 2.5-5K prompts in one batch, where their pages and windows take most of the blocks:
    admission keeps every running request's window budget free of full pages, so each window
    allocation succeeds (evicting windows, then nodes)."""
    engine = CacheOnly(blocks * SMALL.full_page_bytes, AUTO, SMALL, max_running_requests=8)
    reqs = [engine.add(p, max_new_tokens=4) for p in prompts(8, 2500, 5000)]
    step = engine.driver.step

    def step_and_check():
        out = step()
        check_blocks(engine)
        return out

    engine.driver.step = step_and_check
    engine.run(reqs)
    assert all(len(r.output_ids) == 4 for r in reqs)
    assert engine.cache.device.windows.reserved == engine.cache.device.windows.held_pages == 0


@pytest.mark.engine
def test_short_requests_run_together_in_a_shared_pool() -> None:
    pool_bytes = 1000 * (SMALL.full_page_bytes + SMALL.window_page_bytes)
    engine = CacheOnly(pool_bytes, AUTO, SMALL, max_running_requests=16)
    reqs = [engine.add(p, max_new_tokens=8) for p in prompts(16, 40, 41, seed=1)]
    engine.driver.step()
    assert sum(r.status is not Status.WAITING for r in reqs) == 16
    engine.run(reqs)
    check_blocks(engine)


@pytest.mark.engine
def test_a_shared_pool_over_a_host_tier_loads_windows_back_per_group() -> None:
    """A shared pool of a few blocks over host memory: conversations move through the host tier (one pool of
    blocks too: full pages and each sliding group's window blocks), their checkpoints' windows come back
    into each sliding group's device blocks, and the tokens are every layer's."""
    options = dict(BASE, max_total_tokens=100, enable_hierarchical_cache=True, hicache_ratio=8.0)
    every = conversations(Engine(MODEL, disable_hybrid_swa_memory=True, **dict(options, max_total_tokens=4096)),
                          agents=6, together=True)
    engine = Engine(MODEL, **options)
    host = engine.backend.core.host_pool
    assert host.shared and host.window_pool is host and host.windows.blocks.shape == ((host.num_pages - 1) // 5 + 1, 5)
    stats = {}
    generate = engine.generate

    def keep_stats(*a, **kw):
        out = generate(*a, **kw)
        engine.backend.core.cache.drain()
        check_host_blocks(engine)
        stats.update(engine.stats())
        return out

    engine.generate = keep_stats
    assert engine.backend.core.pool.windows.shared
    outputs, _ = conversations(engine, agents=6, together=True)
    assert outputs == every[0]
    assert stats["hit_tokens"]["host"] > 0
    window = stats["host_pool"]["window"]
    assert window["shared_blocks"] and window["cached_pages"] > 0 and window["pool_bytes"] == window["full_pool_bytes"]


@pytest.mark.engine
def test_the_engine_ready_line_names_one_shared_pool(caplog) -> None:
    """The two components' bytes are one pool's: the line says so instead of adding them up."""
    with caplog.at_level("INFO", logger="hicache.frontend.engine"):
        engine = Engine(MODEL, max_total_tokens=1024, **BASE)
        engine.shutdown()
    line = next(r.getMessage() for r in caplog.records if "engine ready" in r.getMessage())
    assert "of window pages, shared" in line and "+ window" not in line
