"""A hybrid model's sliding-window layers in a KV pool of their own (issue 48): only pages inside
some window still needed hold window-layer KV; the tree knows which (tombstones for the rest), a
match ends where the window is held, eviction tombstones windows before it drops full-layer KV.

The tree's rules on small hand-made trees; then the engine on ``random:gemma-small`` (5 layers
attending an 8-token window, 1 full layer; pages of 4 tokens): the window layers' buffers are a
fraction of the full layers', and multi-turn conversations, shared prefixes, a window pool so small
that windows are evicted while requests run, NGRAM drafts and deterministic batches give the tokens
of the pool that keeps every layer's KV."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from hicache import Engine
from hicache.disagg.bootstrap import Bootstrap
from hicache.cache.pools import PageAllocator
from hicache.cache.radix import RadixCache
from hicache.cache.window_tree import TreeWindows, usable_boundary
from hybrid_conversations import EXACT, GREEDY, MODEL, SYSTEM, cold_outputs, continue_from, conversations, stored
from transfer_engines import mooncake_transfer_engine_missing

pytestmark = pytest.mark.cache

PS, WINDOW = 4, 8  # a window spans two pages and reaches one more from a page boundary


def tree(pages: int = 64, window_pages: int = 64) -> RadixCache:
    t = RadixCache(PS, PageAllocator(pages))
    t.add_component(TreeWindows(t, WINDOW, PageAllocator(window_pages)))
    return t


def tokens(n_pages: int, base: int = 0) -> np.ndarray:
    return np.arange(base, base + n_pages * PS, dtype=np.int32)


def insert(t: RadixCache, toks: np.ndarray, held: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Insert ``toks`` with fresh device pages and a window page where ``held``."""
    pages = t.allocator.alloc(len(held))
    window = np.zeros(len(held), dtype=np.int64)
    window[np.array(held)] = t.windows.allocator.alloc(sum(held))
    t.insert("ns", toks, pages, {"window": window})
    return pages, window


@pytest.mark.parametrize("held, usable", [
    ([True] * 4, 4),
    ([False, True, True, True], 4),  # page 0 lies outside boundary 4's window (positions 9..15)
    ([True, True, False, True], 2),  # boundaries 3 and 4 read page 2
    ([False, False, False], 0),
    ([], 0),
])
def test_a_boundary_is_usable_when_its_window_pages_are_held(held, usable) -> None:
    assert usable_boundary(np.array(held, dtype=bool), WINDOW, PS) == usable


def test_a_match_is_cut_back_to_the_last_boundary_whose_window_is_held() -> None:
    t = tree()
    toks = tokens(6)
    pages, window = insert(t, toks, [True] * 5 + [False])
    m = t.match_prefix("ns", np.append(toks, 99))
    assert m.device_hit_tokens == 5 * PS  # boundary 6 reads page 5: tombstoned
    assert np.array_equal(m.device_pages, pages[:5]) and np.array_equal(m.parts["window"], window[:5])
    assert len(m.last_node.key) == 5 * PS  # split there, so a request can lock that boundary
    assert t.peek_prefix("ns", toks).device_hit_tokens == 5 * PS
    t.check_invariants()


def test_an_insert_fills_tombstones_and_frees_duplicate_window_pages() -> None:
    t = tree()
    toks = tokens(4)
    insert(t, toks, [True, False, False, True])
    free_before = t.windows.allocator.available
    pages = t.allocator.alloc(4)
    mine = t.windows.allocator.alloc(4)
    t.insert("ns", toks, pages, {"window": mine})  # the same tokens again, every window page held this time
    node = t.node_at("ns", toks)
    assert np.array_equal(t.windows.of(node).device != 0, [True] * 4)
    assert np.array_equal(t.windows.of(node).device[1:3], mine[1:3])  # taken where the tree had tombstones
    assert t.windows.allocator.available == free_before - 2  # the two duplicates came back
    assert t.windows.held_pages == 4
    t.check_invariants()


def test_a_window_lock_covers_just_its_span_and_eviction_spares_it() -> None:
    t = tree()
    toks = tokens(8)
    insert(t, toks, [True] * 8)
    node = t.node_at("ns", toks)
    t.inc_lock_ref(node)
    t.windows.lock(node, 8, 6)  # a running request reads pages 6 and 7: the node is split at page 6
    assert len(node.key) == 2 * PS and t.windows.of(node).lock_ref == 1 and t.windows.of(node.parent).lock_ref == 0
    assert t.windows.evict(100) == 6  # the upper part's; the locked span keeps its two
    assert t.windows.of(node).held == 2 and t.windows.of(node.parent).held == 0
    assert t.match_prefix("ns", toks).device_hit_tokens == 8 * PS  # boundary 8 still has its window
    t.windows.unlock(node, 8, 6)
    t.dec_lock_ref(node)
    assert t.windows.evict(100) == 2
    assert t.match_prefix("ns", np.append(toks, 1)).device_hit_tokens == 0  # no window held: no usable boundary
    assert t.cached_pages == 8  # full-layer pages stay
    t.check_invariants()


def test_window_eviction_takes_pages_no_checkpoint_needs_before_any_checkpoint() -> None:
    """A leaf's end window is the checkpoint its conversation's next turn needs: every other window page
    goes first (least recently used first), even the more recently used ones of an inner node."""
    t = tree()
    old = tokens(3, base=1000)
    insert(t, old, [True] * 3)  # an old conversation: a 3-page leaf, its last 2 pages its checkpoint
    head = tokens(4)
    insert(t, head, [True] * 4)
    insert(t, np.concatenate([head, tokens(2, base=500)]), [True] * 6)  # head becomes an inner node
    inner = t.node_at("ns", head)
    assert inner.children and t.windows.of(inner).held == 4
    assert t.windows.evict(5) == 5  # the old leaf's first page, then the inner node's 4
    assert t.windows.of(inner).held == 0 and t.windows.of(t.node_at("ns", old)).held == 2
    assert t.peek_prefix("ns", np.append(old, 1)).device_hit_tokens == 3 * PS  # its checkpoint usable (a peek: no touch)
    assert t.windows.evict(1) == 2  # then the least recently used checkpoint, whole
    assert t.windows.of(t.node_at("ns", old)).held == 0
    t.check_invariants()


def test_a_short_leafs_checkpoint_keeps_the_window_it_needs_in_its_parent() -> None:
    """A turn shorter than a window: its checkpoint reaches into the parent node, whose other window pages go
    first; the checkpoint goes whole, and its share of the parent only after it."""
    t = tree()
    head = tokens(6)
    insert(t, head, [True] * 6)
    path = np.concatenate([head, tokens(1, base=500)])
    insert(t, path, [True] * 7)  # a one-page leaf: boundary 7 reads pages 5 and 6
    parent = t.node_at("ns", head)
    assert t.windows.evict(1) == 5  # the parent's pages 0-4: no checkpoint needs them
    assert np.array_equal(t.windows.of(parent).device != 0, [False] * 5 + [True])
    assert t.match_prefix("ns", np.append(path, 1)).device_hit_tokens == 7 * PS
    assert t.windows.evict(1) == 1  # then the leaf's checkpoint itself
    assert t.windows.evict(1) == 1  # and what it held in its parent, now that no checkpoint needs it
    assert t.windows.held_pages == 0
    t.check_invariants()


def test_device_eviction_frees_window_pages_and_takes_windowless_leaves_first() -> None:
    t = tree()
    insert(t, tokens(2, base=100), [True, True])  # older, its window held
    insert(t, tokens(2, base=200), [False, False])  # newer, but no match can end in it
    assert t.evict(2) == 2
    assert t.node_at("ns", tokens(2, base=200)) is None and t.node_at("ns", tokens(2, base=100)) is not None
    held = t.windows.allocator.available
    assert t.evict(2) == 2
    assert t.windows.allocator.available == held + 2 and t.windows.held_pages == 0
    t.check_invariants()


# ---- the engine ---------------------------------------------------------------------------------
BASE = EXACT


@pytest.fixture(scope="module")
def every_layer() -> tuple[list, list]:
    return conversations(Engine(MODEL, disable_hybrid_swa_memory=True, **BASE))


@pytest.fixture(scope="module")
def every_layer_on() -> tuple[list, list]:
    """The every-layer pool's conversations when finished requests cache their replies' KV too: each turn
    after the first hits its whole history (the default caches prompts only: it hits the last prompt's)."""
    return conversations(Engine(MODEL, disable_hybrid_swa_memory=True, cache_generated_kv="on", **BASE))


@pytest.mark.engine
def test_window_layers_hold_their_kv_in_a_smaller_allocation() -> None:
    hybrid = Engine(MODEL, swa_full_tokens_ratio=0.25, **BASE)
    full = Engine(MODEL, disable_hybrid_swa_memory=True, **BASE)
    try:
        pool, spec = hybrid.backend.core.pool, hybrid.loaded.spec
        stats = hybrid.stats()["device_pool"]["window"]
        assert pool.windows.pages - 1 == stats["capacity_pages"] == 1024 // 4  # a quarter of the 1,024 full pages
        for i in range(spec.num_layers):
            rows = pool.k_buffers[i].shape[0]
            assert rows == (pool.windows.pages * PS if spec.layer_window(i) else pool.num_slots)
            assert pool.v_buffers[i].shape == pool.k_buffers[i].shape
        assert stats["pool_bytes"] + stats["full_pool_bytes"] == pool.total_bytes == hybrid.stats()["device_pool"][
            "device_pool_bytes"]
        # the same full-layer tokens in 5/6 x 1/4 + 1/6 of the bytes
        assert pool.total_bytes < 0.4 * full.backend.core.pool.total_bytes
        assert full.backend.core.pool.windows.pages == 0
    finally:
        hybrid.shutdown()
        full.shutdown()


@pytest.mark.engine
@pytest.mark.parametrize("generated", ["auto", "on"])
def test_multi_turn_conversations_hit_their_checkpoints_and_give_the_same_tokens(every_layer, every_layer_on,
                                                                                 generated) -> None:
    """Each turn's checkpoint is the window of the last boundary its request caches: its prompt's last whole
    page by default (a prompt that fills its last page too), its reply's with ``--cache-generated-kv on``."""
    reference = every_layer_on if generated == "on" else every_layer
    engine = Engine(MODEL, cache_generated_kv=generated, **BASE)
    assert engine.backend.core.pool.hybrid  # the default for a hybrid model
    outputs, cached = conversations(engine)
    assert outputs == reference[0]
    assert cached == reference[1]  # every turn after the first hits what the last one cached, as with every layer
    assert all(c > len(SYSTEM) for c in cached[3:])


@pytest.mark.engine
def test_a_window_pool_too_small_for_every_window_evicts_them_and_stays_exact(every_layer) -> None:
    """Three conversations side by side in a window pool of 30 pages (3 requests' footprints): windows of
    cached pages are tombstoned while requests run; hits shrink to boundaries whose window survived, never
    to a wrong one, and the window pool's pages all come back."""
    engine = Engine(MODEL, swa_full_tokens_ratio=0.03, **BASE)
    core = engine.backend.core
    cache = core.cache
    checked = []
    step = core.scheduler.schedule

    def schedule_and_check():
        batch = step()
        cache.tree.check_invariants()
        held = sum(np.count_nonzero(r.kv.window.pages[r.kv.cached_pages:]) for r in core.scheduler.running)
        checked.append(held + cache.tree.windows.usage()["locked_pages"] <= cache.device.windows.reserved)
        return batch

    core.scheduler.schedule = schedule_and_check
    try:
        assert cache.component_pages["window"] == 30
        outputs, cached = conversations(engine, together=True, keep=True)
        stats = engine.stats()["device_pool"]["window"]
    finally:
        engine.shutdown()
    assert outputs == every_layer[0]
    assert all(checked) and len(checked) > 20
    assert stats["evicted_pages"] > 0 and stats["reserved_pages"] == 0
    assert stats["free_pages"] + stats["cached_pages"] == stats["capacity_pages"]
    assert sum(cached) <= sum(every_layer[1])


@pytest.mark.engine
@pytest.mark.parametrize("options", [dict(speculative_algorithm="NGRAM"),
                                     dict(speculative_algorithm="NGRAM", cache_generated_kv="on"),
                                     dict(enable_deterministic_inference=True)],
                         ids=["ngram", "ngram-on", "deterministic"])
def test_ngram_drafts_and_deterministic_batches_give_the_same_tokens(every_layer, every_layer_on, options) -> None:
    engine = Engine(MODEL, **options, **BASE)
    assert engine.backend.core.pool.hybrid
    # deterministic inference caches replies by default (--cache-generated-kv auto): compared with "on"
    reference = every_layer_on if engine.config.caches_generated_kv else every_layer
    outputs, cached = conversations(engine, together=True)
    assert outputs == reference[0]
    assert cached[3:] == reference[1][3:]


@pytest.mark.multirank
@pytest.mark.parallel
def test_tp2_and_pp2_keep_the_same_tombstones_as_one_rank(every_layer, checker, tmp_path) -> None:
    """The tight window pool, the small device pool over a host tier (and over a file store, TP2), again on
    two tensor-parallel ranks and on two pipeline stages (each with window layers), the consensus checker
    on: every rank's window steps, evictions, backups, load-backs, window reads and matches agree, and
    outputs and later turns' hits are one rank's."""
    tight = dict(swa_full_tokens_ratio=0.03, **BASE)
    host = dict(BASE, max_total_tokens=160, enable_hierarchical_cache=True, hicache_ratio=4.0)
    for options in (tight, host, "storage"):
        layouts = ((1, 1), (2, 1), (1, 2)) if options != "storage" else ((1, 1), (2, 1))
        runs = [conversations(Engine(MODEL, tp_size=tp, pp_size=pp, **(stored(tmp_path / f"{tp}x{pp}")
                              if options == "storage" else options)), together=True) for tp, pp in layouts]
        one = runs[0]
        assert one[0] == every_layer[0]
        for outputs, cached in runs[1:]:
            # the first turn's requests arrive at the ranks' loop as they come: which step admits each
            # (before or after the first cached the shared head) is timing; later turns hit their own histories
            # (with storage, whether a prefetch is waited for is timed by the adaptive policy: outputs only)
            assert outputs == one[0] and (options == "storage" or cached[3:] == one[1][3:])


@pytest.mark.engine
def test_host_tier_keeps_full_layers_of_every_page_and_windows_of_checkpoints(every_layer_on) -> None:
    """A device pool of 160 tokens: conversations move through host memory. The host's full-layer pool holds
    no window-layer bytes; its window pool holds only the window of a backed-up node's end; load-backs
    bring both, and the tokens are the every-layer pool's."""
    # the fixed split (a window pool of its own: the sizes below); the shared pool's host tier: test_shared_blocks.py
    # replies cached too (two checkpoints a turn: the prompt's end and the reply's), as the every-layer reference
    engine = Engine(MODEL, **dict(BASE, max_total_tokens=160), enable_hierarchical_cache=True, hicache_ratio=4.0,
                    swa_full_tokens_ratio=0.8, cache_generated_kv="on")
    core = engine.backend.core
    try:
        host, pool, tree = core.host_pool, core.pool, core.cache.tree
        assert host.layers == (5,) and host.window_pool.layers == (0, 1, 2, 3, 4)  # 1 full layer, 5 sliding
        assert host.bytes_per_page == pool.bytes_per_page and host.window_pool.bytes_per_page == 5 * host.bytes_per_page
        outputs, cached = conversations(engine, together=True, keep=True)
        stats = engine.stats()
        spans = []
        for node in tree.all_nodes():
            if node.host_pages is not None and tree.windows.of(node).host is not None:
                held = np.flatnonzero(tree.windows.of(node).host)
                end, first = tree.windows.checkpoint_span(node)
                spans.append(len(held) == 0 or held.min() >= first - (end - node.num_pages))
        tree.check_invariants()
    finally:
        engine.shutdown()
    # the first turn's three requests arrive together: a request admitted beside one still computing their
    # shared head (37 tokens: under the 64 a request waits for, runtime/shared_prefill.py) takes a share of the
    # step (runtime/fair_share.py) and computes the rest itself; later turns hit their own histories
    assert outputs == every_layer_on[0] and cached[3:] == every_layer_on[1][3:]
    assert stats["hit_tokens"]["host"] > 0  # some turns came back from host memory
    assert spans and all(spans)  # host windows only inside each node's end window
    window = stats["host_pool"]["window"]
    assert 0 < window["cached_pages"] < stats["host_pool"]["cached_pages"]
    # issue 56 H4: a turn's checkpoint frees the host windows of the one it extends (but what its window
    # reaches): the host keeps about the last checkpoints of each conversation (3 pages each, two a turn)
    assert window["superseded_pages"] > 0
    assert window["cached_pages"] <= 3 * 2 * 3 + 3


def object_files(path) -> tuple[list[Path], list[Path]]:
    files = [f for f in Path(path).rglob("*") if f.is_file()]
    return [f for f in files if not f.name.endswith("-window")], [f for f in files if f.name.endswith("-window")]


@pytest.mark.storage
def test_no_window_lock_outlives_its_request_when_hits_come_back_from_the_host() -> None:
    """Six conversations through a 100-token device pool: hits load back from the host. A hit's window
    lock is taken before its host pages land on the device; it must still cover just its span (it used
    to walk past host-only nodes, counted as 0 pages, and lock ancestors its unlock never reached:
    windows that could never be evicted again)."""
    engine = Engine(MODEL, **dict(BASE, max_total_tokens=100), enable_hierarchical_cache=True, hicache_ratio=8.0)
    try:
        conversations(engine, agents=6, turns=2, together=True, keep=True)
        cache = engine.backend.core.cache
        cache.drain()
        assert engine.stats()["hit_tokens"]["host"] > 0
        assert [n.id for n in cache.tree.all_nodes() if not n.is_root and cache.tree.windows.of(n).lock_ref] == []
        cache.tree.check_invariants()
    finally:
        engine.shutdown()


def test_storage_holds_full_objects_and_checkpoint_windows_a_new_process_reads_exactly(tmp_path, every_layer) -> None:
    """Conversations written through to a file store; a fresh engine (nothing in L1 / L2) continues them from
    it with a cold engine's tokens, each next turn hitting its whole history. Full objects hold the full layer
    only, window objects (5 sliding layers) exist for the pages of each conversation's last checkpoint only
    (issue 56 H4: an earlier turn's checkpoint goes once the turn that extends it is stored), and every-layer
    objects and these never read each other."""
    # the fixed split's sizes; replies cached too: the store holds whole histories (two checkpoints a turn)
    writer = Engine(MODEL, **stored(tmp_path / "hybrid", swa_full_tokens_ratio=0.8, cache_generated_kv="on"))
    nexts: list = []
    conversations(writer, keep=True, final=nexts)
    written = writer.stats()["storage"]["window"]
    writer.shutdown()
    continued, stats = continue_from(tmp_path / "hybrid", nexts)
    assert continued == cold_outputs(nexts)
    # each next turn reads its whole history (what its last turn computed, in whole pages: ~80 tokens a
    # conversation) from storage, but the shared head a previous continuation computed
    assert stats["hit_tokens"]["storage"] + stats["hit_tokens"]["device"] >= sum((len(p) - 10) // PS * PS for p in nexts)
    assert stats["hit_tokens"]["storage"] >= sum((len(p) - 10) // PS * PS for p in nexts) - 2 * len(SYSTEM)
    assert written["backup_tokens"] > 0 and written["backup_bytes"] > 0  # /stats: each component's figures
    assert written["deleted_tokens"] > 0
    assert stats["storage"]["window"]["prefetched_tokens"] > 0
    full, window = object_files(tmp_path / "hybrid")
    # windows of each conversation's last two checkpoints only (the last turn's prompt end and answer end; an
    # 8-token window of 4-token pages reads 3 pages: at most 6 pages a conversation) and of the shared head's
    # end, where the three branch (3), each beside its page's full object; the conversations have ~50 pages
    assert 0 < len(window) <= 3 * 6 + 3 < len(full)
    assert {f.name.removesuffix("-window") for f in window} <= {f.name for f in full}
    conversations(Engine(MODEL, disable_hybrid_swa_memory=True, **stored(tmp_path / "every")))
    every, none = object_files(tmp_path / "every")
    assert not none
    # the same header, then the payload: 6 layers (every layer), 1 (full), 5 (window)
    e, f, w = every[0].stat().st_size, full[0].stat().st_size, window[0].stat().st_size
    assert (e - f) * 4 == (w - f) * 5 and w > f
    # an every-layer reader of the hybrid store (and the other way round) finds nothing it could misread
    other = Engine(MODEL, disable_hybrid_swa_memory=True, **stored(tmp_path / "hybrid"))
    assert conversations(other, keep=True)[0] == every_layer[0] and other.stats()["hit_tokens"]["storage"] == 0
    other.shutdown()
    other = Engine(MODEL, **stored(tmp_path / "every"))
    assert conversations(other, keep=True)[0] == every_layer[0] and other.stats()["hit_tokens"]["storage"] == 0
    other.shutdown()


@pytest.mark.pd
@pytest.mark.parametrize("transport, prefill_ratio, decode_ratio", [
    ("zmq", None, None),  # shared blocks on both sides (the default)
    ("zmq", None, 0.8),  # a shared prefill pool, a decode server with two pools (an explicit ratio)
    ("mooncake", None, 0.8),
    ("mooncake", 0.8, None),  # two pools -> shared blocks: Mooncake writes into each sliding group's blocks
])
def test_pd_decode_reuses_a_full_layer_prefix_without_its_window_and_receives_a_fresh_tail(
        transport, prefill_ratio, decode_ratio) -> None:
    """The decode server's cached head lost its window KV (tombstoned): it still reports the head as
    ``decode_prefix_len`` (its full layers hold it); the prefill server sends (or Mooncake writes) the full
    layers' rows after it and the window layers' rows of the prompt's last window only (the fresh SWA tail),
    and the answer is the every-layer pool's. Either side's pool is shared blocks (each window layer's rows
    at its sliding group's blocks) or two pools, whatever the other's."""
    if transport == "mooncake" and (why := mooncake_transfer_engine_missing()) is not None:
        pytest.skip(why)
    pd = dict(disaggregation_transfer_backend=transport, **BASE)
    prefill = Engine(MODEL, disaggregation_mode="prefill", disaggregation_bootstrap_port=0,
                     swa_full_tokens_ratio=prefill_ratio, **pd)
    decode = Engine(MODEL, disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True,
                    swa_full_tokens_ratio=decode_ratio, **pd)
    reference = Engine(MODEL, disable_hybrid_swa_memory=True, disable_radix_cache=True, **BASE)
    for engine, ratio in ((prefill, prefill_ratio), (decode, decode_ratio)):
        assert engine.stats()["device_pool"]["window"].get("shared_blocks", False) == (ratio is None)
    # each prompt's new part shorter than a window: its tail reaches into the shared head
    prompts = [SYSTEM + [(11 * a + i) % 200 + 20 for i in range(2 + 2 * a)] for a in range(3)]
    try:
        port = prefill.stats()["disaggregation"]["bootstrap_port"]
        tree = decode.backend.core.cache.tree
        spec = decode.loaded.spec
        row = 2 * spec.num_kv_heads * spec.head_dim * 4  # K + V of one token, one layer, float32
        sliding = sum(1 for i in range(spec.num_layers) if spec.layer_window(i))
        for room, prompt in enumerate(prompts, start=1):
            tree.windows.evict(10**6)  # every cached window gone; full layers stay
            assert tree.windows.held_pages == 0
            boot = Bootstrap("127.0.0.1", port, room)
            side = threading.Thread(target=lambda: prefill.generate([prompt], GREEDY, bootstrap=boot))
            side.start()
            got = decode.generate([prompt], GREEDY, bootstrap=boot)[0]
            side.join(timeout=60)
            assert got.output_ids == reference.generate([prompt], GREEDY)[0].output_ids
            start, tail = got.decode_prefix_len, decode.backend.core.cache.window_tail(len(prompt))
            if room > 1:  # the shared head (36 tokens) is the decode side's, full layers only
                assert start == len(SYSTEM) // PS * PS and tail < start  # windows of the head come fresh
            assert got.kv_transferred_tokens == len(prompt) - start
            full_rows, window_rows = len(prompt) - start, len(prompt) - tail
            assert got.kv_transferred_bytes == row * ((spec.num_layers - sliding) * full_rows + sliding * window_rows)
    finally:
        for e in (prefill, decode, reference):
            e.shutdown()


@pytest.mark.parametrize("ratio", [0.001, 0.05, 0.8])
def test_the_smallest_window_pool_still_computes_prompts_a_window_at_a_time(ratio) -> None:
    """Gemma 3 270M's geometry (window 512, pages of 16) with pools of every size: the window pool never
    drops below what a prompt chunk of a window needs, and the chunk the engine uses fits in it (a window
    pool that fit only decode steps once left prompts computing 0 tokens a step, forever)."""
    from hicache.cache.device_window import window_footprint
    from hicache.runtime.hybrid_pool import HybridPlan

    plan = HybridPlan(512, frozenset(range(15)), ratio, 16)
    for full_pages in (81, 188, 4097, 65537):
        pages = plan.window_pages(full_pages)
        chunk = plan.prefill_chunk(pages, 2048)
        assert 512 <= chunk <= 2048 and chunk % 16 == 0
        assert window_footprint(512, 16, chunk) <= pages - 1


@pytest.mark.multirank
@pytest.mark.storage
def test_unified_grid_holds_full_and_window_cells_another_layout_reads(tmp_path, every_layer) -> None:
    """The unified key scheme on a grid of 3-layer ranges: a cell's full layers and its window layers are
    separate objects (``_swa``, checkpoint pages only; the range of three window layers has no full object).
    One rank writes; two pipeline stages, another layout, read them and answer as the every-layer pool."""
    grid = dict(hicache_storage_key_scheme="unified", hicache_storage_layer_partition=3)
    nexts: list = []
    conversations(Engine(MODEL, **stored(tmp_path, cache_generated_kv="on", **grid)), final=nexts)  # whole histories
    full, _ = object_files(tmp_path)
    window = [f for f in full if f.name.endswith("_swa")]
    full = [f for f in full if not f.name.endswith("_swa")]
    assert {f.name.rsplit("_", 1)[-1] for f in full} == {"H0"} and all("_L3-6_" in f.name for f in full)
    assert {f.name.split("_")[-3] for f in window} == {"L0-3", "L3-6"}  # {hash}_{digest}_L{a}-{b}_H0_swa
    # one full layer (5) in L3-6's object; window layers 3-4 in its _swa object, 0-2 in L0-3's
    sizes = {f.name.split("_")[-3]: f.stat().st_size for f in window}
    f1 = full[0].stat().st_size
    assert (sizes["L0-3"] - f1) * 1 == (sizes["L3-6"] - f1) * 2  # the same header; 3 vs 2 layers beyond 1
    reader = Engine(MODEL, pp_size=2, **dict(stored(tmp_path, hicache_storage_prefetch_policy="wait_complete", **grid),
                                             hicache_ratio=4.0))
    try:
        outputs = [reader.generate([p], GREEDY)[0].output_ids for p in nexts]  # each conversation's next turn
        hits = reader.stats()["hit_tokens"]["storage"]
    finally:
        reader.shutdown()
    assert outputs == cold_outputs(nexts) and hits >= sum(len(p) - 10 for p in nexts) - 2 * len(SYSTEM) - 3 * PS


# two layers of the target's rows (one KV head of 32): packed, they follow the target's full layer
DRAFTED = dict(speculative_algorithm="STANDALONE", speculative_num_steps=3,
               speculative_draft_model_path='random:{"preset": "gemma-small", "num_layers": 2, '
                                            '"layer_kinds": ["sliding", "full"]}')


@pytest.mark.storage
@pytest.mark.spec
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["packed", "sidecar"])
def test_a_draft_beside_a_hybrid_model_on_the_unified_grid_round_trips_through_storage(tmp_path, every_layer,
                                                                                       layout) -> None:
    """A speculative draft (packed after the target's full layer, or in a sidecar pool) beside the window
    component on the unified grid: the conversations give the plain engine's tokens (greedy speculation is
    lossless); the store holds each page's full cell with the draft's ``draft_`` cell beside it and the
    checkpoints' ``_swa`` cells; a fresh engine continues from it with storage hits, a cold engine's tokens
    and its drafts' acceptance (the draft's KV came back as it was computed)."""
    drafted = dict(DRAFTED, speculative_draft_kv_layout=layout)
    grid = dict(drafted, hicache_storage_key_scheme="unified", hicache_storage_layer_partition=3)
    nexts: list = []
    # replies cached too: the store holds whole histories, the draft's KV of the replies with them
    writer = Engine(MODEL, **stored(tmp_path, cache_generated_kv="on", **grid))
    assert writer.backend.core.pool.hybrid and (writer.cache.sidecar_view is None) == (layout == "packed")
    outputs, _ = conversations(writer, final=nexts)
    assert outputs == every_layer[0]
    names = [f.name for f in tmp_path.rglob("*") if f.is_file()]
    # {hash}_{digest}_{cell}: layers 0-4 slide, 5 is full (no full cell L0-3); the draft's two layers
    assert {name.split("_", 2)[-1] for name in names} == {"L3-6_H0", "draft_L0-2_H0", "L0-3_H0_swa", "L3-6_H0_swa"}
    assert len([n for n in names if n.endswith("_L3-6_H0")]) == len([n for n in names if n.endswith("_draft_L0-2_H0")])
    continued, stats = continue_from(tmp_path, nexts, **grid)
    cold = Engine(MODEL, disable_radix_cache=True, **EXACT, **drafted)
    try:
        assert continued == [cold.generate([p], GREEDY)[0].output_ids for p in nexts]
        assert stats["speculative"]["accept_length"] == cold.stats()["speculative"]["accept_length"]
    finally:
        cold.shutdown()
    # each next turn's history, in whole pages, but for a cut back to a boundary whose window was kept
    assert stats["hit_tokens"]["storage"] + stats["hit_tokens"]["device"] >= \
        sum((len(p) - 10) // PS * PS for p in nexts) - len(nexts) * PS
    assert stats["hit_tokens"]["storage"] > stats["hit_tokens"]["device"]


@pytest.mark.engine
def test_the_demo_names_the_window_pool_and_what_it_holds(capsys) -> None:
    from hicache.frontend.demo import run_demo

    engine = Engine(MODEL, chat_template="chatml", **dict(BASE, max_total_tokens=4096))
    try:
        run_demo(engine, turns=2, max_new_tokens=6, agents=2, cold_rerun=False)
    finally:
        engine.shutdown()
    out = capsys.readouterr().out
    assert "a window pool of" in out and "window pool:" in out and "hold cached windows" in out


@pytest.mark.storage
def test_corrupt_window_objects_are_reported_and_cut_the_hit_back(tmp_path) -> None:
    """DESIGN invariant 5 for the window component: every window object in the store damaged; a fresh
    engine continuing the stored conversations counts the checksum failures, uses no window it cannot
    trust (its hits shrink) and answers as a cold engine."""
    import shutil

    nexts: list = []
    conversations(Engine(MODEL, **stored(tmp_path / "store")), final=nexts)
    shutil.copytree(tmp_path / "store", tmp_path / "copy")  # a reader writes too: its next turn supersedes
    clean, clean_stats = continue_from(tmp_path / "copy", nexts)
    for f in object_files(tmp_path / "store")[1]:
        data = bytearray(f.read_bytes())
        data[-8] ^= 0xFF
        f.write_bytes(bytes(data))
    damaged, stats = continue_from(tmp_path / "store", nexts)
    assert damaged == clean == cold_outputs(nexts)
    assert stats["storage"]["failures"].get("checksum", 0) > 0
    assert stats["hit_tokens"]["storage"] < clean_stats["hit_tokens"]["storage"]


@pytest.mark.engine
def test_the_kv_budget_counts_both_components(monkeypatch) -> None:
    """DESIGN invariant 6: sized from a memory budget (--mem-fraction-static's, fixed here at 8 MiB), the full
    and the window component together stay within it -- but for their reserved page 0, as every pool -- and
    use most of it."""
    import hicache.runtime.rank_plan as rank_plan

    budget = 8 * 2**20
    monkeypatch.setattr(rank_plan, "device_memory_budget", lambda device, fraction: budget)
    engine = Engine(MODEL, dtype="float32", kv_cache_dtype="float32", page_size=PS, mem_fraction_static=0.5,
                    swa_full_tokens_ratio=0.25)
    try:
        pool = engine.backend.core.pool
        reserved = pool.bytes_per_page + pool.windows.bytes_per_page  # page 0 of each component
        assert pool.hybrid and 0.95 * budget <= pool.total_bytes - reserved <= budget
        assert pool.windows.pages - 1 == int(0.25 * (pool.num_pages - 1))
    finally:
        engine.shutdown()


@pytest.mark.engine
def test_device_tombstones_whose_checkpoint_the_host_holds_still_hit(every_layer) -> None:
    """Issue 56 H5: the device keeps a conversation's full-layer pages but its windows were tombstoned,
    while its host copy holds the checkpoint: the next turn hits the whole history (the window comes
    back from the host with the hit), not 0 tokens, and gives the every-layer pool's tokens."""
    engine = Engine(MODEL, **BASE, enable_hierarchical_cache=True, hicache_ratio=2.0)
    core = engine.backend.core
    history = SYSTEM + [(11 * i) % 200 + 20 for i in range(5)]
    reference = Engine(MODEL, disable_hybrid_swa_memory=True, **BASE)
    try:
        first = engine.generate([history], GREEDY)[0]
        turn = history + first.output_ids + [33, 34, 35, 36]
        core.cache.drain()  # the backups (full pages + the checkpoint's window) have landed
        tree = core.cache.tree
        assert tree.windows.evict(10**6) > 0 and tree.windows.held_pages == 0
        second = engine.generate([turn], GREEDY)[0]
        core.cache.drain()
        tree.check_invariants()
        expected = [r for r in (reference.generate([history], GREEDY)[0], reference.generate([turn], GREEDY)[0])]
    finally:
        engine.shutdown()
        reference.shutdown()
    assert second.cached_tokens == expected[1].cached_tokens >= len(history) // PS * PS
    assert second.cached_tokens_details["device"] == second.cached_tokens  # full pages on the device, windows loaded
    assert [first.output_ids, second.output_ids] == [r.output_ids for r in expected]


@pytest.mark.storage
@pytest.mark.parametrize("max_total_tokens, hybrid", [(4096, True), (16, False)])
def test_the_advertised_storage_layout_is_the_one_objects_go_under(tmp_path, max_total_tokens, hybrid) -> None:
    """Issue 56 H6: a pool too small for a window component keeps every layer (one log line), and its
    objects go under the every-layer namespace; the layout routers read (/get_hicache_l3_cache_layout)
    advertised the hybrid one regardless."""
    grid = dict(hicache_storage_key_scheme="unified", hicache_storage_layer_partition=3)
    engine = Engine(MODEL, **dict(stored(tmp_path, **grid), max_total_tokens=max_total_tokens))
    try:
        assert engine.backend.core.pool.hybrid is hybrid
        layout = engine.storage_layout()
        used = engine.backend.core.cache.keys.digest(engine.model_namespace)
        assert layout["namespace_digest"] == used.hex()
        assert (layout["window_cells"] is not None) is hybrid
    finally:
        engine.shutdown()


def test_window_pages_evicted_before_a_wait_for_backups_are_counted() -> None:
    """Two pools: a window allocation that evicts what it can and still falls short waits for the host
    backups (they window-lock their checkpoints until their copies have read them), then evicts again;
    ``/stats`` counts the window pages of both attempts (it counted only the second's)."""
    engine = Engine(MODEL, **dict(EXACT, swa_full_tokens_ratio=0.5))
    try:
        rng = np.random.default_rng(7)
        for _ in range(4):
            engine.generate([rng.integers(20, 200, size=24).tolist()], GREEDY)
        windows = engine.backend.core.cache.device.windows
        cached = windows.cached
        held = [n for n in windows.tree.all_nodes() if not n.is_root and cached.of(n).held]
        assert len(held) >= 2
        for n in held[1:]:  # as host backups still reading these checkpoints hold them
            cached.of(n).lock_ref += 1

        def backups_done() -> None:
            for n in held[1:]:
                cached.of(n).lock_ref -= 1

        windows.settle_backups = backups_done
        usage = lambda: engine.stats()["device_pool"]["window"]  # noqa: E731
        before = usage()
        n = before["free_pages"] + cached.of(held[0]).held + 1  # one more than evicting the unlocked one frees
        pages = windows.alloc(n)
        after = usage()
        windows.allocator.free(pages)
    finally:
        engine.shutdown()
    assert len(pages) == n
    assert after["evicted_pages"] - before["evicted_pages"] == before["cached_pages"] - after["cached_pages"] > 1
