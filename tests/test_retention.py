"""Retention hints in the cache tiers (issue 60 item 1): retained prefixes leave a tier only after
every unretained one, are demoted rather than dropped, fit a per-tier budget (clipped, never
refused), expire back to LRU, and never change tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.cache.manager import KVCacheManager
from hicache.cache.host_pool import HostKVPool
from hicache.cache.pools import DeviceKVPool
from hicache.cache.storage.memory import MemoryBackend
from hicache.cache.tiers import CachePolicy
from hicache.cache_hints import RetentionHint

pytestmark = pytest.mark.cache

PAGE = 4
NS = "ns"


def _manager(device_pages: int = 12, host_pages: int | None = None, fraction: float = 0.5,
             write_policy: str = "write_through", storage: MemoryBackend | None = None,
             storage_write_policy: str = "write_through") -> KVCacheManager:
    pool = DeviceKVPool(2, 1, 4, num_pages=device_pages, page_size=PAGE, dtype=torch.float32, device="cpu")
    host = HostKVPool(pool, num_pages=host_pages) if host_pages else None
    policy = CachePolicy(write_policy=write_policy, retention_max_fraction=fraction,
                         storage_write_policy=storage_write_policy, storage_op_timeout=None)
    return KVCacheManager(pool, host, storage, policy)


def _tokens(first: int, pages: int) -> np.ndarray:
    return np.arange(first, first + pages * PAGE, dtype=np.int32)


def _run(mgr: KVCacheManager, tokens: np.ndarray, hints=(), stamp: float = 0.0):
    """One request: admit, 'compute', release, grant its hints, drain the copies. Its outcome."""
    mgr.retention.advance(stamp)
    state = mgr.admit(NS, tokens, len(tokens))
    assert state is not None
    mgr.release(NS, tokens, state)
    outcome = mgr.retention.apply(NS, tokens, hints, stamp)
    mgr.drain()
    mgr.tree.check_invariants()
    return outcome


def _device_tokens(mgr: KVCacheManager, tokens: np.ndarray) -> int:
    return mgr.tree.peek_prefix(NS, tokens).device_hit_tokens


def _cached_tokens(mgr: KVCacheManager, tokens: np.ndarray) -> int:
    peek = mgr.tree.peek_prefix(NS, tokens)
    return peek.device_hit_tokens + peek.host_hit_tokens


def test_a_retained_prefix_outlives_a_flood_on_the_device_and_lru_takes_it_without_the_hint():
    for hinted in (True, False):
        mgr = _manager(device_pages=12)
        lead = _tokens(1000, 4)  # 4 of the 11 usable pages; the budget is 6
        out = _run(mgr, lead, [RetentionHint(None, 60.0)] if hinted else (), stamp=100.0)
        for i in range(6):  # a flood of one-off prompts, each 4 pages: the pool turns over twice
            _run(mgr, _tokens(10_000 * (i + 1), 4), stamp=101.0 + i)
        assert _device_tokens(mgr, lead) == (len(lead) if hinted else 0)
        if hinted:
            assert (out.retained_tokens, out.tier, out.until, out.clipped) == (16, "device", 160.0, None)
        else:
            assert out is None


def test_expired_retention_is_plain_lru_again():
    mgr = _manager(device_pages=12)
    lead = _tokens(1000, 4)
    _run(mgr, lead, [RetentionHint(None, 5.0)], stamp=100.0)
    for i in range(6):  # arrivals after the expiry (100 + 5): the lead is the least recently used
        _run(mgr, _tokens(10_000 * (i + 1), 4), stamp=106.0 + i)
    assert _device_tokens(mgr, lead) == 0
    assert mgr.retention.usage()["expired_tokens"] == 16


def test_a_hint_over_the_budget_is_clipped_and_the_request_still_runs():
    mgr = _manager(device_pages=12, fraction=0.25)  # budget: int(0.25 * 11) = 2 pages
    lead = _tokens(1000, 4)
    out = _run(mgr, lead, [RetentionHint(None, 60.0)], stamp=1.0)
    assert out.retained_tokens == 2 * PAGE and out.tier == "device"
    assert "retention budget full" in out.clipped and "--cache-retention-max-fraction 0.25" in out.clipped
    zero = _manager(device_pages=12, fraction=0.0)
    out = _run(zero, lead, [RetentionHint(None, 60.0)], stamp=1.0)
    assert out.retained_tokens == 0 and out.tier is None and out.clipped
    assert zero.retention.usage()["clipped"] == 1


def test_a_breakpoint_retains_the_prefix_up_to_it_in_whole_pages():
    mgr = _manager(device_pages=12)
    lead = _tokens(1000, 4)
    out = _run(mgr, lead, [RetentionHint(2 * PAGE + 3, 60.0, ttl="5m")], stamp=1.0)
    assert out.retained_tokens == 2 * PAGE
    for i in range(6):
        _run(mgr, _tokens(10_000 * (i + 1), 4), stamp=2.0 + i)
    assert _device_tokens(mgr, lead) == 2 * PAGE  # the breakpoint's prefix; the rest went with the flood


def test_past_the_device_budget_a_hint_is_kept_in_the_host_and_demoted_there_not_dropped():
    # write_through_selective: nothing is copied to the host on a first insert, so only demotion puts it there
    mgr = _manager(device_pages=12, host_pages=24, fraction=0.25, write_policy="write_through_selective")
    lead = _tokens(1000, 4)  # device budget 2 pages (< 4): host budget int(0.25 * 24) = 6 holds it
    out = _run(mgr, lead, [RetentionHint(None, 60.0)], stamp=1.0)
    assert (out.retained_tokens, out.tier, out.clipped) == (16, "host", None)
    for i in range(6):
        _run(mgr, _tokens(10_000 * (i + 1), 4), stamp=2.0 + i)
    assert _device_tokens(mgr, lead) == 0 and _cached_tokens(mgr, lead) == len(lead)
    flood = _tokens(10_000, 4)
    assert _cached_tokens(mgr, flood) == 0  # unretained victims without a host copy were dropped
    assert mgr.retention.usage()["retained_tokens"] == {"device": 0, "host": 16}


def test_host_eviction_takes_unretained_leaves_first():
    mgr = _manager(device_pages=12, host_pages=12, fraction=0.5)
    lead = _tokens(1000, 4)
    _run(mgr, lead, [RetentionHint(None, 60.0)], stamp=1.0)
    for i in range(8):  # every prompt is written through to a host pool of 11 pages: it turns over
        _run(mgr, _tokens(10_000 * (i + 1), 4), stamp=2.0 + i)
    assert _cached_tokens(mgr, lead) == len(lead)
    assert mgr.stats.evicted_host_pages > 0


def test_release_makes_a_retained_prefix_plain_lru():
    mgr = _manager(device_pages=12)
    lead = _tokens(1000, 4)
    _run(mgr, lead, [RetentionHint(None, 3600.0)], stamp=1.0)
    assert mgr.retention.release(NS, lead) == 16
    for i in range(6):
        _run(mgr, _tokens(10_000 * (i + 1), 4), stamp=2.0 + i)
    assert _device_tokens(mgr, lead) == 0
    assert mgr.retention.usage()["released_tokens"] == 16


def test_a_higher_priority_is_evicted_later_among_retained_prefixes():
    mgr = _manager(device_pages=12, fraction=1.0)
    low, high = _tokens(1000, 4), _tokens(2000, 4)
    _run(mgr, high, [RetentionHint(None, 60.0, priority=5)], stamp=1.0)
    _run(mgr, low, [RetentionHint(None, 60.0, priority=0)], stamp=2.0)  # more recent, lower priority
    _run(mgr, _tokens(3000, 4), stamp=3.0)  # needs 4 of the 3 free pages: a retained one must go
    assert _device_tokens(mgr, high) == len(high) and _device_tokens(mgr, low) < len(low)


def test_selective_storage_writes_keep_only_retained_prefixes_in_l3():
    store = MemoryBackend()
    mgr = _manager(device_pages=12, host_pages=24, storage=store, storage_write_policy="selective")
    lead, other = _tokens(1000, 4), _tokens(5000, 4)
    _run(mgr, lead, [RetentionHint(None, 60.0)], stamp=1.0)
    _run(mgr, other, stamp=2.0)
    mgr.drain()
    written = store.stats().sets
    assert written == 4  # the lead's four pages, none of the other prompt's
    everything = MemoryBackend()
    mgr = _manager(device_pages=12, host_pages=24, storage=everything)
    _run(mgr, lead, [RetentionHint(None, 60.0)], stamp=1.0)
    _run(mgr, other, stamp=2.0)
    mgr.drain()
    assert everything.stats().sets == 8


def _stored_pages(mgr: KVCacheManager, store: MemoryBackend, tokens: np.ndarray) -> int:
    """Leading pages of ``tokens`` whose objects the store holds."""
    from hicache.cache.storage.keys import page_hashes

    digest = mgr.keys.digest(NS)
    keys = [obj.key(h, digest) for h in page_hashes(tokens, PAGE, digest) for obj in mgr.storage.writes]
    return store.exists_prefix(keys) // len(mgr.storage.writes)


def test_a_capped_store_drops_retained_objects_after_every_unretained_one():
    for hinted in (True, False):
        store = MemoryBackend(max_objects=10)
        mgr = _manager(device_pages=12, host_pages=12, storage=store)
        lead = _tokens(1000, 4)
        _run(mgr, lead, [RetentionHint(None, 60.0)] if hinted else (), stamp=1.0)
        for i in range(6):  # 24 more objects through a store of 10
            _run(mgr, _tokens(10_000 * (i + 1), 4), stamp=2.0 + i)
        mgr.drain()
        assert _stored_pages(mgr, store, lead) == (4 if hinted else 0)
        assert store.stats().evictions > 0
