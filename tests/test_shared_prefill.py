"""Requests that arrive together with the same first tokens compute them once
(runtime/shared_prefill.py): the later ones wait for the first one's prompt, then hit its pages."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Callable

import pytest

from hicache import Engine, SamplingParams
from hicache.frontend.loop import EngineLoop
from hicache.runtime.request import Request, Status
from hicache.runtime.shared_prefill import computing_prefix_of

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


def fanned_out(agents: int, system: int, question: int, seed: int = 0) -> list[list[int]]:
    """``agents`` prompts on one ``system``-token prompt, each with its own question."""
    rng = random.Random(seed)
    head = [rng.randrange(5, 250) for _ in range(system)]
    return [head + [rng.randrange(5, 250) for _ in range(question)] for _ in range(agents)]


def engine(**kw) -> Engine:
    opts = dict(dtype="float32", page_size=4, max_total_tokens=8192, chunked_prefill_size=2048)
    return Engine("random:tiny", **{**opts, **kw})


def run_together(eng: Engine, ids: list[list[int]]) -> tuple[list, int]:
    before = eng.stats()["prefill_computed_tokens"]
    results = eng.generate(ids, GREEDY)
    return results, eng.stats()["prefill_computed_tokens"] - before


def test_agents_on_one_system_prompt_compute_it_once() -> None:
    ids = fanned_out(agents=3, system=300, question=20)
    shared, apart = engine(), engine(disable_shared_prefill_wait=True)
    try:
        together, computed = run_together(shared, ids)
        assert together[0].cached_tokens == 0
        assert [r.cached_tokens for r in together[1:]] == [300, 300]  # the system prompt's whole pages
        assert computed == 320 + 20 + 20
        alone, computed_apart = run_together(apart, ids)  # the old behaviour: each computes it
        assert [r.cached_tokens for r in alone] == [0, 0, 0] and computed_apart == 3 * 320
        assert [r.output_ids for r in together] == [r.output_ids for r in alone]  # float32: same greedy tokens
    finally:
        shared.shutdown()
        apart.shutdown()


def test_a_request_waits_for_the_shared_tokens_only_not_the_others_whole_prompt() -> None:
    """A long prompt chunked over many steps shares its first 200 tokens with a short one. The
    long one takes each step's whole token budget until its last chunk; the short one, whose
    shared tokens were cached at the first chunk boundary, joins that last step (it does not
    wait for the long prompt's end) and gets its first token in the same step."""
    rng = random.Random(3)
    head = [rng.randrange(5, 250) for _ in range(200)]
    long, short = head + [rng.randrange(5, 250) for _ in range(1800)], head + [rng.randrange(5, 250) for _ in range(20)]
    eng = engine(chunked_prefill_size=256)
    try:
        a, b = eng.generate([long, short], GREEDY)
        assert b.cached_tokens == 200 and a.cached_tokens == 0
        assert b.ttft_s <= a.ttft_s  # the same step's end; b arrived after a
    finally:
        eng.shutdown()


def test_a_short_shared_head_is_computed_again_rather_than_waited_for() -> None:
    eng = engine()
    try:
        results, computed = run_together(eng, fanned_out(agents=2, system=40, question=60, seed=1))
        assert computed == 2 * 100 and [r.cached_tokens for r in results] == [0, 0]  # 40 < 64 tokens
    finally:
        eng.shutdown()


def test_a_request_waits_only_for_tokens_the_other_has_not_computed() -> None:
    head = list(range(10, 210))
    other = Request(1, head + [7] * 50, GREEDY, "ns", 8)
    req = Request(2, head + [8] * 50, GREEDY, "ns", 8)
    other.status = Status.PREFILL
    assert computing_prefix_of(req, [other]) == 1  # 200 shared, none computed
    assert computing_prefix_of(Request(3, req.prompt_ids, GREEDY, "salted", 8), [other]) is None  # another namespace
    other.computed = 150
    assert computing_prefix_of(req, [other]) is None  # 50 left to share: computing them again is cheaper
    other.computed, other.status = 0, Status.DECODE
    assert computing_prefix_of(req, [other]) is None  # its prompt is done (cached at prefill end)


def sent_late(send: Callable[[Any], None], delay_s: float) -> Callable[[Any], None]:
    """``send`` with each message ``delay_s`` seconds late."""
    def late(item: Any) -> None:
        time.sleep(delay_s)
        send(item)
    return late


@pytest.mark.multirank
def test_tp2_ranks_wait_alike_and_answer_as_one_rank(checker: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule decides on every rank from the requests alone (DESIGN invariant 3): a TP2 engine
    with the consensus checker on waits, hits and answers as one rank does. Each message to the
    leader is sent 20 ms late (a loaded machine): one generate call's prompts still arrive at one
    step (sent one message each, the first ran alone and the second missed its pages: [0, 0, 300])."""
    ids = fanned_out(agents=3, system=300, question=20, seed=4)
    one, two = Engine("random:small", dtype="float32", page_size=4, max_total_tokens=8192), \
        Engine("random:small", dtype="float32", page_size=4, max_total_tokens=8192, tp_size=2)
    monkeypatch.setattr(two.scheduler, "send", sent_late(two.scheduler.send, delay_s=0.02))
    try:
        single, computed = run_together(one, ids)
        ranks, computed_tp = run_together(two, ids)
        assert [r.cached_tokens for r in ranks] == [r.cached_tokens for r in single] == [0, 300, 300]
        assert computed_tp == computed == 360
        assert [r.output_ids for r in ranks] == [r.output_ids for r in single]
    finally:
        one.shutdown()
        two.shutdown()


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=[pytest.mark.multirank, pytest.mark.parallel])])
def test_a_request_arriving_after_the_others_prompt_was_computed_hits_it(tp: int, checker: None) -> None:
    """A fans out first; B, on the same system prompt, arrives once A is decoding (A's prompt was
    computed with nobody waiting, so its pages would enter the tree only at A's finish). B's
    admission caches A's prompt: B computes its question only, and both answer as alone; at TP2
    every rank decides so (the consensus checker on)."""
    a_ids, b_ids = fanned_out(agents=2, system=300, question=20, seed=5)
    eng = engine(tp_size=tp)
    alone = [eng.generate([ids], GREEDY)[0].output_ids for ids in (a_ids, b_ids)]
    eng.flush_cache()
    loop = EngineLoop(eng).start()
    long = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)

    async def fan_out() -> tuple[list, list]:
        a = loop.submit(a_ids, long)
        first = []
        async for u in a:  # B is sent once A has its first token (A decodes on)
            first.append(u)
            if u.token_ids:
                break
        b = [u async for u in loop.submit(b_ids, GREEDY)]
        return first + [u async for u in a], b

    try:
        a_ups, b_ups = asyncio.run(fan_out())
        divergence = eng.group.monitor.divergence if tp > 1 else None
    finally:
        loop.stop()
        eng.shutdown()
    a_res, b_res = a_ups[-1].result, b_ups[-1].result
    if tp > 1:
        assert divergence is None
    assert b_ups[0].cached["device"] == b_res.cached_tokens == 300  # (before: 0, A still decoding)
    assert b_res.output_ids == alone[1] and a_res.output_ids[:len(alone[0])] == alone[0]
