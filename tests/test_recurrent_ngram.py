"""NGRAM speculative decoding on hybrid recurrent models (issue 59, step e): a verify pass steps each
recurrent layer token by token with its decode step, keeps the state after each row, and the running
slot takes the accepted row's -- never the state after rejected drafts. Checked as a user would: the
greedy tokens equal a plain engine's on every family (conv, gated DeltaNet, Mamba2) while drafts are
both accepted and rejected; a prefix hit with NGRAM on gives a cold run's tokens; STANDALONE (a
draft model) is refused in one sentence. Plus the layer-level facts under them: a verify pass's
rows and row states are the decode steps'."""

from __future__ import annotations

import random

import pytest
import torch
from looping_prompts import looping_prompts
from recurrent_checks import random_ids, states

from hicache import Engine, SamplingParams
from hicache.cache.device_state import DeviceStates
from hicache.cache.state_pool import StatePool
from hicache.config import ConfigError
from hicache.model import DenseKV, load_model, make_forward_batch

pytestmark = pytest.mark.spec

MODELS = ["random:lfm2-tiny", "random:gdn-tiny", "random:mamba2-tiny"]
BASE = dict(dtype="float32", page_size=4, max_total_tokens=2048)
NGRAM = dict(speculative_algorithm="NGRAM")
GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0)
LOGPROB_ATOL = 1e-4  # float32: a hit's last chunk is a shorter GEMM than the cold run's (tests/test_recurrent_cache.py)




@pytest.fixture(scope="module", params=MODELS)
def model(request) -> str:
    return request.param


# ---- the layers: a verify pass is decode steps ------------------------------------------------------
def _prompt(model, kv: DenseKV, ids: list[int], n: int) -> None:
    model(make_forward_batch([ids[:n]], [0], [torch.arange(1, n + 1)], state_slots=[(0, 1)]), kv)


def test_a_verify_pass_gives_each_row_the_decode_steps_logits_and_state(model: str) -> None:
    """A prompt, then 5 generated tokens as decode steps, or as one verify pass whose rows' states go to
    slots 2..5 and a snapshot at its third position to slot 6: the same logits, and each row slot holds
    the state the decode step at that row left (float32, up to the projections' rounding of 5 rows vs 1)."""
    net = load_model(model, dtype=torch.float32).model
    ids, prompt, rows = random_ids(80, 256, seed=2), 70, 5
    steps_kv = DenseKV(net.spec, 100, torch.float32, state_slots=8)
    _prompt(net, steps_kv, ids, prompt)
    step_logits, step_states = [], []
    for p in range(prompt, prompt + rows):
        batch = make_forward_batch([ids[p:p + 1]], [p], [torch.arange(1, p + 2)], logits="all", generated=True,
                                   state_slots=[(1, 1)])
        step_logits.append(net(batch, steps_kv))
        step_states.append(states(steps_kv, 1))
    kv = DenseKV(net.spec, 100, torch.float32, state_slots=8)
    _prompt(net, kv, ids, prompt)
    batch = make_forward_batch([ids[prompt:prompt + rows]], [prompt], [torch.arange(1, prompt + rows + 1)],
                               logits="all", generated=True, state_slots=[(1, 1, ((prompt + 2, 6),), (2, 3, 4, 5))])
    torch.testing.assert_close(net(batch, kv), torch.cat(step_logits), atol=1e-5, rtol=0)
    for j in range(rows - 1):
        _assert_states_close(states(kv, 2 + j), step_states[j])
    _assert_states_close(states(kv, 1), step_states[-1])  # the running slot: after every row
    _assert_states_close(states(kv, 6), step_states[1])  # the snapshot at prompt + 2: after two rows


def _assert_states_close(got: list, want: list) -> None:
    for layer, expected in zip(got, want, strict=True):
        for a, b in zip(layer, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---- the scratch slots -------------------------------------------------------------------------------
def test_acceptance_keeps_the_accepted_rows_state_and_frees_the_scratch() -> None:
    """A verify pass of 4 rows holds 3 scratch slots (the state after rows 1..3; its running slot takes
    the state after all 4); acceptance copies the last accepted row's state into the running slot (none
    when every draft was taken) and frees the scratch, as an abort in flight does."""
    pool = StatePool([(((2,), torch.float32),)], running=2, snapshots=1, grid=4, device="cpu", scratch=3)
    states = DeviceStates(pool, None)
    hold = states.hold()
    buffer = pool.buffers[0][0]
    for kept, want in ((2, 2.0), (4, 9.0), (1, 1.0)):
        states.step(hold, computed=10, new_tokens=4, prompt_tokens=8)
        assert len(hold.rows) == 3 and pool.scratch.available == 0
        for j, slot in enumerate(hold.rows):
            buffer[slot] = j + 1.0  # the state after row j + 1
        buffer[hold.slot] = 9.0  # after all four
        states.accept(hold, kept)
        assert buffer[hold.slot].tolist() == [want, want] and pool.scratch.available == 3 and hold.rows == ()
    states.step(hold, computed=10, new_tokens=3, prompt_tokens=8)
    states.release(hold)  # an abort while the pass is in flight
    assert pool.scratch.available == 3 and pool.running.available == 2
    hold = states.hold()
    with pytest.raises(RuntimeError, match="too few of the state pool's 3 scratch slots"):
        states.step(hold, computed=10, new_tokens=5, prompt_tokens=8)
    assert pool.scratch.available == 3


# ---- the engine ------------------------------------------------------------------------------------
def plain_tokens(model: str, prompts: list[list[int]], **kw) -> list[list[int]]:
    """Greedy tokens of ``prompts`` on an engine without speculation."""
    plain = Engine(model, **BASE, **kw)
    try:
        return [r.output_ids for r in plain.generate(prompts, GREEDY)]
    finally:
        plain.shutdown()


def _assert_drafts_accepted_and_rejected(spec: dict) -> None:
    """Verify passes took drafts (accept length > 1) and turned some down, so the running state was
    rolled back to an accepted row at least once."""
    assert spec["request_verify_steps"] > 0 and spec["accept_length"] > 1.0
    accepted_drafts = spec["accepted_tokens"] - spec["request_verify_steps"]  # less each pass's own token
    assert 0 < accepted_drafts < spec["drafted_tokens"]


def test_greedy_output_equals_the_plain_engine(model: str) -> None:
    """Four requests in one batch (drafting or riding along), chunked prefill: the plain engine's tokens;
    drafts were accepted (accept length > 1) and rejected (so the rollback to the accepted row ran), and
    every running and scratch state slot came back."""
    prompts = looping_prompts(4)
    want = plain_tokens(model, prompts, chunked_prefill_size=32)
    engine = Engine(model, **BASE, **NGRAM, chunked_prefill_size=32)
    try:
        out = engine.generate(prompts, GREEDY)
        assert [r.output_ids for r in out] == want
        _assert_drafts_accepted_and_rejected(engine.stats()["speculative"])
        pool = engine.stats()["device_pool"]["recurrent_state"]
        assert pool["scratch_slots"] > 0 and pool["scratch_slots_held"] == 0 and pool["running_slots_held"] == 0
    finally:
        engine.shutdown()


def test_a_prefix_hit_with_ngram_on_gives_the_cold_tokens(model: str) -> None:
    """The next turn of a conversation (the previous prompt + its answer + more) hits the previous prompt's
    snapshot, drafts, and gives the tokens and log-probabilities of a cold run of the same prompt."""
    engine = Engine(model, **BASE, **NGRAM, chunked_prefill_size=64)
    sampling = SamplingParams(max_new_tokens=24, temperature=0.0, logprobs=0)
    try:
        history = looping_prompts(1)[0] * 2
        first = engine.generate([history], sampling)[0]
        rng = random.Random(5)
        history = history + first.output_ids + [rng.randrange(20, 220) for _ in range(9)]
        hit = engine.generate([history], sampling)[0]
        assert hit.cached_tokens > 0 and hit.spec_verify_steps > 0
        cold = engine.generate([history], sampling, cache_salt="cold")[0]
        assert cold.cached_tokens == 0
        assert hit.output_ids == cold.output_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(hit.logprobs, cold.logprobs, strict=True)) < LOGPROB_ATOL
        engine.cache.tree.check_invariants()
    finally:
        engine.shutdown()


@pytest.mark.parallel
@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("model", [m for m in MODELS if "mamba2" not in m], indirect=True)  # (Mamba2: TP refused)
def test_tp2_ranks_draft_and_answer_like_one_plain_rank(model: str, checker: None) -> None:
    """Each rank steps its shard of the recurrent layers and keeps the accepted row's state in its own
    scratch and running slots (the same slot ids on every rank): TP2 with NGRAM gives TP1's plain tokens
    while drafts are accepted and rejected, and the consensus checker sees the ranks agree on every draft
    and acceptance."""
    prompts = looping_prompts(4)
    want = plain_tokens(model, prompts)
    engine = Engine(model, **BASE, **NGRAM, tp_size=2)
    try:
        assert [r.output_ids for r in engine.generate(prompts, GREEDY)] == want
        _assert_drafts_accepted_and_rejected(engine.stats()["speculative"])
        assert engine.group.monitor.divergence is None and engine.group.monitor.compared > 50
    finally:
        engine.shutdown()


@pytest.mark.parametrize("target, draft, says", [
    ("random:lfm2-tiny", "random:tiny", "random:lfm2-tiny has recurrent layers, and --speculative-algorithm "
                                        "STANDALONE is not supported with them"),
    ("random:tiny", "random:gdn-tiny", "the draft model 'random:gdn-tiny' has recurrent layers"),
])
def test_standalone_speculation_with_recurrent_layers_is_refused_in_one_sentence(target: str, draft: str,
                                                                                 says: str) -> None:
    """A recurrent target (its verify passes would hold k states a request) or a recurrent draft (its
    passes keep no state): refused at start-up, each in one sentence that points to NGRAM."""
    with pytest.raises(ConfigError) as e:
        Engine(target, **BASE, speculative_algorithm="STANDALONE", speculative_draft_model_path=draft)
    message = str(e.value)
    assert message.startswith(says) and message.endswith("--speculative-algorithm NGRAM.")
    assert message.count(". ") == 0 and "\n" not in message
