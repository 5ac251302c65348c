"""Retention hints through the engine (issue 60): a hinted agent's prefix survives a flood that
LRU alone evicts, the outcome comes back with the result, hints never change tokens, and the
ranks of a TP group agree on every retention decision (the consensus checker compares them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hicache import Engine, SamplingParams
from hicache.cache_hints import RetentionHint

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


def _engine(**opts) -> Engine:
    # 64 usable pages of 4 tokens: the lead (64 tokens) + a flood of 60-token prompts turn it over
    return Engine("random:tiny", dtype="float32", page_size=4, max_total_tokens=260, **opts)


def _session(engine: Engine, hints: list[RetentionHint]) -> tuple[list[list[int]], dict]:
    """A lead prompt, a flood of unrelated prompts, the lead again: the outputs, the lead's retention
    outcome and its cached tokens the second time."""
    lead = list(range(100, 164))
    first = engine.generate([lead], GREEDY, hints=hints)[0]
    outputs = [first.output_ids]
    for i in range(6):
        outputs.append(engine.generate([[250 + i] + list(range(1, 60))], GREEDY)[0].output_ids)
    again = engine.generate([lead], GREEDY)[0]
    outputs.append(again.output_ids)
    return outputs, {"retention": first.retention, "cached": again.cached_tokens}


def test_a_hinted_prefix_survives_the_flood_and_the_tokens_are_the_same():
    plain, hinted = _engine(), _engine()
    try:
        out_plain, lru = _session(plain, [])
        out_hinted, kept = _session(hinted, [RetentionHint(None, 300.0, ttl="5m")])
        stats = hinted.stats()["retention"]
    finally:
        plain.shutdown()
        hinted.shutdown()
    assert out_plain == out_hinted  # hints never change tokens
    assert lru["retention"] is None and lru["cached"] == 0  # LRU lost the lead to the flood
    outcome = kept["retention"]
    assert outcome.retained_tokens == 64 and outcome.tier == "device" and outcome.clipped is None
    assert outcome.to_json()["until"] > 0
    assert kept["cached"] == 64 - 4  # the whole prompt but its last page (always computed)
    assert stats["hints"] == 1 and stats["retained_tokens"]["device"] >= 64


def test_release_retention_lets_the_flood_take_it():
    engine = _engine()
    try:
        lead = list(range(100, 164))
        engine.generate([lead], GREEDY, hints=[RetentionHint(None, 300.0)])
        released = engine.release_retention(lead)
        for i in range(6):
            engine.generate([[250 + i] + list(range(1, 60))], GREEDY)
        again = engine.generate([lead], GREEDY)[0]
        stats = engine.stats()["retention"]
    finally:
        engine.shutdown()
    assert released == 64  # all that was retained: 67 tokens have KV, 16 whole pages
    assert again.cached_tokens == 0 and stats["released_tokens"] == released


_TP2 = """
import json, os
os.environ["HICACHE_RANK_CONSENSUS_CHECKER"] = "1"
from hicache import Engine, SamplingParams
from hicache.cache_hints import RetentionHint
greedy = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
engine = Engine("random:tiny", tp_size=2, dtype="float32", page_size=4, max_total_tokens=260,
                enable_hierarchical_cache=True, hicache_ratio=2.0, cache_retention_max_fraction=0.2)
try:
    lead = list(range(100, 164))
    first = engine.generate([lead], greedy, hints=[RetentionHint(None, 300.0), RetentionHint(32, 3600.0)])[0]
    for i in range(8):
        engine.generate([[250 + i] + list(range(1, 60))], greedy)
    released = engine.release_retention(lead)
    again = engine.generate([lead], greedy)[0]
    print(json.dumps({"outcome": first.retention.to_json(), "details": again.cached_tokens_details,
                      "released": released, "compared": engine.group.monitor.compared}))
finally:
    engine.shutdown()
"""


@pytest.mark.multirank
@pytest.mark.slow
def test_tp_ranks_agree_on_retention_under_the_consensus_checker():
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_RANK_CONSENSUS_CHECKER"}
    run = subprocess.run([sys.executable, "-c", _TP2], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # device budget int(0.2 * 64) = 12 pages cannot hold the 16-page prompt, the host budget (25 pages) can;
    # the second hint (its first 32 tokens) extends what the first one granted
    assert got["outcome"]["retained_tokens"] == 64 and got["outcome"]["tier"] == "host"
    assert got["outcome"]["clipped"] is None
    assert got["details"]["device"] + got["details"]["host"] == 64 - 4
    assert got["released"] == 64 and got["compared"] > 0
