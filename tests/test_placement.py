"""Page placement for sharded KV (issue 13): the seed's Figures 1a and 1b, reproduced with the
real radix tree and allocator, and the slot arithmetic of the pools' copy boundary."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.cache.manager import KVCacheManager, RankLayout
from hicache.cache.placement import GatherPlan, PagePlacement, ShardedPageAllocator
from hicache.cache.pools import DeviceKVPool
from hicache.cache.radix import RadixCache

pytestmark = pytest.mark.cache

PAGE = 4
NS = "figure-1a"


def block(first: int) -> list[int]:
    """One page of tokens: the seed's A, B, C... are one page each."""
    return list(range(first, first + PAGE))


A, B, C, D, E = (block(100 * i) for i in range(1, 6))


def test_figure_1a_logical_tree_and_owner_rotation():
    placement = PagePlacement(num_shards=2, page_size=PAGE)
    allocator = ShardedPageAllocator(placement, pages_per_shard=8)
    tree = RadixCache(PAGE, allocator)

    abc = allocator.alloc(3, first_position=0)
    tree.insert(NS, A + B + C, abc)
    # A/B/E shares the A/B node and branches: E continues the rotation at position 2 (rank 0).
    shared = tree.match_prefix(NS, A + B + E).device_pages
    e = allocator.alloc(1, first_position=len(shared))
    tree.insert(NS, A + B + E, np.concatenate([shared, e]))

    pages = {"A": abc[0], "B": abc[1], "C": abc[2], "E": e[0]}
    where = {name: (placement.owner(p), placement.local_page(p)) for name, p in pages.items()}
    assert where == {"A": (0, 1), "C": (0, 2), "E": (0, 3), "B": (1, 1)}  # the figure's pools

    # Extending the matched A/B/C allocates D after owners 0, 1, 0: rank 1, logical page 5, local 2.
    matched = tree.match_prefix(NS, A + B + C + D).device_pages
    assert matched.tolist() == [pages["A"], pages["B"], pages["C"]]
    d = allocator.alloc(1, first_position=len(matched))
    assert d.tolist() == [5] and placement.owner(5) == 1 and placement.local_page(5) == 2
    tree.insert(NS, A + B + C + D, np.concatenate([matched, d]))
    for path in (A + B + C + D, A + B + E):
        assert placement.follows_rotation(tree.match_prefix(NS, path).device_pages)


def test_figure_1b_gather_plan_reads_the_prefix_in_logical_order():
    placement = PagePlacement(num_shards=2, page_size=PAGE)
    plan = GatherPlan.for_prefix(placement, np.array([2, 3, 4]))  # A, B, C of Figure 1a
    # Rank 0 contributes A and C, rank 1 contributes B and a padding page.
    assert [c.tolist() for c in plan.contributions] == [[1, 2], [1, 0]]
    gathered = ["A", "C", "B", "pad"]  # owner-ordered buffer after the all-gather
    assert [gathered[i] for i in plan.page_table] == ["A", "B", "C"]


def test_slot_arithmetic_matches_the_issue_formula():
    placement = PagePlacement(num_shards=3, page_size=PAGE)
    for slot in range(0, 200, 7):
        q = slot // PAGE
        assert placement.locate(slot) == (q % 3, (q // 3) * PAGE + slot % PAGE)
    slots = np.arange(64)
    owners, rows = placement.locate(slots)
    assert owners.tolist() == [(s // PAGE) % 3 for s in range(64)]
    assert placement.logical_page(2, 5) == 17 and placement.owner(17) == 2 and placement.local_page(17) == 5


def test_allocator_keeps_rotation_refuses_when_an_owner_is_short_and_recycles():
    placement = PagePlacement(num_shards=2, page_size=PAGE)
    allocator = ShardedPageAllocator(placement, pages_per_shard=3)  # local pages 1, 2 per rank
    assert allocator.capacity == 4 and allocator.available == 4
    first = allocator.alloc(3, first_position=1)  # owners 1, 0, 1
    assert placement.follows_rotation(first, first_position=1)
    assert allocator.available_on(0) == 1 and allocator.available_on(1) == 0
    assert allocator.alloc(1, first_position=1) is None  # rank 1 is out: no page from rank 0 instead
    assert allocator.available == 1  # a refused alloc changes nothing
    allocator.free(first)
    again = allocator.alloc(3, first_position=1)
    assert again.tolist() == first.tolist()  # a pure function of the alloc/free sequence
    assert not placement.follows_rotation(again, first_position=0, anchor=0)
    assert placement.follows_rotation(again, first_position=0)  # it is rank 1's rotation from position 0
    with pytest.raises(ValueError):
        allocator.alloc(-1)


def sharded_manager(pages_per_shard: int) -> KVCacheManager:
    """A cache manager as one rank of a 2-way shard group sees it: its pool holds its own local
    pages, every page id the tree and requests use is logical."""
    pool = DeviceKVPool(1, 1, 4, pages_per_shard, PAGE, torch.float32, "cpu")
    return KVCacheManager(pool, layout=RankLayout(placement=PagePlacement(num_shards=2, page_size=PAGE)))


def test_admissions_follow_the_rotation_and_extensions_continue_it():
    cache = sharded_manager(pages_per_shard=8)
    assert cache.capacity_pages == 14  # 2 ranks x 7 usable local pages
    abc = np.array(A + B + C + [1])
    first = cache.admit(NS, abc, reserve_tokens=len(abc) + 2 * PAGE)  # 3 pages + 2 more for output
    assert PagePlacement(2, PAGE).follows_rotation(first.pages)
    cache.release(NS, abc, first)  # A, B, C cached
    # A/B/C/D matches three pages and reserves the rest from position 3: rank 1 first.
    abcd = np.array(A + B + C + D + [2])
    second = cache.admit(NS, abcd, reserve_tokens=len(abcd))
    assert second.device_hit_tokens == 3 * PAGE
    assert PagePlacement(2, PAGE).owner(second.pages[3:]).tolist() == [1, 0]
    assert PagePlacement(2, PAGE).follows_rotation(second.pages)
    assert cache.device.owned_pages() == [3, 2]
    cache.release(NS, abcd, second)


def test_an_owner_short_of_pages_evicts_until_it_has_them():
    cache = sharded_manager(pages_per_shard=3)  # 2 local pages per rank
    for ns, seq in (("a", A + [7]), ("b", B + [7])):  # one page each: A on rank 0, B on the roomier rank 1
        tokens = np.array(seq)
        cache.release(ns, tokens, cache.admit(ns, tokens, reserve_tokens=len(tokens)))
    assert cache.device.owned_pages() == [1, 1]
    ef = np.array(E + block(900) + [8])
    state = cache.admit("other", ef, reserve_tokens=len(ef))  # ranks 0, 1, 0: rank 0 is one short
    assert state is not None and cache.stats.evicted_device_pages == 1
    assert cache.tree.match_prefix("a", np.array(A + [7])).device_hit_tokens == 0  # the LRU page went
    assert cache.tree.match_prefix("b", np.array(B + [7])).device_hit_tokens == PAGE
    cache.release("other", ef, state)
    # Everything cached is evictable, yet a request wider than one owner's pool is refused.
    assert cache.admit("third", np.arange(5 * PAGE + 1), reserve_tokens=5 * PAGE + 1) is None


def test_short_sequences_spread_over_every_rank():
    """One-page requests: each new sequence starts on the rank with the most room, so the
    pool fills on both ranks (not rank 0 only) before anything waits."""
    cache = sharded_manager(pages_per_shard=9)  # 8 usable local pages per rank
    held = [cache.admit(f"ns{i}", np.array([5, 6, i]), reserve_tokens=4) for i in range(16)]
    assert all(state is not None for state in held)
    assert cache.device.owned_pages() == [8, 8]
    assert cache.admit("ns-full", np.array([5, 6, 7]), reserve_tokens=4) is None
    # A sequence extending a cached path keeps that path's rotation, wherever it started.
    cache.release("ns1", np.array([5, 6, 1] + [9] * PAGE), held[1])


def test_two_new_sequences_on_different_anchors_are_not_joined():
    """The same prompt admitted twice before either is cached: they start on different ranks.
    The second's pages never join the first's cached path (a path keeps one rotation)."""
    cache = sharded_manager(pages_per_shard=8)
    placement = PagePlacement(2, PAGE)
    prompt = np.array(A + B + [3])
    first = cache.admit(NS, prompt, reserve_tokens=len(prompt))
    second = cache.admit(NS, prompt, reserve_tokens=len(prompt))
    assert placement.anchor_of(first.pages) != placement.anchor_of(second.pages)
    first_pages = first.pages[:2].copy()
    cache.release(NS, prompt, first)  # A, B cached from first's anchor
    cache.release(NS, prompt, second)  # not joined: its pages are freed
    cached = cache.tree.match_prefix(NS, prompt).device_pages
    assert cached.tolist() == first_pages.tolist() and placement.follows_rotation(cached)
    assert sum(cache.device.owned_pages()) == 2  # only the cached path holds pages
    cache.tree.check_invariants()


def test_eviction_for_a_short_owner_takes_only_that_owners_pages():
    cache = sharded_manager(pages_per_shard=3)  # 2 local pages per rank
    pages = {}
    for ns, seq in (("a", A + [7]), ("b", B + [7]), ("c", C + [7])):  # a, c on rank 0; b on rank 1
        tokens = np.array(seq)
        state = cache.admit(ns, tokens, reserve_tokens=len(tokens))
        pages[ns] = int(state.pages[0])
        cache.release(ns, tokens, state)
    placement = PagePlacement(2, PAGE)
    assert [placement.owner(pages[ns]) for ns in "abc"] == [0, 1, 0]
    for ns, seq in (("a", A + [7]), ("c", C + [7])):  # b becomes the least recently used
        tokens = np.array(seq)
        cache.release(ns, tokens, cache.admit(ns, tokens, reserve_tokens=len(tokens)))
    e = np.array(E + [8])  # two pages: rank 1 (the roomier) has its one, rank 0 is short
    state = cache.admit("other", e, reserve_tokens=len(e))
    # Only a rank-0 page goes (a, the older); policy order alone would take b first, for nothing.
    assert state is not None and cache.stats.evicted_device_pages == 1
    assert cache.tree.match_prefix("a", np.array(A + [7])).device_hit_tokens == 0
    assert cache.tree.match_prefix("b", np.array(B + [7])).device_hit_tokens == PAGE
