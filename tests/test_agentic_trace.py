"""The agentic trace (issue 60 item 4): its shape, its determinism, and that the Mooncake loader
reads it back with its agentic fields."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from hicache.sim.agentic import PAUSE_S, QUICK_S, agentic_trace, live_set_tokens, write_trace
from hicache.sim.trace import SHIPPED_TRACE, TraceError, load_trace

pytestmark = pytest.mark.cache


def sessions(reqs):
    out = defaultdict(list)
    for r in reqs:
        out[r.session].append(r)
    return out


def test_shape_lead_subagents_flood():
    reqs = agentic_trace(seed=3)
    by = sessions(reqs)
    assert len(by["lead"]) == 24 and [r.turn for r in by["lead"]] == list(range(1, 25))
    subs = [s for s in by if s.startswith("sub")]
    assert sorted(subs) == ["sub1", "sub2", "sub3", "sub4"]
    assert all(1 <= len(by[s]) <= 3 for s in subs)
    floods = [s for s in by if s.startswith("flood")]
    assert len(floods) == 200 and all(r.cls == "flood" for s in floods for r in by[s])
    assert [r.timestamp_ms for r in reqs] == sorted(r.timestamp_ms for r in reqs)
    for r in reqs:  # whole blocks but a subagent's first (its short task ends in a partial block)
        assert len(r.hash_ids) == -(-r.input_length // 512)
        # Messages a client can rebuild: system first, replies between user blocks, a user block last.
        assert len(r.roles) == len(r.hash_ids) and r.roles[0] == "s" and r.roles[-1] == "u"
        assert "aa" not in r.roles and "as" not in r.roles and "us" not in r.roles


def test_lead_and_subagents_share_a_2_to_4k_prefix_the_flood_does_not():
    reqs = agentic_trace(seed=1)
    by = sessions(reqs)
    lead0 = by["lead"][0]
    n = lead0.hints[0]["blocks"]
    assert 2048 <= n * 512 <= 4096
    prefix = lead0.hash_ids[:n]
    for r in reqs:
        if r.cls in ("lead", "subagent"):
            assert r.hash_ids[:n] == prefix
        else:
            assert not set(r.hash_ids) & set(prefix)
    # A session's turn extends its previous prompt (chained blocks: the cache can hit it all).
    for turns in by.values():
        for a, b in zip(turns, turns[1:]):
            whole = a.input_length // 512
            assert b.hash_ids[:whole] == a.hash_ids[:whole] and len(b.hash_ids) > len(a.hash_ids) - 1


def test_pauses_heavy_tailed_in_range_and_scaled():
    for tf in (1.0, 0.1):
        reqs = agentic_trace(seed=0, time_factor=tf)
        lead = [r for r in reqs if r.cls == "lead"]
        resume = max(lead, key=lambda r: r.pause_s)  # the wait for the subagents may be longer
        paused = [r.pause_s for r in reqs if r.after_pause and r is not resume]
        quick = [r.pause_s for r in reqs if r.turn > 1 and not r.after_pause]
        assert paused and quick and sum(r.after_pause for r in lead) >= 8 and sum(not r.after_pause for r in lead) >= 8
        assert all(PAUSE_S[0] * tf <= p <= PAUSE_S[1] * tf for p in paused)
        assert all(QUICK_S[0] * tf <= p <= QUICK_S[1] * tf for p in quick)
        assert resume.pause_s >= PAUSE_S[0] * tf
        assert max(paused) > 4 * min(paused)  # a tail, not a constant
        assert all(r.pause_s == 0 and not r.after_pause for r in reqs if r.turn == 1)
        # Every flood session starts during one of the lead's pauses.
        windows = [(r.timestamp_ms - r.pause_s * 1000 - 1e-6, r.timestamp_ms) for r in lead if r.after_pause]
        starts = [r.timestamp_ms for r in reqs if r.cls == "flood" and r.turn == 1]
        assert len(starts) == 200 and all(any(a <= t <= b for a, b in windows) for t in starts)


def test_hints_per_client():
    cc = agentic_trace(seed=2, client="claude-code")
    for r in cc:
        if r.cls == "flood":
            assert r.hints == ()
        else:
            assert [h["ttl"] for h in r.hints] == ["1h", "5m"]
            assert r.hints[1]["blocks"] == len(r.hash_ids) and r.hints[0]["seconds"] == 3600
    codex = agentic_trace(seed=2, client="codex")
    assert all(r.hints == ({"blocks": None, "seconds": 86400.0, "ttl": "24h"},) for r in codex if r.cls != "flood")
    with pytest.raises(ValueError, match="client"):
        agentic_trace(client="cursor")


def test_determinism_by_seed_and_block_tokens():
    assert agentic_trace(seed=5) == agentic_trace(seed=5)
    assert agentic_trace(seed=5) != agentic_trace(seed=6)
    small = agentic_trace(seed=5, block_tokens=32)
    big = agentic_trace(seed=5)
    assert [r.hash_ids for r in small] != [] and all(len(r.hash_ids) == -(-r.input_length // 32) for r in small)
    # One seed, one shape: block_tokens changes the tokens per block, not the blocks or the times.
    assert [(r.session, r.turn, r.hash_ids, r.timestamp_ms) for r in small] == \
        [(r.session, r.turn, r.hash_ids, r.timestamp_ms) for r in big]


def test_write_and_load_round_trip(tmp_path):
    reqs = agentic_trace(seed=4, block_tokens=64, lead_turns=6, flood_sessions=10)
    path = tmp_path / "agentic.jsonl"
    write_trace(str(path), reqs)
    line = json.loads(path.read_text().splitlines()[0])
    assert {"timestamp", "input_length", "output_length", "hash_ids", "block_tokens", "class", "session", "turn",
            "after_pause", "hints", "roles"} <= set(line)
    back = load_trace(str(path))
    assert [(r.timestamp_ms, r.hash_ids, r.cls, r.session, r.turn, r.after_pause, r.hints, r.roles,
             r.block_lengths()) for r in back] == \
        [(round(r.timestamp_ms, 3), r.hash_ids, r.cls, r.session, r.turn, r.after_pause, r.hints, r.roles,
          r.block_lengths()) for r in reqs]
    # Mooncake lines still load, with the defaults.
    moon = load_trace(SHIPPED_TRACE, 3)
    assert all(r.block_tokens == 512 and r.cls == "" and r.hints == () for r in moon)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**line, "hints": [{"blocks": "all", "seconds": 1}]}) + "\n")
    with pytest.raises(TraceError, match="line 1: hints"):
        load_trace(str(bad))


def test_live_set_counts_blocks_alive_at_the_peak():
    from hicache.sim.agentic import AgenticRequest

    def req(t, ids):
        return AgenticRequest(t, len(ids) * 10, 1, tuple(ids), 10)

    # Blocks 1-2 live from t=0 to t=3; 3 only at t=1; 4-5 from t=2 to t=3: the peak is 4 blocks.
    reqs = [req(0, [1, 2]), req(1, [1, 3]), req(2, [1, 2, 4, 5]), req(3, [1, 2, 4, 5])]
    assert live_set_tokens(reqs) == 40
    for seed in range(3):  # the flood makes most of the live set: pools sized from it hold the lead
        trace = agentic_trace(seed=seed, block_tokens=64)
        lead = max(r.input_length for r in trace if r.cls == "lead")
        assert 3 * lead < live_set_tokens(trace) < sum(r.input_length for r in trace)
