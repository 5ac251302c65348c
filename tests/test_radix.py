"""L1 prefix cache (RadixCache): unit tests plus hypothesis-driven request workloads checked
against a naive reference model (a dict keyed by cached page-prefix tuples)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.cache.pools import PageAllocator
from hicache.cache.radix import RadixCache

pytestmark = pytest.mark.cache


def toks(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


def make(page_size=2, num_pages=64, policy="lru"):
    alloc = PageAllocator(num_pages)
    return alloc, RadixCache(page_size, alloc, policy)


def put(tree, alloc, tokens, ns="m"):
    """Insert ``tokens`` with fresh pages, freeing duplicates like the engine; returns the pages
    the tree now holds for them (via match)."""
    n = len(tokens) // tree.page_size
    pages = alloc.alloc(n)
    assert pages is not None
    already = tree.insert(ns, tokens, pages) // tree.page_size
    alloc.free(pages[:already])
    return pages


def tree_prefixes(tree) -> dict[tuple, int]:
    """Every device-cached page prefix in the tree: (namespace, tokens...) -> page id."""
    out: dict[tuple, int] = {}
    ps = tree.page_size
    for ns, root in tree._roots.items():
        stack = [(root, ())]
        while stack:
            node, path = stack.pop()
            if not node.is_root:
                assert node.device_pages is not None  # L1 only: no device-less nodes survive
                for i, page in enumerate(node.device_pages.tolist()):
                    key = path + tuple(node.key[: (i + 1) * ps].tolist())
                    out[(ns,) + key] = page
                path = path + tuple(node.key.tolist())
            for child in node.children.values():
                stack.append((child, path))
    return out


def accounting(tree, alloc, outside=0):
    assert alloc.available + tree.cached_pages + outside == alloc.capacity
    tree.check_invariants()


# ---- matching --------------------------------------------------------------------------------
def test_exact_match():
    alloc, tree = make(page_size=2)
    t = toks(1, 2, 3, 4, 5, 6)
    pages = put(tree, alloc, t)
    m = tree.match_prefix("m", t)
    assert m.device_pages.tolist() == pages.tolist()
    assert m.device_hit_tokens == 6 and m.host_hit_tokens == 0
    assert m.last_device_node is m.last_node and len(m.last_device_node.key) == 6
    # a longer query matches the cached part only
    m = tree.match_prefix("m", toks(1, 2, 3, 4, 5, 6, 7, 8))
    assert m.device_hit_tokens == 6
    assert tree.num_nodes() == 1
    accounting(tree, alloc)


def test_match_on_empty_tree_and_empty_query():
    alloc, tree = make(page_size=2)
    m = tree.match_prefix("m", toks(1, 2, 3, 4))
    assert m.device_hit_tokens == 0 and len(m.device_pages) == 0 and m.last_device_node.is_root
    put(tree, alloc, toks(1, 2))
    m = tree.match_prefix("m", toks())
    assert m.device_hit_tokens == 0 and m.last_device_node.is_root
    tree.inc_lock_ref(m.last_device_node)  # locking the root is a no-op
    assert tree.protected_pages == 0
    tree.dec_lock_ref(m.last_device_node)


def test_accepts_lists_and_int64():
    alloc, tree = make(page_size=2)
    put(tree, alloc, toks(1, 2, 3, 4))
    assert tree.match_prefix("m", [1, 2, 3, 4]).device_hit_tokens == 4
    assert tree.match_prefix("m", np.array([1, 2, 3, 4], dtype=np.int64)).device_hit_tokens == 4


def test_partial_page_ignored():
    alloc, tree = make(page_size=4)
    # the trailing partial page (9, 9) is neither matched nor inserted
    pages = alloc.alloc(2)
    assert tree.insert("m", toks(1, 2, 3, 4, 5, 6, 7, 8, 9, 9), pages) == 0
    assert tree.cached_pages == 2
    m = tree.match_prefix("m", toks(1, 2, 3, 4, 5, 6, 7))  # 1 whole page + 3 tokens
    assert m.device_hit_tokens == 4 and m.device_pages.tolist() == pages[:1].tolist()
    m = tree.match_prefix("m", toks(1, 2, 3))
    assert m.device_hit_tokens == 0
    with pytest.raises(ValueError):
        tree.insert("m", toks(1, 2, 3, 4, 5), alloc.alloc(2))  # one whole page needs one page
    accounting(tree, alloc, outside=2)


@pytest.mark.parametrize("diff_at", range(8))
def test_mismatch_position_gives_whole_pages(diff_at):
    """Catches off-by-one errors in the page rounding of a partial key match."""
    alloc, tree = make(page_size=4)
    base = toks(*range(10, 18))
    pages = put(tree, alloc, base)
    q = base.copy()
    q[diff_at] = 99
    m = tree.match_prefix("m", q)
    want = (diff_at // 4) * 4
    assert m.device_hit_tokens == want
    assert m.device_pages.tolist() == pages[: want // 4].tolist()
    assert tree.num_nodes() == (2 if want == 4 else 1)
    accounting(tree, alloc)


def test_match_inside_node_splits_and_lock_protects_only_prefix():
    alloc, tree = make(page_size=2, num_pages=16)
    t = toks(1, 2, 3, 4, 5, 6, 7, 8)
    pages = put(tree, alloc, t)
    assert tree.num_nodes() == 1
    m = tree.match_prefix("m", toks(1, 2, 3, 4, 0, 0))
    assert tree.num_nodes() == 2
    node = m.last_device_node
    assert node.key.tolist() == [1, 2, 3, 4]
    assert node.device_pages.tolist() == pages[:2].tolist()
    (lower,) = node.children.values()
    assert lower.key.tolist() == [5, 6, 7, 8] and lower.device_pages.tolist() == pages[2:].tolist()
    tree.inc_lock_ref(node)
    assert tree.protected_pages == 2 and tree.evictable_pages == 2
    accounting(tree, alloc)
    assert tree.evict(100) == 2  # only the unlocked suffix goes
    assert alloc.available == alloc.capacity - 2
    assert sorted(set(range(1, 16)) - set(alloc._free.tolist())) == sorted(pages[:2].tolist())
    assert tree.match_prefix("m", t).device_hit_tokens == 4
    accounting(tree, alloc)
    tree.dec_lock_ref(node)
    assert tree.protected_pages == 0 and tree.evictable_pages == 2
    assert tree.evict(100) == 2
    assert alloc.available == alloc.capacity and tree.num_nodes() == 0
    accounting(tree, alloc)


def test_split_keeps_existing_locks():
    alloc, tree = make(page_size=1)
    put(tree, alloc, toks(1, 2, 3, 4))
    full = tree.match_prefix("m", toks(1, 2, 3, 4)).last_device_node
    tree.inc_lock_ref(full)
    part = tree.match_prefix("m", toks(1, 2, 9)).last_device_node  # split a locked node
    assert part.lock_ref == 1 and full.lock_ref == 1
    assert tree.protected_pages == 4
    accounting(tree, alloc)
    tree.inc_lock_ref(part)
    tree.dec_lock_ref(full)
    assert tree.protected_pages == 2 and tree.evictable_pages == 2
    assert tree.evict(10) == 2
    tree.dec_lock_ref(part)
    accounting(tree, alloc)


def test_namespaces_never_share_nodes():
    alloc, tree = make(page_size=2)
    t = toks(1, 2, 3, 4)
    pa = put(tree, alloc, t, ns="a")
    pages_b = alloc.alloc(2)
    assert tree.insert("b", t, pages_b) == 0  # nothing of "a" counts as cached for "b"
    assert tree.num_nodes() == 2 and tree.cached_pages == 4
    assert tree.match_prefix("a", t).device_pages.tolist() == pa.tolist()
    assert tree.match_prefix("b", t).device_pages.tolist() == pages_b.tolist()
    assert tree.match_prefix("c", t).device_hit_tokens == 0
    # splitting / locking in one namespace does not touch the other
    nb = tree.match_prefix("b", toks(1, 2, 7, 7)).last_device_node
    tree.inc_lock_ref(nb)
    assert tree.protected_pages == 1
    assert tree.evict(100) == 3
    assert tree.match_prefix("a", t).device_hit_tokens == 0
    assert tree.match_prefix("b", t).device_hit_tokens == 2
    tree.dec_lock_ref(nb)
    accounting(tree, alloc)


def test_insert_returns_already_cached_length():
    alloc, tree = make(page_size=2)
    assert tree.insert("m", toks(1, 2, 3, 4), alloc.alloc(2)) == 0
    # same again: fully cached
    dup = alloc.alloc(2)
    assert tree.insert("m", toks(1, 2, 3, 4), dup) == 4
    alloc.free(dup)
    # extension: first 4 cached, the tree keeps the new tail page
    p = alloc.alloc(3)
    assert tree.insert("m", toks(1, 2, 3, 4, 5, 6), p) == 4
    alloc.free(p[:2])
    m = tree.match_prefix("m", toks(1, 2, 3, 4, 5, 6))
    assert m.device_pages[2] == p[2]
    # divergence inside a node: the shared page is cached, the rest is new
    q = alloc.alloc(3)
    assert tree.insert("m", toks(1, 2, 9, 9, 9, 9), q) == 2
    alloc.free(q[:1])
    assert tree.match_prefix("m", toks(1, 2, 9, 9, 9, 9)).device_pages.tolist() == [m.device_pages[0]] + q[1:].tolist()
    # a shorter prefix of something cached is fully cached
    r = alloc.alloc(1)
    assert tree.insert("m", toks(1, 2), r) == 2
    alloc.free(r)
    # empty insert
    assert tree.insert("m", toks(), np.zeros(0, dtype=np.int64)) == 0
    accounting(tree, alloc)


def test_insert_does_not_alias_caller_buffers():
    alloc, tree = make(page_size=2)
    t = toks(1, 2, 3, 4)
    pages = alloc.alloc(2)
    tree.insert("m", t, pages)
    t[:] = 0
    pages[:] = 0
    assert tree.match_prefix("m", toks(1, 2, 3, 4)).device_hit_tokens == 4
    tree.check_invariants()


# ---- locks -------------------------------------------------------------------------------
def test_lock_counts_and_unlock_errors():
    alloc, tree = make(page_size=1)
    put(tree, alloc, toks(1, 2, 3))
    node = tree.match_prefix("m", toks(1, 2, 3)).last_device_node
    tree.inc_lock_ref(node)
    tree.inc_lock_ref(node)
    assert tree.protected_pages == 3 and tree.evictable_pages == 0
    assert tree.evict(3) == 0
    tree.dec_lock_ref(node)
    assert tree.protected_pages == 3
    tree.dec_lock_ref(node)
    assert tree.protected_pages == 0 and tree.evictable_pages == 3
    with pytest.raises(RuntimeError):
        tree.dec_lock_ref(node)


def test_lock_on_child_locks_ancestors():
    alloc, tree = make(page_size=1)
    put(tree, alloc, toks(1, 2, 3))
    put(tree, alloc, toks(1, 2, 4, 5))
    leaf = tree.match_prefix("m", toks(1, 2, 4, 5)).last_device_node
    tree.inc_lock_ref(leaf)
    assert leaf.parent.lock_ref == 1 and tree.protected_pages == 4 and tree.evictable_pages == 1
    assert tree.evict(100) == 1  # only the (1,2,3) branch tail
    assert tree.match_prefix("m", toks(1, 2, 3)).device_hit_tokens == 2
    tree.dec_lock_ref(leaf)
    accounting(tree, alloc)


# ---- eviction ----------------------------------------------------------------------------
def test_eviction_frees_leaves_before_their_parents():
    alloc, tree = make(page_size=1, num_pages=32)
    put(tree, alloc, toks(1, 2, 3, 4))
    put(tree, alloc, toks(1, 2, 7, 8))  # shared (1,2) becomes an internal node
    assert tree.num_nodes() == 3
    put(tree, alloc, toks(5))  # newer leaf elsewhere
    # the internal node (1,2) was touched most recently of its subtree but is never a leaf
    # while it has children: the first eviction must take a leaf.
    freed = tree.evict(1)
    assert freed == 2
    assert tree.match_prefix("m", toks(1, 2, 3, 4)).device_hit_tokens == 2
    assert tree.match_prefix("m", toks(1, 2, 7, 8)).device_hit_tokens == 4
    accounting(tree, alloc)
    # (5) is now the oldest leaf, then (7,8); (1,2) only becomes a leaf once childless
    assert tree.evict(3) == 3
    assert tree.match_prefix("m", toks(5)).device_hit_tokens == 0
    assert tree.match_prefix("m", toks(1, 2, 7, 8)).device_hit_tokens == 2
    assert tree.evict(1) == 2
    assert tree.cached_pages == 0 and tree.num_nodes() == 0
    accounting(tree, alloc)


def test_evict_more_than_evictable_and_zero():
    alloc, tree = make(page_size=2)
    put(tree, alloc, toks(1, 2, 3, 4))
    assert tree.evict(0) == 0 and tree.cached_pages == 2
    assert tree.evict(100) == 2
    assert tree.evict(100) == 0
    assert tree.evicted_pages_total == 2
    accounting(tree, alloc)


def test_evict_stops_once_enough_is_freed():
    alloc, tree = make(page_size=1)
    for i in range(5):
        put(tree, alloc, toks(10 + i, 1))
    assert tree.evict(3) == 4  # two whole 2-page leaves
    assert tree.cached_pages == 6
    accounting(tree, alloc)


def _three_leaves(policy):
    alloc, tree = make(page_size=1, policy=policy)
    for first in (1, 2, 3):
        put(tree, alloc, toks(first, 0))
    return alloc, tree


def _cached_firsts(tree):
    return sorted(first for first in (1, 2, 3) if tree.match_prefix("m", toks(first)).device_hit_tokens)


def test_lru_order():
    alloc, tree = _three_leaves("lru")
    for _ in range(5):
        tree.match_prefix("m", toks(1, 0))  # 1 is frequent but not recent
    tree.match_prefix("m", toks(2, 0))
    tree.match_prefix("m", toks(3, 0))
    assert tree.evict(1) == 2
    leaves = {n.key[0] for n in tree._roots["m"].children.values()}
    assert leaves == {2, 3}  # least recently used (1) went first
    assert tree.evict(1) == 2
    assert {n.key[0] for n in tree._roots["m"].children.values()} == {3}
    accounting(tree, alloc)


def test_lfu_order():
    alloc, tree = _three_leaves("lfu")
    for _ in range(5):
        tree.match_prefix("m", toks(1, 0))
    tree.match_prefix("m", toks(2, 0))
    tree.match_prefix("m", toks(2, 0))
    tree.match_prefix("m", toks(3, 0))  # most recent, but least frequent
    assert tree.evict(1) == 2
    assert {n.key[0] for n in tree._roots["m"].children.values()} == {1, 2}
    assert tree.evict(1) == 2
    assert {n.key[0] for n in tree._roots["m"].children.values()} == {1}
    accounting(tree, alloc)


def test_lfu_ties_break_by_recency():
    alloc, tree = _three_leaves("lfu")
    tree.match_prefix("m", toks(2, 0))
    tree.match_prefix("m", toks(1, 0))  # 1 and 2 equally frequent; 2 older
    tree.match_prefix("m", toks(3, 0))
    tree.match_prefix("m", toks(3, 0))
    assert tree.evict(1) == 2
    assert {n.key[0] for n in tree._roots["m"].children.values()} == {1, 3}


def test_unknown_policy():
    with pytest.raises(ValueError):
        RadixCache(2, PageAllocator(4), "fifo")


def test_partial_match_does_not_refresh_unmatched_tail():
    """Matching (1,2) of cached (1,2,3,4) must not make the unmatched (3,4) look recently used."""
    alloc, tree = make(page_size=2, policy="lru")
    put(tree, alloc, toks(1, 2, 3, 4))
    put(tree, alloc, toks(5, 6, 7, 8))  # used after (1,2,3,4)
    tree.match_prefix("m", toks(1, 2, 9, 9))  # splits (1,2 | 3,4); uses only (1,2)
    assert tree.evict(1) == 1
    # (3,4) was last used before (5,6,7,8): it goes first
    assert tree.match_prefix("m", toks(1, 2, 3, 4)).device_hit_tokens == 2
    assert tree.match_prefix("m", toks(5, 6, 7, 8)).device_hit_tokens == 4


def test_partial_match_does_not_count_as_hit_for_tail_lfu():
    alloc, tree = make(page_size=2, policy="lfu")
    put(tree, alloc, toks(1, 2, 3, 4))
    put(tree, alloc, toks(5, 6, 7, 8))
    tree.match_prefix("m", toks(5, 6, 7, 8))  # (5,6,7,8): 2 hits
    tree.match_prefix("m", toks(1, 2, 9, 9))  # a hit for (1,2) only; (3,4) stays at 1
    assert tree.evict(1) == 1
    assert tree.match_prefix("m", toks(1, 2, 3, 4)).device_hit_tokens == 2
    assert tree.match_prefix("m", toks(5, 6, 7, 8)).device_hit_tokens == 4


# ---- reset -------------------------------------------------------------------------------
def test_reset_returns_all_pages():
    alloc, tree = make(page_size=2)
    put(tree, alloc, toks(1, 2, 3, 4), ns="a")
    put(tree, alloc, toks(1, 2, 5, 6), ns="a")
    put(tree, alloc, toks(1, 2, 3, 4), ns="b")
    node = tree.match_prefix("a", toks(1, 2)).last_device_node
    tree.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        tree.reset()
    accounting(tree, alloc)
    tree.dec_lock_ref(node)
    tree.reset()
    assert alloc.available == alloc.capacity
    assert tree.cached_pages == 0 and tree.num_nodes() == 0
    assert tree.match_prefix("a", toks(1, 2, 3, 4)).device_hit_tokens == 0
    accounting(tree, alloc)
    put(tree, alloc, toks(1, 2, 3, 4), ns="a")  # usable after reset
    accounting(tree, alloc)


# ---- lower tiers (a node whose device copy was evicted but that a host tier still holds) -----
def test_insert_into_device_less_node_keeps_accounting():
    """When insert adopts pages for an evicted (host-backed) node, the tree must own or free
    every caller page past the returned length; none may leak."""
    alloc, host = PageAllocator(32), PageAllocator(32)
    tree = RadixCache(1, alloc, "lru", host_allocator=host)
    put(tree, alloc, toks(1, 2, 3, 4))
    node = tree.match_prefix("m", toks(1, 2)).last_device_node  # split: (1,2) | (3,4)
    (child,) = node.children.values()
    tree.attach_host_pages(node, host.alloc(2))  # pretend L2 holds (1,2) and (3,4)
    tree.attach_host_pages(child, host.alloc(2))
    assert tree.evict(100) == 4
    assert tree.num_nodes() == 2 and tree.cached_pages == 0  # kept for the host tier
    m = tree.match_prefix("m", toks(1, 2, 3, 4))
    assert m.device_hit_tokens == 0 and m.host_hit_tokens == 4
    pages = alloc.alloc(6)
    assert tree.insert("m", toks(1, 2, 3, 4, 5, 6), pages) == 0  # nothing was on the device: all 6 adopted
    accounting(tree, alloc)  # the tree owns all 6 pages now: none leaked, none freed twice
    assert tree.match_prefix("m", toks(1, 2, 3, 4, 5, 6)).device_pages.tolist() == pages.tolist()
    tree.reset()
    assert alloc.available == alloc.capacity and host.available == host.capacity


# ---- property tests: random request workloads vs a naive reference -------------------------
class Workload:
    """Drives the tree like the engine and mirrors it in a reference model.

    The reference is a dict ``(namespace, *tokens of k whole pages) -> [page, hits, stamp]`` with
    one entry per cached page prefix (so it is prefix-closed). ``stamp`` is the number of the last
    match/insert that walked over that page and ``hits`` how many did since it was cached; eviction
    is learned from the tree and then checked against these.
    """

    def __init__(self, page_size, num_pages, policy):
        self.ps = page_size
        self.alloc = PageAllocator(num_pages)
        self.tree = RadixCache(page_size, self.alloc, policy)
        self.policy = policy
        self.ref: dict[tuple, list] = {}
        self.op = 0
        self.live: list[dict] = []  # ns, tokens, m (pages matched/owned by tree), node, pages

    # reference helpers
    def key(self, ns, tokens, k):
        return (ns,) + tuple(tokens[: k * self.ps].tolist())

    def ref_longest(self, ns, tokens, limit):
        k = 0
        while k < limit and self.key(ns, tokens, k + 1) in self.ref:
            k += 1
        return k

    def ref_walk(self, ns, tokens, k):
        self.op += 1
        for j in range(1, k + 1):
            e = self.ref[self.key(ns, tokens, j)]
            e[1] += 1
            e[2] = self.op

    def locked(self):
        return {self.key(r["ns"], r["tokens"], j) for r in self.live for j in range(1, r["m"] + 1)}

    def outside(self):
        return sum(len(r["pages"]) - r["m"] for r in self.live)

    def check(self):
        tree, alloc = self.tree, self.alloc
        tree.check_invariants()
        assert alloc.available + tree.cached_pages + self.outside() == alloc.capacity
        assert tree_prefixes(tree) == {k: v[0] for k, v in self.ref.items()}
        assert tree.protected_pages == len(self.locked())
        assert tree.evictable_pages == len(self.ref) - tree.protected_pages
        held = [p for v in self.ref.values() for p in [v[0]]]
        for r in self.live:
            held += r["pages"][r["m"] :].tolist()
        everything = held + alloc._free.tolist()
        assert sorted(everything) == list(range(1, alloc.num_pages)), "page leaked or shared"

    # operations
    def evict(self, want):
        before = dict(self.ref)
        avail = self.alloc.available
        freed = self.tree.evict(want)
        now = tree_prefixes(self.tree)
        assert set(now) <= set(before)
        removed = set(before) - set(now)
        assert freed == len(removed) == self.alloc.available - avail
        assert not removed & self.locked(), "evicted a locked prefix"
        for k in now:  # prefix-closed: nothing evicted from under a cached child
            if len(k) - 1 > self.ps:
                assert k[: len(k) - self.ps] in now
        if want <= 0:
            assert freed == 0
        if freed < want:
            assert self.tree.evictable_pages == 0
        for k in removed:
            del self.ref[k]
        # policy order: nothing evicted ranks above a leaf that is still evictable
        order = (lambda e: e[2]) if self.policy == "lru" else (lambda e: (e[1], e[2]))
        parents = {k[: len(k) - self.ps] for k in now}
        leaves = [k for k in now if k not in parents and k not in self.locked()]
        if removed and leaves:
            assert max(order(before[k]) for k in removed) <= min(order(self.ref[k]) for k in leaves)
        return freed

    def arrive(self, ns, tokens):
        limit = len(tokens) // self.ps
        m = self.tree.match_prefix(ns, tokens)
        k = self.ref_longest(ns, tokens, limit)
        assert m.device_hit_tokens == k * self.ps
        assert m.device_pages.tolist() == [self.ref[self.key(ns, tokens, j)][0] for j in range(1, k + 1)]
        assert len(m.last_device_node.key) > 0 or k == 0
        self.ref_walk(ns, tokens, k)
        self.tree.inc_lock_ref(m.last_device_node)
        req = dict(ns=ns, tokens=tokens, m=k, node=m.last_device_node, pages=m.device_pages.copy())
        self.live.append(req)
        need = -(-len(tokens) // self.ps) - k
        if need > self.alloc.available:
            self.evict(need - self.alloc.available)
        new = self.alloc.alloc(need)
        if new is None:  # rejected: only when nothing more could be evicted
            assert self.tree.evictable_pages == 0
            self.live = [r for r in self.live if r is not req]
            self.tree.dec_lock_ref(req["node"])
            return
        req["pages"] = np.concatenate([req["pages"], new])

    def _insert(self, req, n):
        ns, tokens = req["ns"], req["tokens"]
        expect = self.ref_longest(ns, tokens, n)
        ret = self.tree.insert(ns, tokens[: n * self.ps], req["pages"][:n])
        assert ret == expect * self.ps and ret >= req["m"] * self.ps
        self.alloc.free(req["pages"][req["m"] : expect])
        for j in range(expect + 1, n + 1):
            self.ref[self.key(ns, tokens, j)] = [int(req["pages"][j - 1]), 0, 0]
        self.ref_walk(ns, tokens, n)
        return expect

    def checkpoint(self, req, n):
        """Cache a computed prefix mid-request and move the lock there (chunked prefill)."""
        ns, tokens = req["ns"], req["tokens"]
        self._insert(req, n)
        m = self.tree.match_prefix(ns, tokens[: n * self.ps])
        assert m.device_hit_tokens == n * self.ps
        self.ref_walk(ns, tokens, n)
        req["pages"] = np.concatenate([m.device_pages, req["pages"][n:]])
        self.tree.inc_lock_ref(m.last_device_node)
        self.tree.dec_lock_ref(req["node"])
        req["node"], req["m"] = m.last_device_node, n

    def finish(self, req, n):
        if n > req["m"]:
            self._insert(req, n)
            keep = n
        else:
            keep = req["m"]
        self.alloc.free(req["pages"][keep:])
        self.live = [r for r in self.live if r is not req]
        self.tree.dec_lock_ref(req["node"])


@st.composite
def prompts(draw, bases, vocab):
    base = bases[draw(st.integers(0, len(bases) - 1))]
    cut = draw(st.integers(0, len(base)))
    tail = draw(st.lists(st.integers(0, vocab - 1), max_size=6))
    return np.array(base[:cut] + tail, dtype=np.int32)


def run_workload(data, policy):
    ps = data.draw(st.integers(1, 4), label="page_size")
    vocab = data.draw(st.integers(2, 4), label="vocab")
    bases = data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=6, max_size=16),
                               min_size=1, max_size=3), label="bases")
    num_pages = data.draw(st.sampled_from([6, 12, 24, 64]), label="num_pages")
    w = Workload(ps, num_pages, policy)
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        kind = data.draw(st.sampled_from(["arrive", "arrive", "finish", "finish", "checkpoint", "evict"]))
        if kind == "arrive":
            ns = data.draw(st.sampled_from(["a", "a", "b"]))
            w.arrive(ns, data.draw(prompts(bases, vocab)))
        elif kind == "evict":
            w.evict(data.draw(st.integers(-1, num_pages)))
        elif w.live:
            req = w.live[data.draw(st.integers(0, len(w.live) - 1))]
            full = len(req["tokens"]) // ps
            if kind == "checkpoint":
                if full > req["m"]:
                    w.checkpoint(req, data.draw(st.integers(req["m"] + 1, full)))
            else:
                # usually caches everything computed; sometimes less (aborted request)
                n = data.draw(st.sampled_from([full, full, data.draw(st.integers(0, full))]))
                w.finish(req, n)
        w.check()
    while w.live:
        w.finish(w.live[0], len(w.live[0]["tokens"]) // ps)
        w.check()
    assert w.tree.protected_pages == 0
    w.tree.reset()
    assert w.alloc.available == w.alloc.capacity
    assert w.tree.cached_pages == 0 and w.tree.num_nodes() == 0


_PROP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_PROP
@given(st.data())
def test_workload_lru(data):
    run_workload(data, "lru")


@_PROP
@given(st.data())
def test_workload_lfu(data):
    run_workload(data, "lfu")


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.lists(st.lists(st.integers(0, 2), max_size=12), min_size=1, max_size=12))
def test_match_equals_longest_cached_prefix_without_eviction(ps, seqs):
    """With a pool that never runs short, every match is exactly the longest inserted prefix."""
    alloc, tree = make(page_size=ps, num_pages=1000)
    cached: set[tuple] = set()
    for s in seqs:
        t = np.array(s, dtype=np.int32)
        n = len(t) // ps
        want = 0
        while want < n and tuple(s[: (want + 1) * ps]) in cached:
            want += 1
        m = tree.match_prefix("m", t)
        assert m.device_hit_tokens == want * ps
        pages = alloc.alloc(n)
        assert tree.insert("m", t, pages) == want * ps
        alloc.free(pages[:want])
        cached.update(tuple(s[: j * ps]) for j in range(1, n + 1))
        accounting(tree, alloc)
    assert tree.cached_pages == len(cached)
    tree.reset()
    assert alloc.available == alloc.capacity


# ---- peek_prefix: match_prefix's lengths, read-only ----------------------------------------
def snapshot(tree: RadixCache) -> tuple:
    """Everything a read-only call must leave alone: every node's fields, the counters, the
    logical tick and the next node id."""
    nodes = sorted(
        (n.id, n.namespace, n.key.tobytes(), None if n.parent is None else n.parent.id,
         None if n.device_pages is None else n.device_pages.tolist(),
         None if n.host_pages is None else n.host_pages.tolist(),
         n.lock_ref, n.host_ref, n.last_access, n.hit_count, n.stored)
        for n in tree.all_nodes()
    )
    return (nodes, sorted(tree._roots), tree._tick, repr(tree._ids), tree.evictable_pages,
            tree.protected_pages, tree.host_pages_held)


def test_peek_inside_a_node_neither_splits_nor_counts():
    alloc, tree = make(page_size=2)
    put(tree, alloc, toks(1, 2, 3, 4, 5, 6))
    before = snapshot(tree)
    p = tree.peek_prefix("m", toks(1, 2, 3, 4, 9, 9))
    assert snapshot(tree) == before and tree.num_nodes() == 1
    assert (p.device_hit_tokens, p.host_hit_tokens, p.node_pages) == (4, 0, 2)
    assert p.node is tree.node_at("m", toks(1, 2, 3, 4, 5, 6))  # the whole node: not split
    m = tree.match_prefix("m", toks(1, 2, 3, 4, 9, 9))
    assert m.device_hit_tokens == 4 and m.last_node is p.node.parent  # match splits where peek stopped


def test_peek_on_unknown_namespace_or_miss_creates_nothing():
    alloc, tree = make(page_size=2)
    put(tree, alloc, toks(1, 2, 3, 4))
    before = snapshot(tree)
    for ns, t in (("other", toks(1, 2)), ("m", toks(7, 7)), ("m", toks(1))):
        p = tree.peek_prefix(ns, t)
        assert (p.device_hit_tokens, p.host_hit_tokens, p.node, p.node_pages) == (0, 0, None, 0)
    assert snapshot(tree) == before  # no root was made for "other"


def _fresh_pages(tree: RadixCache, alloc: PageAllocator, n: int) -> np.ndarray | None:
    if n > alloc.available:
        tree.evict(n - alloc.available)
    return alloc.alloc(n)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_peek_equals_match_and_changes_nothing(data):
    """Random workloads over both tiers (inserts, host backups, device eviction that leaves
    host-only nodes, storage fetches): every peek leaves the tree as it was and reports the
    lengths of the match_prefix that follows, ending where that match ends (or splits)."""
    ps = data.draw(st.integers(1, 3), label="page_size")
    alloc, host = PageAllocator(24), PageAllocator(24)
    tree = RadixCache(ps, alloc, data.draw(st.sampled_from(["lru", "lfu"])), host)
    seqs = st.lists(st.integers(0, 2), max_size=14).map(lambda s: np.array(s, dtype=np.int32))
    seen = [np.zeros(0, dtype=np.int32)]  # earlier sequences: most new ones extend one, so paths get deep
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        kind = data.draw(st.sampled_from(["insert", "insert", "backup", "evict", "fetch", "probe", "probe"]))
        base = data.draw(st.sampled_from(seen))
        t = np.concatenate([base[: data.draw(st.integers(0, len(base)))], data.draw(seqs)]).astype(np.int32)
        ns = data.draw(st.sampled_from(["a", "a", "b"]))
        seen.append(t)
        n = len(t) // ps
        if kind == "insert" and (pages := _fresh_pages(tree, alloc, n)) is not None:
            alloc.free(pages[: tree.insert(ns, t, pages) // ps])
        elif kind == "backup":
            nodes = [x for x in tree.all_nodes() if not x.is_root and x.host_pages is None]
            node = data.draw(st.sampled_from(nodes)) if nodes else None
            if node is not None and (hp := host.alloc(len(node.key) // ps)) is not None:
                tree.attach_host_pages(node, hp)
        elif kind == "evict":
            tree.evict(data.draw(st.integers(0, 8)))
        elif kind == "fetch":
            p = tree.peek_prefix(ns, t)
            start = (p.device_hit_tokens + p.host_hit_tokens) // ps
            if n > start and (hp := host.alloc(n - start)) is not None:
                host.free(hp[: tree.insert_host(ns, t, hp, start)])
        elif kind == "probe":
            before = snapshot(tree)
            p = tree.peek_prefix(ns, t)
            assert snapshot(tree) == before
            whole = None if p.node is None else len(p.node.key)
            m = tree.match_prefix(ns, t)
            assert (p.device_hit_tokens, p.host_hit_tokens) == (m.device_hit_tokens, m.host_hit_tokens)
            if p.node is None:
                assert m.last_node.is_root
            else:
                assert 0 < p.node_pages * ps <= whole
                assert m.last_node is (p.node if p.node_pages * ps == whole else p.node.parent)
        tree.check_invariants()
