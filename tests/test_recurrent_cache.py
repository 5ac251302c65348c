"""Prefix hits on a hybrid recurrent model (issue 59, step c): a hit resumes the recurrent layers from
a snapshot of their state taken at the hit's boundary, so the tokens after it are the cold run's.
Checked the way a user would: the same prompt again, the next turn of a conversation, requests
sharing a system prompt -- each hits (device tier) and gives the tokens of a cold run of the same
prompt (a fresh ``cache_salt``: nothing to hit); and a snapshot pool too small for the workload
degrades hits without failing a request or breaking the tree's invariants."""

from __future__ import annotations

import pytest
from recurrent_runs import GREEDY, MODELS, assert_as_cold, cold_run, ids

from hicache import Engine, SamplingParams

pytestmark = pytest.mark.cache



@pytest.fixture(params=MODELS)
def model(request) -> str:
    return request.param


def make_engine(model: str, **kw) -> Engine:
    opts = dict(dtype="float32", page_size=4, max_total_tokens=4096, chunked_prefill_size=64)
    opts.update(kw)
    return Engine(model, **opts)


def grid(engine: Engine) -> int:
    """Tokens between the boundaries a snapshot is taken at."""
    return engine.stats()["device_pool"]["recurrent_state"]["grid_tokens"]


def cold(engine: Engine, prompt: list[int]) -> list[int]:
    """The prompt's greedy tokens with nothing to hit (a namespace of its own)."""
    return cold_run(engine, prompt).output_ids


def test_the_same_prompt_again_hits_its_checkpoint_and_keeps_the_cold_tokens(model: str) -> None:
    engine = make_engine(model)
    g = grid(engine)
    for length in (9, 64, 150):  # one chunk, exactly a chunk, three chunks
        prompt = ids(length, seed=length)
        first = engine.generate([prompt], GREEDY)[0]
        again = engine.generate([prompt], GREEDY)[0]
        assert again.cached_tokens == (length - 1) // g * g  # the deepest boundary before its last token
        assert again.output_ids == first.output_ids
        assert_as_cold(engine, prompt, again)
    engine.cache.tree.check_invariants()


def test_each_turn_of_a_conversation_hits_the_previous_prompt(model: str) -> None:
    engine = make_engine(model)
    g = grid(engine)
    history, previous = ids(70, seed=1), 0
    for turn in range(4):
        out = engine.generate([history], GREEDY)[0]
        if turn:
            assert out.cached_tokens == (previous - 1) // g * g  # the previous prompt's checkpoint
        assert_as_cold(engine, history, out)
        previous = len(history)
        history = history + out.output_ids + ids(17, seed=10 + turn)
    assert engine.stats()["device_pool"]["recurrent_state"]["snapshots_cached"] > 0


def test_requests_sharing_a_system_prompt_hit_it_once_a_branch_is_seen(model: str) -> None:
    """The first request snapshots only its own checkpoint (which the second hits where it lies
    inside the system prompt: a 64-token grid); the second, which branches from it after the
    system prompt, snapshots the branch point; the third hits it."""
    engine = make_engine(model)
    g, system = grid(engine), ids(70, seed=7)
    prompts = [system + ids(20, seed=20 + i) for i in range(3)]
    outs = [engine.generate([p], GREEDY)[0] for p in prompts]
    branch = len(system) // 4 * 4 // g * g  # the system prompt's whole pages, on the grid
    checkpoint = (len(prompts[0]) - 1) // g * g
    assert outs[0].cached_tokens == 0 and outs[1].cached_tokens == (checkpoint if checkpoint <= branch else 0)
    assert outs[2].cached_tokens == branch
    for prompt, out in zip(prompts, outs):
        assert_as_cold(engine, prompt, out)


def test_a_short_snapshot_pool_degrades_hits_without_failing_a_request(model: str) -> None:
    """16 conversations of 3 turns, two at a time, in a pool of 2 snapshots (0.5 per 1K KV tokens):
    a running turn's hit locks its snapshot, so the next turn's checkpoint may find no slot and is
    not taken -- that turn hits an earlier one (a shallower hit, not a failure). Every request
    finishes with the cold tokens, the pool never holds more than it has, the tree's invariants
    hold after every turn, and turns still hit."""
    engine = make_engine(model, recurrent_snapshot_ratio=0.5, max_running_requests=4)
    assert engine.stats()["device_pool"]["recurrent_state"]["snapshot_slots"] == 2
    hits, turns = 0, 0
    for pair in range(8):
        histories = [ids(70 + 2 * pair + i, seed=100 + 2 * pair + i) for i in range(2)]
        for turn in range(3):
            outs = engine.generate(histories, GREEDY)
            for i, out in enumerate(outs):
                assert out.finish_reason in ("length", "stop")  # (a random model may say its EOS)
                hits, turns = hits + bool(out.cached_tokens), turns + 1
                histories[i] = histories[i] + out.output_ids + ids(9, seed=1000 * turn + i)
            engine.cache.tree.check_invariants()
            state = engine.stats()["device_pool"]["recurrent_state"]
            assert state["snapshots_cached"] + state["snapshots_free"] == state["snapshot_slots"] == 2
    assert hits >= turns // 3  # the second and third turns of some conversations
    assert_as_cold(engine, histories[1], engine.generate([histories[1]], GREEDY)[0])


def tree_with_states(snapshots: int) -> tuple:
    """A radix tree of 2-token pages with the state component over ``snapshots`` snapshot slots."""
    from hicache.cache.pools import PageAllocator
    from hicache.cache.radix import RadixCache
    from hicache.cache.state_pool import SlotRange
    from hicache.cache.state_tree import TreeStates

    tree = RadixCache(2, PageAllocator(64), "lru")
    states = TreeStates(tree, SlotRange(1, snapshots))
    tree.add_component(states)
    return tree, states


def insert(tree, tokens: list[int], first_page: int) -> None:
    import numpy as np

    pages = np.arange(first_page, first_page + len(tokens) // 2)
    tree.insert("ns", tokens, pages, {"recurrent_state": np.zeros(len(pages), dtype=np.int64)})


def test_a_match_ends_at_the_deepest_node_end_holding_a_snapshot() -> None:
    """Tree only: KV cached for 12 tokens, snapshots at 4 and 8; a match of 11 tokens is cut to 8, and
    to 4 once 8's snapshot is gone; a node split at 6 leaves its upper part without one; eviction of
    snapshots takes a spare one (4: a deeper one on its path) before a path's deepest, never a locked one's."""
    tree, states = tree_with_states(4)
    seq = list(range(10, 22))
    insert(tree, seq, 1)
    for end in (4, 8):
        assert states.attach(tree.boundary_node("ns", seq[:end]), states.alloc())
    assert tree.match_prefix("ns", seq[:11]).device_hit_tokens == 8
    assert not states.attach(tree.boundary_node("ns", seq[:8]), 4)  # one snapshot a boundary
    tree.boundary_node("ns", seq[:6])  # a split inside the node ending at 8
    assert tree.match_prefix("ns", seq[:11]).device_hit_tokens == 8
    assert tree.match_prefix("ns", seq[:7]).device_hit_tokens == 4  # (6 ends a node, but holds no snapshot)
    leaf = tree.boundary_node("ns", seq[:8])
    tree.inc_lock_ref(leaf)
    assert states.evict(2) == 0  # the path to a locked node keeps its snapshots
    tree.dec_lock_ref(leaf)
    assert states.evict(1) == 1 and tree.match_prefix("ns", seq[:11]).device_hit_tokens == 8  # the spare one went
    tree.check_invariants()
    assert states.evict(1) == 1 and tree.match_prefix("ns", seq[:11]).device_hit_tokens == 0
    tree.check_invariants()


def test_kv_eviction_takes_leaves_without_a_snapshot_first() -> None:
    tree, states = tree_with_states(4)
    a, b = list(range(10, 18)), list(range(10, 14)) + list(range(30, 34))  # two leaves below a shared node
    insert(tree, a, 1)
    insert(tree, b, 20)
    assert states.attach(tree.boundary_node("ns", a), states.alloc())  # only a's leaf holds a snapshot
    tree.match_prefix("ns", a)  # and a is the most recently used... b is dead all the same: evicted first
    assert tree.evict(1) == 2
    assert tree.match_prefix("ns", a).device_hit_tokens == 8
    assert tree.peek_prefix("ns", b, cut=False).device_hit_tokens == 4
    tree.check_invariants()


@pytest.mark.parametrize("preset", ["lfm2-tiny", "gdn-tiny", "mamba2-tiny"])
def test_deterministic_inference_hits_and_batches_give_the_same_bits(preset: str) -> None:
    """--enable-deterministic-inference: a hit, a cold run and a batched run give the same tokens and
    the same log-probabilities bit for bit (row-invariant GEMMs; scans on the grid the hit starts on)."""
    model = f'random:{{"preset": "{preset}", "head_dim": 32, "num_heads": 2, "num_kv_heads": 1}}'  # (native heads)
    engine = make_engine(model, page_size=16, enable_deterministic_inference=True)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    prompt = ids(150, seed=3)
    engine.generate([prompt], greedy)
    hit = engine.generate([prompt], greedy)[0]
    alone = engine.generate([prompt], greedy, cache_salt="cold")[0]
    batched = engine.generate([prompt, prompt[:100]], greedy, cache_salt="batched")[0]
    assert hit.cached_tokens > 0
    assert [(t, p.logprob) for t, p in zip(hit.output_ids, hit.logprobs)] \
        == [(t, p.logprob) for t, p in zip(alone.output_ids, alone.logprobs)] \
        == [(t, p.logprob) for t, p in zip(batched.output_ids, batched.logprobs)]


def test_a_cached_reply_keeps_a_snapshot_at_its_turns_end(model: str) -> None:
    """--cache-generated-kv on: decode keeps the state at the turn's last grid boundary, so the next turn
    (which resends the reply) hits into the reply, past the previous prompt's checkpoint, with a cold run's
    tokens and log-probabilities; the turn's earlier decode snapshots were not kept."""
    engine = make_engine(model, cache_generated_kv="on")
    g = grid(engine)
    first = ids(100, seed=1)
    reply = engine.generate([first], SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))[0]
    assert engine.stats()["device_pool"]["recurrent_state"]["snapshots_cached"] <= 2  # checkpoint + turn end
    second = first + reply.output_ids + ids(20, seed=2)
    out = engine.generate([second], GREEDY)[0]
    assert out.cached_tokens == (len(first) + 39) // g * g > (len(first) - 1) // g * g  # 39: the last reply token's KV is not computed
    assert_as_cold(engine, second, out)
