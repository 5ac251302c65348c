"""The file backend's LRU books (storage/file_index.py): order, totals, eviction choice."""

import pytest

from hicache.cache.storage.file_index import LruIndex

pytestmark = pytest.mark.storage


def test_put_pop_touch_keep_total_and_order():
    idx = LruIndex()
    idx.put("a", 3)
    idx.put("b", 4)
    idx.put("a", 5)  # a rewrite: new size, most recent
    assert list(idx.sizes) == ["b", "a"] and idx.total == 9
    idx.touch("b", 99)  # known: only recency changes
    idx.touch("c", 2)  # new (another process wrote it): indexed at its size
    assert list(idx.sizes) == ["a", "b", "c"] and idx.total == 11
    assert idx.pop("a") == 5 and idx.pop("zz") == 0 and idx.total == 6


def test_load_orders_by_mtime():
    idx = LruIndex()
    idx.load([(3.0, "new", 1), (1.0, "old", 2), (2.0, "mid", 3)])
    assert list(idx.sizes) == ["old", "mid", "new"] and idx.total == 6


def test_evict_to_fit_drops_least_recent_and_spares_keep():
    idx = LruIndex()
    for key in "abcd":
        idx.put(key, 10)
    assert idx.evict_to_fit(5, 30) == [("a", 10), ("b", 10)]
    assert idx.total == 20
    # Rewriting "c" (the oldest) with 25 bytes: "c" is kept and "d" goes instead.
    assert idx.evict_to_fit(25 - 10, 30, keep="c") == [("d", 10)]
    assert list(idx.sizes) == ["c"]
    assert idx.evict_to_fit(100, 30, keep="c") == []  # only the kept object is left
