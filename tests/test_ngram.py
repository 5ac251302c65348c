"""NGRAM speculative decoding (issue 29): drafts copied from the request's own text and from the
token sequences the radix tree holds, verified row by row at decode cost."""

from __future__ import annotations

import random
from array import array

import pytest
import torch
from looping_prompts import looping_prompts

from hicache import Engine, SamplingParams
from hicache.cache.pools import PageAllocator
from hicache.cache.radix import RadixCache
from hicache.cache.tree_tokens import TreeTokenIndex
from hicache.config import ConfigError, EngineConfig
from hicache.runtime.ngram import NgramSettings, OwnText, pick_draft
from hicache.runtime.sampling import probabilities
from hicache.runtime.speculative import rejection_accept

pytestmark = pytest.mark.spec

NGRAM = dict(speculative_algorithm="NGRAM")
BASE = dict(dtype="float32", page_size=4, max_total_tokens=4096)
GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0)
SETTINGS = NgramSettings(max_drafts=7, min_window=1, max_window=12, match_type="BFS", levels=(1, 3))


# ---- flags ------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, message", [
    (dict(speculative_draft_model_path="random:tiny"), "NGRAM takes no draft model"),
    (dict(speculative_ngram_max_bfs_breadth=10), "tree drafts, which are not built"),
    (dict(speculative_ngram_min_bfs_breadth=2), "tree drafts, which are not built"),
    (dict(speculative_ngram_max_trie_depth=8, speculative_ngram_branch_length=6), "disagree; give one"),
    (dict(speculative_ngram_min_match_window_size=4, speculative_ngram_max_match_window_size=2), "1 <= min <= max"),
    (dict(speculative_ngram_match_type="DFS"), "BFS or PROB"),
    (dict(attn_cp_size=2, tp_size=2), "not supported yet"),
])
def test_bad_ngram_flags_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**{**NGRAM, **options})


def test_ngram_flags_take_sglang_names_and_defaults() -> None:
    assert EngineConfig(**NGRAM).speculative_steps == 7  # min(trie depth 18, 8) - 1
    assert EngineConfig(**NGRAM, speculative_num_draft_tokens=4).speculative_steps == 3
    # the older SGLang name of the trie depth caps the default drafts the same way
    assert EngineConfig(**NGRAM, speculative_ngram_branch_length=5).speculative_steps == 4
    assert EngineConfig(**NGRAM, speculative_ngram_max_trie_depth=5).ngram_trie_depth == 5
    # NGRAM needs no draft KV: a P/D decode server may run it (a draft model stays refused there)
    EngineConfig(**NGRAM, disaggregation_mode="decode")
    with pytest.raises(ConfigError, match="STANDALONE is not supported yet"):
        EngineConfig(speculative_algorithm="STANDALONE", speculative_draft_model_path="random:tiny",
                     disaggregation_mode="decode")


# ---- the lookups -----------------------------------------------------------------------------
def test_prompt_lookup_drafts_the_continuation_of_the_longest_match() -> None:
    own = OwnText(SETTINGS.levels)
    prompt = [1, 2, 3, 4, 5, 6, 9, 9, 2, 3, 7, 8]
    own.update(prompt, [1, 2, 3])
    # "1 2 3" ends at position 2 (continuation 4 5 6); "2 3" also ends at 9 (continuation 7 8):
    # the longer match wins
    assert pick_draft(own.tokens, [own.occurrences], SETTINGS, 4) == ([4, 5, 6, 9], 3)
    own.update(prompt, [1, 2, 3, 4, 5, 6, 9, 9, 2, 3])
    assert pick_draft(own.tokens, [own.occurrences], SETTINGS, 2) == ([7, 8], 10)  # the whole first pass
    # PROB: the continuation most occurrences share, among the longest matches
    own2 = OwnText(SETTINGS.levels)
    own2.update([5, 1, 7, 5, 1, 7, 5, 1, 8, 0], [5, 1])
    prob = NgramSettings(7, 1, 12, "PROB", (1, 3))
    assert pick_draft(own2.tokens, [own2.occurrences], prob, 1)[0] == [7]
    assert pick_draft(own2.tokens, [own2.occurrences], SETTINGS, 1)[0] == [8]  # BFS: the most recent


def _tree(page_size: int = 2, pages: int = 64, host_pages: int = 0) -> tuple[RadixCache, TreeTokenIndex]:
    host = PageAllocator(host_pages) if host_pages else None
    tree = RadixCache(page_size, PageAllocator(pages), host_allocator=host)
    index = TreeTokenIndex((1, 3), per_key=8)
    tree.observer = index
    return tree, index


def _insert(tree: RadixCache, tokens: list[int]) -> None:
    pages = tree.allocator.alloc(len(tokens) // tree.page_size)
    done = tree.insert("ns", tokens, pages)
    tree.allocator.free(pages[: done // tree.page_size])  # pages the tree already had


def _draft_from_tree(index: TreeTokenIndex, tail: list[int], want: int = 4) -> list[int]:
    seq = array("i", tail)
    return pick_draft(seq, [lambda n, key: index.occurrences("ns", n, key)], SETTINGS, want)[0]


def test_the_tree_index_follows_inserts_splits_and_evictions() -> None:
    tree, index = _tree()
    _insert(tree, [10, 11, 12, 13, 14, 15, 16, 17])
    assert _draft_from_tree(index, [99, 12, 13]) == [14, 15, 16, 17]
    # a second sequence shares the first page: the first leaf splits, its tokens stay indexed
    _insert(tree, [10, 11, 20, 21, 22, 23])
    tree.match_prefix("ns", [10, 11, 12, 13])  # splits again inside the first sequence
    assert _draft_from_tree(index, [12, 13]) == [14, 15, 16, 17]
    assert _draft_from_tree(index, [11, 20]) == [21, 22, 23]
    index.check()
    # evicting the first sequence's tail (no host tier: the nodes leave the tree) removes its tokens
    tree.evict(2)
    index.check()
    remaining = {tuple(n.key.tolist()) for n in tree.all_nodes() if not n.is_root}
    assert (16, 17) not in remaining and (14, 15, 16, 17) not in remaining
    assert _draft_from_tree(index, [12, 13]) in ([14, 15], [])  # never the evicted 16 17
    tree.evict(100)
    index.check()
    assert index.tokens_held == 0 and _draft_from_tree(index, [12, 13]) == []


def test_tokens_whose_kv_went_to_host_memory_still_give_drafts() -> None:
    tree, index = _tree(host_pages=64)
    _insert(tree, [1, 2, 3, 4, 5, 6])
    for node in list(tree.all_nodes()):  # give every node a host copy, then evict the device copies
        if not node.is_root and node.host_pages is None:
            tree.attach_host_pages(node, tree.host_allocator.alloc(node.num_pages))
    tree.evict(100)
    assert all(n.device_pages is None for n in tree.all_nodes() if not n.is_root)
    assert _draft_from_tree(index, [2, 3]) == [4, 5, 6]
    tree.reset()
    assert index.tokens_held == 0 and _draft_from_tree(index, [2, 3]) == []


def test_lookups_under_random_eviction_never_return_tokens_the_tree_dropped() -> None:
    """Inserts, matches (splits), evictions and lookups interleaved: every draft is text that
    follows its match somewhere in the tree as it is at that moment."""
    rng = random.Random(3)
    tree, index = _tree(page_size=2, pages=48)
    vocab = list(range(1, 9))  # a small vocabulary: many shared n-grams, many candidates
    for step in range(400):
        op = rng.random()
        if op < 0.35:
            seq = [rng.choice(vocab) for _ in range(2 * rng.randint(1, 6))]
            if tree.evictable_pages + tree.allocator.available < len(seq) // 2:
                continue
            if tree.allocator.available < len(seq) // 2:
                tree.evict(len(seq) // 2 - tree.allocator.available)
            _insert(tree, seq)
        elif op < 0.5:
            tree.match_prefix("ns", [rng.choice(vocab) for _ in range(6)])
        elif op < 0.65:
            tree.evict(rng.randint(1, 4))
        else:
            tail = [rng.choice(vocab) for _ in range(rng.randint(1, 4))]
            draft = _draft_from_tree(index, tail, 3)
            if draft:
                paths = _paths(tree)
                assert any(_contains(p, tail[-1:] + draft) for p in paths), (step, tail, draft)
        index.check()
        tree.check_invariants()


def _paths(tree: RadixCache) -> list[list[int]]:
    out, stack = [], [(tree._roots["ns"], [])] if "ns" in tree._roots else []
    while stack:
        node, prefix = stack.pop()
        path = prefix + node.key.tolist()
        out.append(path)
        stack.extend((c, path) for c in node.children.values())
    return out


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


# ---- the acceptance rule for certain drafts -------------------------------------------------------
def test_copied_drafts_keep_the_targets_distribution() -> None:
    """A copied draft is certain (q = 1 at d): kept with probability p(d), else a draw from p
    without d -- the first token out is distributed as p, whatever d is."""
    class Req:
        sampling = SamplingParams(temperature=1.0)
        generator = torch.Generator().manual_seed(11)

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]] * 2)
    p = probabilities(logits[0], Req.sampling)
    p = p / p.sum()
    for draft in (0, 3):  # the likeliest token, and an unlikely one
        n, counts = 6000, torch.zeros(5)
        for _ in range(n):
            counts[rejection_accept([draft], None, logits, Req)[0]] += 1
        assert (counts / n - p).abs().max() < 0.02, (draft, counts / n, p)


# ---- the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_outputs() -> list[list[int]]:
    engine = Engine("random:tiny", **BASE)
    try:
        return [r.output_ids for r in engine.generate(looping_prompts(4), GREEDY)]
    finally:
        engine.shutdown()


def test_greedy_output_equals_the_plain_engine(plain_outputs: list[list[int]]) -> None:
    """Several requests in one batch (drafting or not), chunked prefill: the plain engine's
    tokens; drafts were taken and accepted."""
    engine = Engine("random:tiny", **BASE, **NGRAM, chunked_prefill_size=32)
    try:
        out = engine.generate(looping_prompts(4), GREEDY)
        assert [r.output_ids for r in out] == plain_outputs
        stats = engine.stats()["speculative"]
        assert stats["request_verify_steps"] > 0 and stats["accept_length"] > 1.0
        assert sum(r.spec_verify_steps for r in out) == stats["request_verify_steps"]
        for r in out:
            assert r.spec_verify_steps == 0 or 1.0 <= r.spec_accept_length <= 8.0
        # fewer passes than tokens
        assert sum(r.spec_verify_steps for r in out) < sum(r.completion_tokens for r in out)
        usage = engine.cache.usage()
        assert usage["free_pages"] == engine.cache.capacity_pages - usage["cached_pages"]
    finally:
        engine.shutdown()


def test_a_later_request_drafts_from_an_earlier_ones_answer() -> None:
    """A prompt with nothing to copy: the first run can draft only from its own output; the
    same prompt again drafts the answer the tree holds (its own text never held it)."""
    engine = Engine("random:tiny", **BASE, **NGRAM)
    try:
        prompt = [(i * 37 + 11) % 240 + 5 for i in range(64)]  # no n-gram repeats
        first = engine.generate([prompt], GREEDY)[0]
        again = engine.generate([prompt], GREEDY)[0]
        assert again.output_ids == first.output_ids
        # most of the answer came in passes of several tokens, copied from the first one's
        assert again.spec_accept_length > max(4.0, first.spec_accept_length)
        assert again.spec_accept_length * again.spec_verify_steps >= 0.75 * again.completion_tokens
        assert engine.stats()["speculative"]["indexed_tokens"] >= len(prompt)
    finally:
        engine.shutdown()


# ---- ranks, the server ---------------------------------------------------------------------------
RANKS_OPTS = dict(dtype="float32", page_size=4, max_total_tokens=1024, enable_hierarchical_cache=True, **NGRAM)


def _session(engine: Engine) -> list[tuple[list[int], float]]:
    """Two agents, two turns (histories resent), then a seeded sampled request."""
    history = looping_prompts(2)
    out = []
    for turn in range(2):
        prompts = [h + [(turn * 11 + i) % 200 + 20 for i in range(8)] for h in history]
        results = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0))
        out += [(r.output_ids, r.spec_accept_length) for r in results]
        history = [p + r.output_ids for p, r in zip(prompts, results)]
    sampled = engine.generate([history[0]], SamplingParams(max_new_tokens=12, temperature=0.8, seed=3))[0]
    return out + [(sampled.output_ids, sampled.spec_accept_length)]


@pytest.mark.multirank
@pytest.mark.parallel
def test_tp_and_pp_ranks_draft_and_answer_like_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank proposes the same drafts (the consensus checker compares them each step) and
    the answers and acceptance equal one rank's."""
    from hicache import consensus_record

    one = Engine("random:small", **RANKS_OPTS)
    try:
        reference = _session(one)
    finally:
        one.shutdown()
    assert any(a > 1.0 for _, a in reference)
    monkeypatch.setenv(consensus_record.ENV_VAR, "1")
    for tp, pp in ((2, 1), (1, 2)):
        ranks = Engine("random:small", tp_size=tp, pp_size=pp, **RANKS_OPTS)
        try:
            assert _session(ranks) == reference, (tp, pp)
        finally:
            ranks.shutdown()


@pytest.mark.server
def test_sglang_bench_reads_the_accept_length_from_server_info() -> None:
    import httpx

    from hicache.server.serve import ServerThread

    engine = Engine("random:tiny", **BASE, **NGRAM)
    srv = ServerThread(engine, served_model_name="tiny")
    base_url = srv.start()
    try:
        body = {"model": "tiny", "prompt": looping_prompts(1)[0], "max_tokens": 24, "temperature": 0}
        usage = httpx.post(base_url + "/v1/completions", json=body, timeout=60).json()["usage"]
        assert usage["spec_verify_steps"] >= 1
        info = httpx.get(base_url + "/get_server_info", timeout=10).json()
        assert info["speculative_algorithm"] == "NGRAM"
        assert info["internal_states"][0]["avg_spec_accept_length"] == pytest.approx(usage["spec_accept_length"])
        metrics = httpx.get(base_url + "/metrics", timeout=10).text
        assert "hicache_spec_accept_length_count 1.0" in metrics
    finally:
        srv.stop()


@pytest.mark.pd
def test_a_pd_decode_server_drafts_and_answers_like_the_plain_engine(plain_outputs: list[list[int]]) -> None:
    """NGRAM needs no draft KV: the decode server speculates over the KV the prefill server sent."""
    import threading

    from hicache.disagg.bootstrap import Bootstrap

    prefill = Engine("random:tiny", disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **BASE)
    decode = Engine("random:tiny", disaggregation_mode="decode", **BASE, **NGRAM)
    try:
        port = prefill.stats()["disaggregation"]["bootstrap_port"]
        for room, prompt in enumerate(looping_prompts(2)):
            boot = Bootstrap("127.0.0.1", port, room + 1)
            side = threading.Thread(target=lambda: prefill.generate(prompt, GREEDY, bootstrap=boot))
            side.start()
            got = decode.generate(prompt, GREEDY, bootstrap=boot)[0]
            side.join(timeout=60)
            assert got.output_ids == plain_outputs[room] and got.disaggregated
        assert decode.stats()["speculative"]["request_verify_steps"] > 0
    finally:
        prefill.shutdown()
        decode.shutdown()
