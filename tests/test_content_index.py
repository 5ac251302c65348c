"""The content index finds a prompt's unchanged spans past an edit (issue 61): spans of whole cached
pages at any offset, extended along the cached sequence across node boundaries, in the request's
namespace only, never over a page a host load is still writing."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.cache.content_index import Unreadable, find_spans
from hicache.cache.pools import PageAllocator
from hicache.cache.radix import RadixCache

pytestmark = pytest.mark.cache

PAGE = 4


def cached(*sequences: list[int], ns: str = "m") -> RadixCache:
    """A tree holding each sequence's whole pages (fresh device pages), as the engine inserts them."""
    alloc = PageAllocator(256)
    tree = RadixCache(PAGE, alloc, "lru")
    for seq in sequences:
        tokens = np.asarray(seq, dtype=np.int32)
        pages = alloc.alloc(len(tokens) // PAGE)
        alloc.free(pages[: tree.insert(ns, tokens, pages) // PAGE])
    return tree


def pages_of(tree: RadixCache, seq: list[int], ns: str = "m") -> np.ndarray:
    return tree.match_prefix(ns, np.asarray(seq, dtype=np.int32)).device_pages


BODY = list(range(100, 140))  # 40 tokens: 10 pages


def test_an_insertion_leaves_the_rest_findable_at_its_shifted_position() -> None:
    original = [1, 2, 3, 4] + BODY
    tree = cached(original)
    edited = [1, 2, 3, 4, 7, 7, 7] + BODY  # 3 tokens inserted: the body moved by 3, off the page grid
    spans = find_spans(tree, ["m"], np.asarray(edited), 4, len(edited), min_tokens=8)
    assert [(s.dst, s.src, s.length, s.shift) for s in spans] == [(7, 4, 40, 3)]
    assert np.array_equal(spans[0].pages, pages_of(tree, original)[1:])


def test_a_span_continues_into_the_child_that_follows_the_prompt() -> None:
    # two conversations share the body's first half; the prompt continues with the second one's tail
    first, second = [5] * 4 + BODY[:20] + [8] * 8, [5] * 4 + BODY[:20] + BODY[20:]
    tree = cached(first, second)
    edited = [6] * 4 + [9] + BODY  # the first page changed and one token inserted
    spans = find_spans(tree, ["m"], np.asarray(edited), 0, len(edited), min_tokens=8)
    assert [(s.dst, s.src, s.length) for s in spans] == [(5, 4, 40)]
    assert np.array_equal(spans[0].pages, pages_of(tree, second)[1:])


def test_reordered_passages_are_each_found() -> None:
    p1, p2 = list(range(200, 224)), list(range(300, 324))
    tree = cached([0] * 4 + p1 + p2)
    edited = [0] * 4 + p2 + p1
    spans = find_spans(tree, ["m"], np.asarray(edited), 4, len(edited), min_tokens=8)
    assert [(s.dst, s.src, s.length) for s in spans] == [(4, 28, 24), (28, 4, 24)]


def test_the_search_stays_in_the_request_namespace_and_skips_loading_pages() -> None:
    tree = cached([1, 2, 3, 4] + BODY, ns="salt-a")
    edited = np.asarray([9, 9] + BODY)
    assert find_spans(tree, ["salt-b"], edited, 0, len(edited), min_tokens=8) == []
    loading = frozenset(int(p) for p in pages_of(tree, [1, 2, 3, 4] + BODY, ns="salt-a")[5:6])  # page 5: body 16..19
    spans = find_spans(tree, ["salt-a"], edited, 0, len(edited), min_tokens=8, unreadable=Unreadable(device=loading))
    assert [(s.dst, s.length) for s in spans] == [(2, 16), (22, 20)]  # around the page being loaded


def test_spans_shorter_than_the_minimum_and_the_end_bound_are_respected() -> None:
    tree = cached([1, 2, 3, 4] + BODY)
    edited = np.asarray([0] + BODY[:8] + [0] + BODY[8:])
    spans = find_spans(tree, ["m"], edited, 0, len(edited) - 1, min_tokens=12)
    # BODY[:8] (2 pages) is under the minimum; the rest stops a page short of the end bound
    assert [(s.dst, s.src, s.length) for s in spans] == [(10, 12, 28)]


def test_a_span_runs_on_from_device_pages_into_host_pages_and_skips_a_backup_in_flight() -> None:
    original = [1, 2, 3, 4] + BODY
    alloc = PageAllocator(256)
    tree = RadixCache(PAGE, alloc, "lru", PageAllocator(256))
    head = np.asarray(original[:24], dtype=np.int32)  # 6 pages on the device; the other 5 only on the host
    tree.insert("m", head, alloc.alloc(6))
    assert tree.insert_host("m", np.asarray(original, dtype=np.int32), np.arange(100, 105), start_page=6) == 0
    edited = np.asarray([9, 9, 9] + BODY)
    [span] = find_spans(tree, ["m"], edited, 0, len(edited), min_tokens=8)
    assert (span.dst, span.src, span.length) == (3, 4, 40)
    assert span.host.tolist() == [False] * 5 + [True] * 5 and span.pages[5:].tolist() == [100, 101, 102, 103, 104]
    first, after = find_spans(tree, ["m"], edited, 0, len(edited), min_tokens=8,
                              unreadable=Unreadable(host=frozenset({102})))  # a backup still writes host page 102
    assert (first.dst, first.length, after.dst, after.src, after.length) == (3, 28, 35, 36, 8)
    assert first.host.tolist() == [False] * 5 + [True] * 2 and after.pages.tolist() == [103, 104]
