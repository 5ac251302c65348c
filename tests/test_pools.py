"""Device page allocator, page -> slot mapping and the device KV pool buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cache.pools import DeviceKVPool, PageAllocator, pages_to_slots

pytestmark = pytest.mark.cache


# ---- PageAllocator --------------------------------------------------------------------------
def test_capacity_excludes_reserved_page():
    a = PageAllocator(8)
    assert a.capacity == 7
    assert a.available == 7


def test_needs_a_usable_page():
    with pytest.raises(ValueError):
        PageAllocator(1)
    PageAllocator(2)  # one usable page is enough


def test_alloc_free_accounting():
    a = PageAllocator(10)
    p = a.alloc(4)
    assert len(p) == 4 and a.available == 5
    q = a.alloc(5)
    assert len(q) == 5 and a.available == 0
    a.free(p)
    assert a.available == 4
    a.free(q[:2])
    assert a.available == 6
    a.free(np.zeros(0, dtype=np.int64))
    assert a.available == 6
    a.free(q[2:])
    assert a.available == a.capacity
    assert sorted(a.alloc(9).tolist()) == list(range(1, 10))


def test_alloc_zero_is_empty():
    a = PageAllocator(4)
    p = a.alloc(0)
    assert p is not None and len(p) == 0 and a.available == 3


def test_over_allocation_refused_without_change():
    a = PageAllocator(6)
    first = a.alloc(2)
    before = a.available
    assert a.alloc(before + 1) is None
    assert a.available == before
    rest = a.alloc(before)
    assert len(rest) == before and a.available == 0
    assert a.alloc(1) is None and a.available == 0
    assert set(first.tolist()).isdisjoint(rest.tolist())


def test_negative_alloc_rejected():
    a = PageAllocator(6)
    with pytest.raises(ValueError):
        a.alloc(-1)
    assert a.available == 5


def test_page_zero_never_handed_out_and_no_duplicates():
    a = PageAllocator(5)
    got = a.alloc(4)
    assert 0 not in got.tolist()
    assert len(set(got.tolist())) == 4
    a.free(got[::-1])
    again = a.alloc(4)
    assert 0 not in again.tolist() and sorted(again.tolist()) == [1, 2, 3, 4]


def test_reset_restores_everything():
    a = PageAllocator(5)
    a.alloc(3)
    a.reset()
    assert a.available == a.capacity == 4


def test_allocation_order_is_deterministic():
    """Page ids are a pure function of the alloc/free sequence (ranks replaying the same calls
    get the same ids, DESIGN invariant 3): fresh pages in ascending order, freed pages queued
    behind them first in, first out."""
    a = PageAllocator(16)
    x = a.alloc(5)
    y = a.alloc(3)
    assert (x.tolist(), y.tolist()) == ([1, 2, 3, 4, 5], [6, 7, 8])
    a.free(x[1:4])  # 2, 3, 4 queue behind the never-used 9 .. 15
    assert a.alloc(6).tolist() == [9, 10, 11, 12, 13, 14]
    a.free(y)  # 6, 7, 8 queue behind 15, 2, 3, 4
    assert a.alloc(4).tolist() == [15, 2, 3, 4]
    assert a.alloc(3).tolist() == [6, 7, 8] and a.available == 0


def test_returned_pages_are_not_aliased_by_later_allocs():
    """A caller may write into its page table; that must not change what the allocator hands out."""
    a = PageAllocator(8)
    p = a.alloc(3)
    p[:] = 0
    q = a.alloc(4)
    assert 0 not in q.tolist() and len(set(q.tolist())) == 4


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 40), st.lists(st.tuples(st.booleans(), st.integers(0, 45)), max_size=60))
def test_allocator_random_ops(num_pages, ops):
    a = PageAllocator(num_pages)
    held: list[int] = []
    for is_alloc, k in ops:
        if is_alloc:
            before = a.available
            p = a.alloc(k)
            if k > before:
                assert p is None and a.available == before
            else:
                assert p is not None and len(p) == k and a.available == before - k
                assert 0 not in p.tolist()
                assert set(p.tolist()).isdisjoint(held), "page handed out twice"
                assert len(set(p.tolist())) == k
                held.extend(p.tolist())
        elif held:
            k = k % (len(held) + 1)
            back, held = held[:k], held[k:]
            a.free(np.array(back, dtype=np.int64))
        assert a.available + len(held) == a.capacity
    a.free(np.array(held, dtype=np.int64))
    assert a.available == a.capacity
    assert sorted(a.alloc(a.capacity).tolist()) == list(range(1, num_pages))


# ---- pages_to_slots -------------------------------------------------------------------------
def test_pages_to_slots_maps_each_page_to_its_slots():
    s = pages_to_slots(np.array([3, 1, 7]), 4)
    assert s.dtype == torch.int64
    assert s.tolist() == [12, 13, 14, 15, 4, 5, 6, 7, 28, 29, 30, 31]


def test_pages_to_slots_truncates_to_num_tokens():
    assert pages_to_slots(np.array([2, 5]), 4, 6).tolist() == [8, 9, 10, 11, 20, 21]
    assert pages_to_slots(np.array([2, 5]), 4, 0).tolist() == []


def test_pages_to_slots_page_size_one_and_empty():
    assert pages_to_slots(np.array([9, 4]), 1).tolist() == [9, 4]
    assert pages_to_slots(np.zeros(0, dtype=np.int64), 8).tolist() == []


@given(st.lists(st.integers(1, 1000), max_size=20), st.integers(1, 16))
def test_pages_to_slots_property(pages, page_size):
    s = pages_to_slots(np.array(pages, dtype=np.int64), page_size).tolist()
    assert len(s) == len(pages) * page_size
    for i, slot in enumerate(s):
        assert slot // page_size == pages[i // page_size]
        assert slot % page_size == i % page_size


# ---- DeviceKVPool ---------------------------------------------------------------------------
def test_device_pool_shapes_and_bytes():
    pool = DeviceKVPool(num_layers=3, num_kv_heads=2, head_dim=8, num_pages=5, page_size=4,
                        dtype=torch.float16, device="cpu")
    assert pool.num_slots == 20
    assert len(pool.k_buffers) == len(pool.v_buffers) == 3
    for buf in pool.k_buffers + pool.v_buffers:
        assert buf.shape == (20, 2, 8) and buf.dtype == torch.float16
        assert buf.device.type == "cpu"
        assert bool((buf == 0).all())
    # distinct storage per layer and per K/V
    ptrs = {b.data_ptr() for b in pool.k_buffers + pool.v_buffers}
    assert len(ptrs) == 6
    assert pool.bytes_per_page == 2 * 3 * 4 * 2 * 8 * 2
    assert pool.total_bytes == pool.bytes_per_page * 5
    actual = sum(b.numel() * b.element_size() for b in pool.k_buffers + pool.v_buffers)
    assert pool.total_bytes == actual


def test_device_pool_float32_bytes():
    pool = DeviceKVPool(1, 1, 4, 3, 2, torch.float32, "cpu")
    assert pool.bytes_per_page == 2 * 1 * 2 * 1 * 4 * 4
    assert pool.total_bytes == sum(b.numel() * b.element_size() for b in pool.k_buffers + pool.v_buffers)
    pool.wait_layer(0)  # no-op, must not raise


def test_slots_index_into_pool_buffers():
    pool = DeviceKVPool(1, 1, 2, 4, 3, torch.float32, "cpu")
    slots = pages_to_slots(np.array([2, 1]), pool.page_size)
    pool.k_buffers[0][slots] = 1.0
    assert pool.k_buffers[0][:3].sum() == 0  # page 0 (padding) untouched
    assert pool.k_buffers[0][3:9].sum() == 12
    assert pool.k_buffers[0][9:].sum() == 0


def test_the_host_pool_is_refused_beyond_the_host_memory_an_operator_names(monkeypatch) -> None:
    """``HICACHE_HOST_MEMORY`` stands for MemAvailable (a VM whose memory grows as it is used reports
    less at start): a host pool over 90% of it is refused with the figures, one under it is made."""
    from hicache.cache.host_pool import HostKVPool
    from hicache.config import ConfigError

    pool = DeviceKVPool(2, 2, 16, 9, 4, torch.float32, "cpu")  # 1 KiB a page
    monkeypatch.setenv("HICACHE_HOST_MEMORY", "64K")
    with pytest.raises(ConfigError, match=r"needs 0\.00 GiB but only 0\.00 GiB"):
        HostKVPool(pool, 64, "layer_first", pin_memory=False)
    monkeypatch.setenv("HICACHE_HOST_MEMORY", "1G")
    assert HostKVPool(pool, 64, "layer_first", pin_memory=False).buffer.numel() == 64 * 2 * 2 * 4 * 2 * 16
    monkeypatch.setenv("HICACHE_HOST_MEMORY", "lots")
    with pytest.raises(ConfigError, match="HICACHE_HOST_MEMORY='lots'"):
        HostKVPool(pool, 64, "layer_first", pin_memory=False)
