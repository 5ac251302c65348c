"""Admission into a hybrid pool by what a request will hold (issue 56, H1 and H2), on the engine's
cache manager and scheduler over Gemma 3 270M's pool geometry (``tests/cache_only.py``: a no-op
forward, real sizes): a prompt reserves the window pages of its first chunk, not a decode step's,
and a short request no more than its own pages."""

from __future__ import annotations

import numpy as np
import pytest

from cache_only import GEMMA3_270M, CacheOnly, Geometry
from hicache.runtime.request import Status

pytestmark = [pytest.mark.cache, pytest.mark.engine]

SMALL = Geometry(head_dim=8)  # Gemma 3 270M's layers, window and pages; small rows: the test holds little memory


def prompts(n: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 50_000, size=int(rng.integers(low, high))).tolist() for _ in range(n)]


def check_reservations(engine: CacheOnly) -> None:
    """What running requests hold or lock of the window component never exceeds what they reserved."""
    windows = engine.cache.device.windows
    held = sum(np.count_nonzero(r.kv.window.pages[r.kv.cached_pages:]) for r in engine.scheduler.running)
    assert held + engine.cache.tree.windows.usage()["locked_pages"] <= windows.reserved <= windows.allocator.capacity


@pytest.mark.parametrize("window_pages", [200, 400, 800])
def test_long_prompts_admitted_together_reserve_their_first_chunk_and_all_finish(window_pages) -> None:
    """H1: eight prompts of 2.5-5K tokens in one batch. Admission used to reserve a decode step's window
    (100 pages) for a request whose first forward is a 2K-token chunk (228 pages): the pool asserted
    ("cannot hold 128 pages within the reserved budgets") and the engine hung."""
    pages = 4000
    ratio = (window_pages - 1) / (pages - 1)
    engine = CacheOnly(pages * SMALL.full_page_bytes + ratio * pages * SMALL.window_page_bytes, ratio, SMALL,
                       max_running_requests=8)
    assert engine.cache.component_pages["window"] == max(window_pages - 1, 132)
    reqs = [engine.add(p, max_new_tokens=4) for p in prompts(8, 2500, 5000)]
    step = engine.driver.step

    def step_and_check():
        out = step()
        check_reservations(engine)
        engine.cache.tree.check_invariants()
        return out

    engine.driver.step = step_and_check
    engine.run(reqs)
    assert all(len(r.output_ids) == 4 for r in reqs)
    assert engine.cache.device.windows.reserved == 0


def test_short_requests_reserve_their_own_pages_not_a_whole_window() -> None:
    """H2: sixteen 40-token prompts in a window pool that holds two requests' full-window budgets ran one
    at a time (each reserved 100 pages); each needs at most its 3 pages, so all sixteen run at once, as
    they do when every layer's KV is kept in the same bytes."""
    pool_bytes = 1000 * (SMALL.full_page_bytes + SMALL.window_page_bytes)
    hybrid = CacheOnly(pool_bytes, 0.05, SMALL, max_running_requests=16)
    every = CacheOnly(pool_bytes, None, SMALL, max_running_requests=16)
    assert hybrid.cache.component_pages["window"] < 3 * hybrid.cache.device.windows.footprint(1)
    for engine in (hybrid, every):
        reqs = [engine.add(p, max_new_tokens=8) for p in prompts(16, 40, 41, seed=1)]
        engine.driver.step()
        assert sum(r.status is not Status.WAITING for r in reqs) == 16
        engine.run(reqs)
    assert hybrid.cache.device.windows.reserved == 0


def test_the_default_geometry_is_gemma3_270m() -> None:
    g = GEMMA3_270M
    assert (g.layers, len(g.window_layers), g.window, g.page) == (18, 15, 512, 16)
    assert g.window_page_bytes == 5 * g.full_page_bytes
